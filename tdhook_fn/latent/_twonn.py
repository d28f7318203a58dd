"""TwoNN (Facco et al. 2017): one intrinsic dimension per point cloud."""

# NOTE [TwoNN fit]
# ``mu = r2 / r1`` (second over first neighbour distance) follows a Pareto law with index
# ``d``: ``-log(1 - F(mu)) = d log(mu)``. The ratios of the points with two neighbours
# are sorted, the empirical ``F`` of the ``i``-th is ``i / n`` (``n`` such points), and
# ``d`` is the slope of the least-squares line through the origin, ``sum(x y) / sum(x x)``
# with ``x = log(mu)``, ``y = -log(1 - F)``, over the ``floor(n (1 - discard_fraction))``
# smallest ratios (at most ``n - 1``: the largest has ``F = 1``). Facco et al. drop the
# largest 10%, which are the most sensitive to noise and to density changes; tdhook 0.1.3
# drops only the last (``discard_fraction=0``). Clouds of different sizes ``n`` share one
# batched sort: points without two neighbours get ``mu = inf`` and sort last.

from __future__ import annotations

import math
from typing import Literal, overload

import torch

from ._neighbours import check_eps, check_points, nearest

__all__ = ["two_nn"]


@overload
def two_nn(x: torch.Tensor, *, discard_fraction: float = ..., eps: float = ...,
           return_xy: Literal[False] = ...) -> torch.Tensor: ...
@overload
def two_nn(x: torch.Tensor, *, discard_fraction: float = ..., eps: float = ...,
           return_xy: Literal[True]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
def two_nn(
    x: torch.Tensor, *, discard_fraction: float = 0.1, eps: float = 1e-5, return_xy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The TwoNN intrinsic dimension of each point cloud (Facco et al. 2017).

    From each point's two nearest neighbours only (one ``topk``), so it holds on curved
    manifolds and non-uniform densities. ``mu = r2 / r1`` follows a Pareto law of index
    ``d``, so ``-log(1 - F(mu)) = d log(mu)``: ``d`` is the slope, through the origin, of
    that line over the sorted ratios (their empirical ``F`` is ``i / n``).

    Args:
        x (Tensor): ``(..., N, D)`` floating point, ``N >= 3``: leading dims are batch dims
            (one cloud of ``N`` points each), all computed in one batched op.
        discard_fraction (float): the share of the largest ratios ``r2 / r1`` left out of
            the fit, in ``[0, 1)``. Default: ``0.1`` (Facco et al.); ``0`` fits all but the
            last, as tdhook 0.1.3.
        eps (float): points closer than this are duplicates, not neighbours (excluded, as
            in tdhook). Default: ``1e-5``.
        return_xy (bool): also return the fitted points. Default: ``False``.

    Returns:
        Tensor: ``(...)`` dimensions, ``x``'s dtype; ``nan`` for a cloud with fewer than 3
        points that have two neighbours farther than ``eps``, no ratio left to fit, or
        fitted ratios that all equal 1 (each point's two neighbours equally far, as on a
        regular grid: no slope; add a little noise, or use another estimator).
        With ``return_xy``, also ``log(mu)`` and ``-log(1 - F)`` of the fitted ratios,
        ``(..., N - 1)`` each, in increasing order, ``nan``-padded at the end.

    Raises:
        TypeError: ``x`` not a floating tensor.
        ValueError: ``N < 3``, ``discard_fraction`` outside ``[0, 1)``, ``eps < 0``.

    Examples:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> plane = torch.randn(2000, 2, generator=g, dtype=torch.float64) @ torch.randn(2, 10, generator=g,
        ...                                                                              dtype=torch.float64)
        >>> round(two_nn(plane).item())
        2
        >>> layers = torch.randn(3, 500, 8, generator=g)  # a batch: one dimension per layer
        >>> two_nn(layers).shape
        torch.Size([3])
        >>> torch.vmap(two_nn)(layers).shape
        torch.Size([3])
    """
    x = check_points("two_nn", x, 3, "each needs two neighbours")
    if isinstance(discard_fraction, bool) or not isinstance(discard_fraction, (int, float)) \
            or not 0 <= discard_fraction < 1:
        raise ValueError(f"two_nn: discard_fraction must be in [0, 1), got {discard_fraction!r}")
    eps = check_eps("two_nn", eps)
    r, _ = nearest(x, 2, eps)
    has_two = torch.isfinite(r[..., 1])
    mu = torch.where(has_two, r[..., 1] / r[..., 0], torch.inf)
    log_mu = torch.sort(mu, dim=-1).values.log()
    count = has_two.sum(-1, keepdim=True).double()
    # (1 + 1e-12): 10 * (1 - 0.3) is 6.999...; the share kept is meant exactly
    kept = torch.minimum(torch.floor(count * (1 - discard_fraction) * (1 + 1e-12)), count - 1)
    fitted = torch.arange(1, x.shape[-2] + 1, device=x.device, dtype=torch.float64) <= kept
    n = count.to(x.dtype)
    rank = torch.arange(1, x.shape[-2] + 1, device=x.device, dtype=x.dtype)
    survival = torch.where(fitted, 1 - rank / n, 1.0)  # 1 where not fitted: no log(0)
    log_x = torch.where(fitted, log_mu, 0.0)
    log_y = -survival.log()
    slope = (log_x * log_y).sum(-1) / (log_x * log_x).sum(-1)
    dimension = torch.where((count.squeeze(-1) >= 3) & (kept.squeeze(-1) >= 1), slope, math.nan)
    if not return_xy:
        return dimension
    nan = torch.tensor(math.nan, dtype=x.dtype, device=x.device)
    return dimension, torch.where(fitted, log_mu, nan)[..., :-1], torch.where(fitted, log_y, nan)[..., :-1]
