"""Information imbalance from nearest neighbours and counts, without sorting distances."""

# NOTE [ranks by counting]
# Delta(A -> B) = 2/N * mean_i r^B_i(j_i), where j_i is i's nearest neighbour in A and
# r^B_i(j) is the rank of j among i's neighbours in B (1 for the nearest; i itself is
# excluded, tdhook's rank 0). Only one rank per row is needed, so instead of sorting the
# N x N distances (N^2 log N) the neighbour is an ``argmin`` and its rank is
# ``1 + #{k != i : d_B(i, k) < d_B(i, j_i)}`` (N^2). Ties: the neighbour is the lowest
# index among the closest points (``argmin``), and points tied with it in B do not count
# (its rank is the best of the tie). tdhook orders ties by an unstable ``argsort``.

from __future__ import annotations

import torch
from torch import Tensor

from ._similarity_inputs import batch_shape, for_both, same_values, sample_range


def imbalance_impl(x: Tensor, y: Tensor, *, p: float) -> tuple[Tensor, Tensor]:
    """Delta(x -> y) and Delta(y -> x) of checked float inputs, batch dims broadcast."""
    for_both(lambda arg, t: sample_range("information_imbalance", arg, t), x, y)
    dist_x, dist_y = for_both(lambda _, t: _neighbour_distances(t, p), x, y)
    shape = batch_shape(x, y)
    x_to_y = _directed(dist_x, dist_y, shape)
    swap = _swapped_pairs(x, y) if same_values(x, y) else None
    if swap is not None:  # the all-pairs call: y -> x of pair (a, b) is x -> y of pair (b, a)
        return x_to_y, x_to_y.permute(swap)
    return x_to_y, _directed(dist_y, dist_x, shape)


def _swapped_pairs(x: Tensor, y: Tensor) -> list[int] | None:
    """The dims order mapping pair (a, b) to (b, a), when ``y`` is ``x`` with its batch dims moved apart.

    ``x`` and ``y`` hold the same values (`same_values`); ``None`` when their batch dims
    overlap without coinciding.
    """
    nd = len(batch_shape(x, y))
    pad_x = (1,) * (nd - (x.ndim - 2)) + tuple(x.shape[:-2])
    pad_y = (1,) * (nd - (y.ndim - 2)) + tuple(y.shape[:-2])
    own_x = [i for i in range(nd) if pad_x[i] != 1]
    own_y = [i for i in range(nd) if pad_y[i] != 1]
    order = list(range(nd))
    if own_x == own_y:
        return order
    if set(own_x) & set(own_y):
        return None
    for i, j in zip(own_x, own_y, strict=True):
        order[i], order[j] = j, i
    return order


def _neighbour_distances(t: Tensor, p: float) -> Tensor:
    """Pairwise ``p``-distances, ``inf`` on the diagonal so a point is never its own neighbour; of the centred
    points, whose rounding does not grow with a common offset (NOTE [exact duplicates])."""
    centred = t - t.mean(-2, keepdim=True)
    dist = torch.cdist(centred, centred, p=p)
    dist.diagonal(dim1=-2, dim2=-1).fill_(torch.inf)  # our own fresh tensor: in place saves a pass
    return dist


def _directed(source: Tensor, target: Tensor, shape: torch.Size) -> Tensor:
    """Delta(source -> target) from ``(..., N, N)`` distances; source and target batch dims broadcast."""
    n = source.shape[-1]
    neighbour = source.argmin(-1, keepdim=True).expand(*shape, n, 1)
    chosen = target.expand(*shape, n, n).gather(-1, neighbour)
    rank = 1 + (target < chosen).sum(-1, dtype=torch.int32)  # int32: a faster reduction than int64's
    return rank.to(source.dtype).mean(-1) * (2.0 / n)
