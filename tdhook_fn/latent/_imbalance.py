"""Information imbalance from nearest neighbours and counts, without sorting distances.

# NOTE [ranks by counting]
Delta(A -> B) = 2/N * mean_i r^B_i(j_i), where j_i is i's nearest neighbour in A and
r^B_i(j) is the rank of j among i's neighbours in B (1 for the nearest; i itself is
excluded, tdhook's rank 0). Only one rank per row is needed, so instead of sorting the
N x N distances (N^2 log N) the neighbour is an ``argmin`` and its rank is
``1 + #{k != i : d_B(i, k) < d_B(i, j_i)}`` (N^2). Ties: the neighbour is the lowest
index among the closest points (``argmin``), and points tied with it in B do not count
(its rank is the best of the tie). tdhook orders ties by an unstable ``argsort``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._similarity_inputs import batch_shape, for_both


def imbalance_impl(x: Tensor, y: Tensor, *, p: float) -> tuple[Tensor, Tensor]:
    """Delta(x -> y) and Delta(y -> x) of checked float inputs, batch dims broadcast."""
    dist_x, dist_y = for_both(lambda _, t: _neighbour_distances(t, p), x, y)
    shape = batch_shape(x, y)
    return _directed(dist_x, dist_y, shape), _directed(dist_y, dist_x, shape)


def _neighbour_distances(t: Tensor, p: float) -> Tensor:
    """Pairwise ``p``-distances, ``inf`` on the diagonal so a point is never its own neighbour."""
    dist = torch.cdist(t, t, p=p)
    n = t.shape[-2]
    eye = torch.eye(n, dtype=torch.bool, device=t.device)
    return torch.where(eye, torch.full((), torch.inf, dtype=dist.dtype, device=dist.device), dist)


def _directed(source: Tensor, target: Tensor, shape: torch.Size) -> Tensor:
    """Delta(source -> target) from ``(..., N, N)`` distances; source and target batch dims broadcast."""
    n = source.shape[-1]
    neighbour = source.argmin(-1, keepdim=True).expand(*shape, n, 1)
    chosen = target.expand(*shape, n, n).gather(-1, neighbour)
    rank = 1 + (target < chosen).sum(-1, dtype=torch.int32)  # int32: a faster reduction than int64's
    return rank.to(source.dtype).mean(-1) * (2.0 / n)
