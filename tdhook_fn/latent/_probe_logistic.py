"""L2-penalised logistic regression on stacked sites by Newton's method, in float64."""

# NOTE [logistic as scikit-learn]
# scikit-learn's ``LogisticRegression`` (lbfgs, ``l1_ratio=0``) minimises
# ``sum_n loss_n + ||W||^2 / (2 C)`` with the intercept unpenalised: the logistic loss on one
# column for two classes, the softmax (multinomial) loss on one row per class for more. The
# objective is strictly convex in ``W``, so its minimiser is the same whatever finds it:
# here damped Newton steps, every site at once, each step's length the best of
# ``1, 1/2, ..., 1/512`` evaluated in one op. A probe of up to 1024 unknowns (classes x
# features) forms its Hessian and solves with one batched Cholesky; a larger one solves by
# preconditioned conjugate gradients on Hessian-vector products (never forming the Hessian,
# whose factorisation would cost ``(K D)^3``).
# Shifting every class's intercept by the same amount leaves the softmax unchanged: that
# direction ``u`` has zero gradient and zero curvature, so ``H + u u^T`` is solved instead
# (its step has no part along ``u``), and the intercepts keep summing to zero as lbfgs's
# from zero do.

from __future__ import annotations

import warnings

import torch

from ._probe_inputs import transformed
from ._probe_ridge import cholesky

__all__ = ["logistic"]

_STEPS = 0.5 ** torch.arange(10, dtype=torch.float64)
_EXACT_SIZE = 1024  # unknowns per probe up to which the Hessian is formed and factored
_MAX_CG = 250


def _hvp(v: torch.Tensor, xt: torch.Tensor, p: torch.Tensor, penalty: torch.Tensor, binary: bool,
         shifted: bool) -> torch.Tensor:
    """The objective's Hessian (with the intercept shift's ``u u^T``) times ``v (..., K, P)``, never formed."""
    z = xt @ v.mT
    r = p * (1 - p) * z if binary else p * z - p * (p * z).sum(-1, keepdim=True)
    out = r.mT @ xt + penalty * v
    if shifted:
        out = out + torch.nn.functional.pad(v[..., :, -1:].sum(-2, keepdim=True).expand_as(v[..., :, -1:]),
                                            (v.shape[-1] - 1, 0))
    return out


def _conjugate_gradient(grad: torch.Tensor, xt: torch.Tensor, p: torch.Tensor, penalty: torch.Tensor,
                        binary: bool, shifted: bool) -> torch.Tensor:
    """The Newton step ``H^-1 grad`` by Jacobi-preconditioned conjugate gradients, every probe at once.

    Solved to a relative residual ``min(0.1, sqrt(|grad|))``: inexact early, exact near the
    optimum, so the outer Newton iteration still converges superlinearly (truncated Newton).
    """
    diagonal = (p * (1 - p)).mT @ (xt * xt) + penalty
    if shifted:
        diagonal = diagonal + torch.nn.functional.pad(torch.ones_like(diagonal[..., -1:]), (diagonal.shape[-1] - 1, 0))
    size = torch.linalg.vector_norm(grad, dim=(-2, -1))
    goal = torch.minimum(torch.full_like(size, 0.1), size.sqrt()) * size
    step, residual = torch.zeros_like(grad), grad
    preconditioned = residual / diagonal
    direction = preconditioned
    rz = (residual * preconditioned).sum((-2, -1), keepdim=True)
    for _ in range(_MAX_CG):
        curved = _hvp(direction, xt, p, penalty, binary, shifted)
        dq = (direction * curved).sum((-2, -1), keepdim=True)
        rate = torch.where(dq > 0, rz / torch.where(dq > 0, dq, 1), 0)
        step = step + rate * direction
        residual = residual - rate * curved
        if not transformed() and bool((torch.linalg.vector_norm(residual, dim=(-2, -1)) <= goal).all()):
            break
        preconditioned = residual / diagonal
        rz_next = (residual * preconditioned).sum((-2, -1), keepdim=True)
        direction = preconditioned + torch.where(rz > 0, rz_next / torch.where(rz > 0, rz, 1), 0) * direction
        rz = rz_next
    return step


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
    caller: str,
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
    exact = k * width <= _EXACT_SIZE
    for _ in range(max_iter):
        logits = xt @ theta.mT
        p = torch.sigmoid(logits) if binary else torch.softmax(logits, -1)
        grad = (p - y).mT @ xt + penalty * theta
        if exact:
            factor = cholesky(caller, _hessian(xt, p, binary) + curvature, keys)
            step = torch.cholesky_solve(grad.flatten(-2)[..., None], factor)[..., 0].reshape(grad.shape)
        else:
            step = _conjugate_gradient(grad, xt, p, penalty, binary, shifted=fit_intercept and not binary)
        trials = theta - steps.reshape(-1, *[1] * theta.ndim) * step
        best = _objective(trials, xt, y, penalty, binary).argmin(0)
        theta = trials.gather(0, best[None, ..., None, None].expand(1, *theta.shape))[0]
        if fit_intercept and not binary:  # an inexact step drifts along the shift: intercepts sum to zero
            mean = theta[..., :, -1:].mean(-2, keepdim=True)
            theta = theta - torch.nn.functional.pad(mean.expand_as(theta[..., :, -1:]), (width - 1, 0))
        if not transformed() and float((step * steps[best][..., None, None]).abs().max()) < tol:
            converged = True
            break
    if not converged and not transformed():
        warnings.warn(f"{caller}: logistic probes did not converge in max_iter={max_iter} Newton steps", RuntimeWarning,
                      stacklevel=3)
    weight, bias = (theta[..., :-1], theta[..., -1]) if fit_intercept else (theta, torch.zeros_like(theta[..., 0]))
    return weight.to(x.dtype), bias.to(x.dtype)
