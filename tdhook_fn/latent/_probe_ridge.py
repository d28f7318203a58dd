"""Ridge regression on stacked sites: sufficient statistics, their merge, and the batched solves."""

# NOTE [ridge as scikit-learn]
# scikit-learn's ``Ridge`` centres ``X`` and ``y`` when it fits an intercept (which is then
# not penalised: ``b = mean(y) - W mean(X)``) and solves ``(Xc^T Xc + alpha I) W^T = Xc^T yc``,
# or the dual ``W^T = Xc^T (Xc Xc^T + alpha I)^-1 yc`` when there are more features than
# samples; both are what this file does, batched over the leading dims. The solves are a
# Cholesky factor and ``cholesky_solve``: torch 2.13's batched CPU ``linalg.solve`` returns
# wrong numbers without an error for a few systems of size ~160 (pytorch#142815).
#
# NOTE [ridge statistics]
# A site's statistics are its count ``n``, the means of ``x`` and ``y`` and the centred
# cross-products ``Cxx = sum (x - mx)(x - mx)^T`` and ``Cxy = sum (x - mx)(y - my)^T``. Two
# parts merge exactly (Chan et al.'s pairwise update: ``C = Ca + Cb + na nb / n d d^T``
# with ``d`` the difference of the means), so a dataset streamed in batches gives the
# statistics of the whole and the same probe; centring first keeps float32 accurate where
# raw ``X^T X - n mx mx^T`` would cancel.

from __future__ import annotations

import torch

from ._probe_inputs import transformed

__all__ = ["Stats", "cholesky", "dual_solve", "merge", "solve", "statistics"]

Stats = dict[str, torch.Tensor]  # count (...), mean_x (..., D), mean_y (..., K), cxx (..., D, D), cxy (..., D, K)


def statistics(x: torch.Tensor, y: torch.Tensor) -> Stats:
    """The statistics of ``x (..., N, D)`` against ``y (N, K)`` (NOTE [ridge statistics])."""
    batch = x.shape[:-2]
    mean_x = x.mean(-2)
    mean_y = y.mean(-2)
    xc = x - mean_x[..., None, :]
    yc = y - mean_y
    return {
        "count": torch.full(batch, x.shape[-2], dtype=x.dtype, device=x.device),
        "mean_x": mean_x,
        "mean_y": mean_y.expand(*batch, -1),
        "cxx": xc.mT @ xc,
        "cxy": xc.mT @ yc,
    }


def merge(a: Stats, b: Stats) -> Stats:
    """The statistics of two parts' samples together (NOTE [ridge statistics])."""
    n = a["count"] + b["count"]
    share = (b["count"] / n)[..., None]
    dx = b["mean_x"] - a["mean_x"]
    dy = b["mean_y"] - a["mean_y"]
    weight = (a["count"] * b["count"] / n)[..., None, None]
    return {
        "count": n,
        "mean_x": a["mean_x"] + share * dx,
        "mean_y": a["mean_y"] + share * dy,
        "cxx": a["cxx"] + b["cxx"] + weight * dx[..., :, None] * dx[..., None, :],
        "cxy": a["cxy"] + b["cxy"] + weight * dx[..., :, None] * dy[..., None, :],
    }


def cholesky(caller: str, a: torch.Tensor, keys: list[str]) -> torch.Tensor:
    """The lower Cholesky factor of SPD ``a (..., M, M)``; a singular one is refused by site."""
    factor: torch.Tensor
    if transformed():
        factor = torch.linalg.cholesky(a)
        return factor
    factor, info = torch.linalg.cholesky_ex(a)
    bad = (info != 0).reshape(-1)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        where = keys[first] if len(keys) == bad.numel() else f"batch element {first}"
        raise ValueError(
            f"{caller}: the normal equations of site {where!r} are singular (constant features with alpha=0?); "
            "use alpha > 0"
        )
    return factor


def _ridge_term(alpha: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``alpha I`` shaped as ``like (..., M, M)``, ``alpha`` a float or a tensor over the batch dims."""
    eye = torch.eye(like.shape[-1], dtype=like.dtype, device=like.device)
    return torch.as_tensor(alpha, dtype=like.dtype, device=like.device)[..., None, None] * eye


def solve(
    caller: str, stats: Stats, alpha: float | torch.Tensor, fit_intercept: bool, keys: list[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight (..., K, D)`` and ``bias (..., K)`` from statistics: the primal system, ``D x D``."""
    cxx, cxy, mean_x, mean_y = stats["cxx"], stats["cxy"], stats["mean_x"], stats["mean_y"]
    if not fit_intercept:  # back to raw cross-products: nothing is centred
        n = stats["count"][..., None, None]
        cxx = cxx + n * mean_x[..., :, None] * mean_x[..., None, :]
        cxy = cxy + n * mean_x[..., :, None] * mean_y[..., None, :]
    factor = cholesky(caller, cxx + _ridge_term(alpha, cxx), keys)
    weight_t = torch.cholesky_solve(cxy, factor)
    if not fit_intercept:
        return weight_t.mT, torch.zeros_like(mean_y)
    return weight_t.mT, mean_y - (mean_x[..., None, :] @ weight_t)[..., 0, :]


def dual_solve(
    caller: str, x: torch.Tensor, y: torch.Tensor, alpha: float | torch.Tensor, fit_intercept: bool, keys: list[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight (..., K, D)`` and ``bias (..., K)`` from the ``N x N`` kernel system (fewer samples than features)."""
    mean_x = x.mean(-2, keepdim=True) if fit_intercept else torch.zeros_like(x[..., :1, :])
    mean_y = y.mean(-2, keepdim=True) if fit_intercept else torch.zeros_like(y[..., :1, :])
    xc = x - mean_x
    gram = xc @ xc.mT
    factor = cholesky(caller, gram + _ridge_term(alpha, gram), keys)
    dual = torch.cholesky_solve((y - mean_y).expand(*x.shape[:-2], -1, -1), factor)
    weight_t = xc.mT @ dual
    bias = (mean_y - mean_x @ weight_t)[..., 0, :]
    return weight_t.mT, bias
