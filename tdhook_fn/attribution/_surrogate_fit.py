"""The interpretable linear models of LIME and KernelSHAP, fitted for every sample and target at once."""

# NOTE [batched surrogate fits]
# captum fits one scikit-learn model per sample (``Lasso(alpha=0.01)`` for LIME,
# ``LinearRegression`` for KernelSHAP), each with an intercept and sample weights. Here
# the interpretable samples ``X [*B, n, F]``, the outputs ``y [*B, n, T]`` and the weights
# ``w [*B, n]`` of every sample and target are fitted together:
#
# - least squares and ridge are one least-squares solve of the weighted, centred data
#   (ridge as ``sqrt(alpha) I`` rows below it), the minimum-norm solution where the
#   samples do not fix every coefficient, as scikit-learn's
#   (NOTE [deterministic least squares]). No normal equations: KernelSHAP's end-point weights (1e6) square to a
#   condition number float32 cannot hold, and torch's CPU batched ``linalg.solve`` is
#   unreliable (pytorch#142815).
# - the lasso minimises scikit-learn's objective ``1/2 sum_i p_i (y_i - b - x_i.c)^2 +
#   alpha |c|_1`` (``p`` the weights normalised to sum 1) by accelerated proximal gradient
#   on the Gram matrix, polished as it goes: on the signs found, the optimum is the
#   solution of a linear system, taken once it satisfies the lasso's optimality conditions
#   for every sample and target. So the result is the optimum to rounding, where
#   scikit-learn stops at its ``tol=1e-4``.
#
# The intercepts are the weighted means' difference, as scikit-learn's ``fit_intercept``.

from __future__ import annotations

from collections.abc import Callable

import torch

from .._targets import values_readable

__all__ = ["FitFn", "lasso", "least_squares", "minimum_norm_solution", "ridge"]

FitFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _centred(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` and ``y`` minus their weighted means, and the weights normalised to sum 1."""
    p = w / w.sum(-1, keepdim=True)
    x_mean = (p.unsqueeze(-2) @ x).squeeze(-2)
    y_mean = (p.unsqueeze(-2) @ y).squeeze(-2)
    return x - x_mean.unsqueeze(-2), y - y_mean.unsqueeze(-2), p


def least_squares(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Weighted least squares with an intercept: coefficients ``[*B, T, F]`` (scikit-learn's ``LinearRegression``)."""
    return ridge(x, y, w, 0.0)


def ridge(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    """``min sum_i w_i (y_i - b - x_i.c)^2 + alpha |c|^2`` per sample and target: ``[*B, T, F]`` (``Ridge``)."""
    xc, yc, _ = _centred(x, y, w)
    root = w.sqrt().unsqueeze(-1)  # (w itself, not normalised: scikit-learn's Ridge weighs so)
    a, b = root * xc, root * yc
    if alpha > 0:
        n_features = x.shape[-1]
        eye = torch.eye(n_features, dtype=x.dtype, device=x.device) * alpha ** 0.5
        a = torch.cat([a, eye.expand(*a.shape[:-2], n_features, n_features)], -2)
        b = torch.cat([b, b.new_zeros(*b.shape[:-2], n_features, b.shape[-1])], -2)
    return minimum_norm_solution(a, b).transpose(-1, -2)


def lasso(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, alpha: float, max_iter: int = 2000) -> torch.Tensor:
    """``min 1/2 sum_i p_i (y_i - b - x_i.c)^2 + alpha |c|_1`` per sample and target: ``[*B, T, F]`` (``Lasso``)."""
    xc, yc, p = _centred(x, y, w)
    weighted = xc * p.unsqueeze(-1)
    gram = weighted.transpose(-1, -2) @ xc  # [*B, F, F]
    corr = (weighted.transpose(-1, -2) @ yc).transpose(-1, -2)  # [*B, T, F]
    return _proximal_gradient(gram, corr, alpha, max_iter)


def minimum_norm_solution(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``argmin |a x - b|`` of least norm, batched, rank-deficient ``a`` too."""
    # NOTE [deterministic least squares]
    # On the CPU, LAPACK's divide-and-conquer SVD solver (``gelsd``, scikit-learn's too);
    # torch's default ``gelsy`` gives other bits on repeated identical calls (measured:
    # about one call in three, float32 and float64, torch 2.13). Elsewhere the
    # pseudo-inverse: CUDA's ``lstsq`` has only ``gels``, which assumes full rank, and
    # ``torch.compile`` cannot trace ``lstsq`` (its outputs' shapes depend on the data).
    if a.device.type == "cpu" and not torch.compiler.is_compiling():
        solution: torch.Tensor = torch.linalg.lstsq(a, b, driver="gelsd").solution
        return solution
    pseudo_inverse: torch.Tensor = torch.linalg.pinv(a)
    return pseudo_inverse @ b


def _soft(v: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
    return torch.sign(v) * torch.clamp(v.abs() - t, min=0)


def _proximal_gradient(gram: torch.Tensor, corr: torch.Tensor, alpha: float, max_iter: int) -> torch.Tensor:
    """FISTA with gradient restarts, polished (`_polished`) every 50 steps until every polish is optimal.

    Where the values cannot be read (``vmap``, ``torch.compile``) all ``max_iter`` steps
    run and one polish follows.
    """
    lipschitz = torch.linalg.eigvalsh(gram)[..., -1:].clamp(min=torch.finfo(gram.dtype).tiny).unsqueeze(-2)
    step = 1 / lipschitz  # [*B, 1, 1]
    coef = torch.zeros_like(corr)
    moving, t = coef, 1.0
    concrete = values_readable(gram)
    for i in range(max_iter):
        new = _soft(moving - step * (moving @ gram - corr), alpha * step)
        t_next = (1 + (1 + 4 * t * t) ** 0.5) / 2
        restart = ((moving - new) * (new - coef)).sum(-1, keepdim=True) > 0
        moving = torch.where(restart, new, new + (t - 1) / t_next * (new - coef))
        coef, t = new, t_next
        if concrete and i % 50 == 49:
            polished, optimal = _polished(gram, corr, coef, alpha)
            if bool(optimal.all()):
                return polished
    polished, optimal = _polished(gram, corr, coef, alpha)
    return torch.where(optimal, polished, coef)


def _polished(gram: torch.Tensor, corr: torch.Tensor, coef: torch.Tensor,
              alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The solution on ``coef``'s signs (``G_SS c_S = r_S - alpha s_S``), and where it is the optimum ``[*B, T, 1]``.

    It is where the lasso's optimality conditions hold: no inactive coefficient's
    correlation with the residual exceeds ``alpha`` and no active one changed sign.
    """
    active = coef != 0
    sign = torch.sign(coef)
    n_features = gram.shape[-1]
    eye = torch.eye(n_features, dtype=gram.dtype, device=gram.device)
    both = active.unsqueeze(-1) & active.unsqueeze(-2)  # [*B, T, F, F]
    system = torch.where(both, gram.unsqueeze(-3), eye * (~active).unsqueeze(-1))
    rhs = torch.where(active, corr - alpha * sign, torch.zeros_like(corr))
    exact = minimum_norm_solution(system, rhs.unsqueeze(-1)).squeeze(-1)
    residual = corr - exact @ gram  # (gram is symmetric: row-wise exact @ gram is gram @ exact)
    scale = corr.abs().amax(-1, keepdim=True) + alpha
    slack = 64 * torch.finfo(gram.dtype).eps * scale
    ok = torch.where(active, torch.sign(exact) == sign, residual.abs() <= alpha + slack)
    return exact, ok.all(-1, keepdim=True)
