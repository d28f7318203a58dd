"""Local intrinsic dimension from the k-th and 2k-th neighbour distances (Farahmand et al. 2007)."""

from __future__ import annotations

import math

import torch

from ._neighbours import check_eps, check_k, check_points, nearest

__all__ = ["local_knn"]


def local_knn(x: torch.Tensor, k: int, *, eps: float = 1e-5) -> torch.Tensor:
    """Each point's dimension ``ln 2 / ln(R_2k / R_k)`` (Farahmand, Szepesvari and Audibert 2007).

    In ``d`` dimensions the number of points within ``R`` grows as ``R^d``, so doubling
    the count (``k`` to ``2k``) multiplies the radius by ``2^(1/d)``. Average the
    per-point values (or take their median) for one dimension per cloud.

    Args:
        x (Tensor): ``(..., N, D)`` floating point, ``N >= 2k + 1``; leading dims are batch dims.
        k (int): the neighbour count, ``>= 1``.
        eps (float): points closer than this are duplicates, not neighbours (excluded, as
            in tdhook). Default: ``1e-5``.

    Returns:
        Tensor: ``(..., N)``, ``x``'s dtype; ``nan`` where a point has fewer than ``2k``
        neighbours farther than ``eps`` or ``R_2k == R_k``.

    Raises:
        TypeError: ``x`` not a floating tensor, ``k`` not an int.
        ValueError: ``k < 1``, ``N < 2k + 1``, ``eps < 0``.

    Examples:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> cube = torch.rand(4000, 3, generator=g, dtype=torch.float64)
        >>> round(local_knn(cube, 10).median().item())
        3
        >>> local_knn(torch.randn(4, 100, 5), 5).shape  # four clouds at once
        torch.Size([4, 100])
    """
    k = check_k("local_knn", k)
    x = check_points("local_knn", x, 2 * k + 1, f"2k + 1 with k={k}")
    eps = check_eps("local_knn", eps)
    r, _ = nearest(x, 2 * k, eps)
    r_k, r_2k = r[..., k - 1], r[..., 2 * k - 1]
    valid = torch.isfinite(r_2k) & (r_2k > r_k)
    ratio = torch.where(valid, r_2k / r_k, 2.0)  # 2.0: any finite placeholder, masked below
    return torch.where(valid, math.log(2) / ratio.log(), math.nan)
