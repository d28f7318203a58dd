"""L2-penalised logistic regression on stacked sites by Newton's method, in float64.

# NOTE [logistic as scikit-learn]
scikit-learn's ``LogisticRegression`` (lbfgs, ``l1_ratio=0``) minimises
``sum_n loss_n + ||W||^2 / (2 C)`` with the intercept unpenalised: the logistic loss on one
column for two classes, the softmax (multinomial) loss on one row per class for more. The
objective is strictly convex in ``W``, so its minimiser is the same whatever finds it:
here damped Newton steps, every site at once (the Hessian of all sites is one batched
Cholesky), each step's length the best of ``1, 1/2, ..., 1/512`` evaluated in one op.
Shifting every class's intercept by the same amount leaves the softmax unchanged: that
direction ``u`` has zero gradient and zero curvature, so ``H + u u^T`` is solved instead
(its step has no part along ``u``), and the intercepts keep summing to zero as lbfgs's
from zero do.
"""

from __future__ import annotations

import warnings

import torch

from ._probe_inputs import transformed
from ._probe_ridge import cholesky

__all__ = ["logistic"]

_STEPS = 0.5 ** torch.arange(10, dtype=torch.float64)


def _loss(logits: torch.Tensor, y: torch.Tensor, binary: bool) -> torch.Tensor:
    """Summed loss over samples: logits ``(..., N, K)``, y ``(N, K)`` of 0/1."""
    if binary:
        return (torch.nn.functional.softplus(logits) - y * logits).sum((-2, -1))
    return (torch.logsumexp(logits, -1) - (y * logits).sum(-1)).sum(-1)


def _objective(
    theta: torch.Tensor, xt: torch.Tensor, y: torch.Tensor, penalty: torch.Tensor, binary: bool
) -> torch.Tensor:
    return _loss(xt @ theta.mT, y, binary) + 0.5 * (penalty * theta**2).sum((-2, -1))


def _hessian(xt: torch.Tensor, p: torch.Tensor, binary: bool) -> torch.Tensor:
    """The loss's Hessian ``(..., K P, K P)`` at probabilities ``p (..., N, K)``."""
    if binary:
        return (xt * (p * (1 - p))).mT @ xt
    k, width = p.shape[-1], xt.shape[-1]
    within = (p.mT[..., :, :, None] * xt[..., None, :, :]).mT @ xt[..., None, :, :]  # diag(p) blocks (..., K, P, P)
    outer = (p[..., :, :, None] * xt[..., :, None, :]).flatten(-2)  # (..., N, K P)
    eye = torch.eye(k, dtype=p.dtype, device=p.device)
    blocks = within[..., :, :, None, :] * eye[:, None, :, None]
    return blocks.reshape(*blocks.shape[:-4], k * width, k * width) - outer.mT @ outer


def logistic(
    method: str,
    x: torch.Tensor,
    index: torch.Tensor,
    n_classes: int,
    *,
    C: float,
    fit_intercept: bool,
    max_iter: int,
    tol: float,
    keys: list[str],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight (..., K, D)`` and ``bias (..., K)`` of the penalised logistic fit (NOTE [logistic as scikit-learn])."""
    x64 = x.to(torch.float64)
    ones = torch.ones_like(x64[..., :1])
    xt = torch.cat([x64, ones], -1) if fit_intercept else x64
    binary = n_classes == 2
    y = torch.nn.functional.one_hot(index, n_classes).to(torch.float64)
    y = y[:, 1:] if binary else y
    k, width = y.shape[-1], xt.shape[-1]
    penalty = torch.full((width,), 1.0 / C, dtype=torch.float64, device=x.device)
    if fit_intercept:
        penalty[-1] = 0.0
    curvature = torch.diag_embed(penalty.repeat(k))
    if fit_intercept and not binary:  # NOTE [logistic as scikit-learn]: the shift of all intercepts
        shift = torch.zeros(k, width, dtype=torch.float64, device=x.device)
        shift[:, -1] = 1.0
        curvature = curvature + shift.reshape(-1, 1) @ shift.reshape(1, -1)
    steps = _STEPS.to(x.device)
    theta = torch.zeros(*x.shape[:-2], k, width, dtype=torch.float64, device=x.device)
    converged = False
    for _ in range(max_iter):
        logits = xt @ theta.mT
        p = torch.sigmoid(logits) if binary else torch.softmax(logits, -1)
        grad = (p - y).mT @ xt + penalty * theta
        factor = cholesky(method, _hessian(xt, p, binary) + curvature, keys)
        step = torch.cholesky_solve(grad.flatten(-2)[..., None], factor)[..., 0].reshape(grad.shape)
        trials = theta - steps.reshape(-1, *[1] * theta.ndim) * step
        best = _objective(trials, xt, y, penalty, binary).argmin(0)
        theta = trials.gather(0, best[None, ..., None, None].expand(1, *theta.shape))[0]
        if not transformed() and float((step * steps[best][..., None, None]).abs().max()) < tol:
            converged = True
            break
    if not converged and not transformed():
        warnings.warn(f"{method}: logistic probes did not converge in max_iter={max_iter} Newton steps", RuntimeWarning,
                      stacklevel=3)
    weight, bias = (theta[..., :-1], theta[..., -1]) if fit_intercept else (theta, torch.zeros_like(theta[..., 0]))
    return weight.to(x.dtype), bias.to(x.dtype)
