"""Nearest neighbours of every point of a batch of point clouds ``(..., N, D)``."""

# NOTE [duplicates]
# A point at distance ``<= eps`` from another (its duplicate) is no neighbour of it, as in
# tdhook 0.1.3: the distance is set to ``inf`` before the ``k`` smallest are taken, so a
# point with fewer than ``k`` points farther than ``eps`` gets ``inf`` distances, and the
# estimators turn those into ``nan`` (documented on each). Its own distance is always
# excluded: the diagonal is set to ``inf`` explicitly.
#
# NOTE [exact duplicates]
# For more than 25 points ``torch.cdist`` computes ``|a|^2 + |b|^2 - 2 a.b``, whose rounding
# grows with ``|a|^2 + |b|^2``: two equal float32 points of norm 12 come out about 1e-2
# apart, far above ``eps``, and a common offset (a residual stream's mean, a shared BOS
# token's activation) makes it worse, in float64 too. Such "neighbours" at distance ~0 are
# what the estimators divide by. So the clouds are centred first (distances do not change,
# the rounding shrinks), and every pair the formula cannot tell from a duplicate (its
# squared distance within the formula's error bound, ``4 D eps max |a|^2``, of
# ``eps^2``; one bound per cloud, from its largest norm) is measured again from the
# difference of the two points. Outside that bound a computed distance is above ``eps``
# for certain; duplicates are rare, so the pairs measured again are few.

from __future__ import annotations

import torch

from .._vjp import untransformed

__all__ = ["check_eps", "check_k", "check_points", "distances", "nearest"]


def check_points(name: str, x: object, least: int, what: str) -> torch.Tensor:
    """``x`` as a floating ``(..., N, D)`` tensor with ``N >= least``, else a clear error."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a tensor of shape (..., N, D), got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: x must be a floating-point tensor, got {x.dtype}; cast it with x.float()")
    if x.dim() < 2:
        raise ValueError(f"{name}: x must have shape (..., N, D), got shape {tuple(x.shape)}")
    if x.shape[-2] < least:
        raise ValueError(f"{name}: at least {least} points ({what}) are needed, got N={x.shape[-2]}")
    return x


def check_eps(name: str, eps: float) -> float:
    """``eps`` as a finite number ``>= 0``."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0 or eps == float("inf"):
        raise ValueError(f"{name}: eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


def check_k(name: str, k: object, least: int = 1) -> int:
    """``k`` as an ``int >= least``."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"{name}: k must be an int, got {type(k).__name__}")
    if k < least:
        raise ValueError(f"{name}: k must be at least {least}, got {k}")
    return k


def distances(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Euclidean distances ``(..., N, N)``, ``inf`` on the diagonal and at duplicates (NOTE [duplicates])."""
    centred, dist, limit = _centred_distances(x, eps)
    if limit is not None:
        dist = _remeasured(centred, dist, limit)
    return dist.masked_fill_(dist <= eps, float("inf"))


_MM_ABOVE = 25  # (``torch.cdist`` takes the matrix-product formula for more points than this)


def _centred_distances(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The centred points, their distances (``inf`` on the diagonal) and, per cloud ``(..., 1, 1)``, the distance
    below which one may be a duplicate's (``None``: all measured from differences); NOTE [exact duplicates]."""
    centred = x - x.mean(-2, keepdim=True)
    dist = torch.cdist(centred, centred)
    dist.diagonal(dim1=-2, dim2=-1).fill_(float("inf"))
    if x.shape[-2] <= _MM_ABOVE:
        return centred, dist, None
    largest = centred.square().sum(-1).amax(-1)[..., None, None]  # (one bound per cloud: a pass less than per pair)
    return centred, dist, (4 * x.shape[-1] * torch.finfo(x.dtype).eps * largest + eps * eps).sqrt()


def _remeasured(centred: torch.Tensor, dist: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """``dist`` with every distance up to ``limit`` measured from the two points' difference."""
    unsure = dist <= limit
    if not untransformed():  # (no data-dependent shapes under vmap or compile: every pair by difference)
        exact = torch.cdist(centred, centred, compute_mode="donot_use_mm_for_euclid_dist")
        return torch.where(unsure, exact, dist)  # (the diagonal is inf: never unsure)
    where = unsure.nonzero(as_tuple=True)
    first, second = centred[where[:-1]], centred[(*where[:-2], where[-1])]
    dist[where] = torch.linalg.vector_norm(first - second, dim=-1)
    return dist


def nearest(x: torch.Tensor, k: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` nearest neighbours of every point: distances and indices ``(..., N, k)``, nearest first."""
    if not untransformed():  # (no data-dependent branch under vmap or compile: duplicates masked always)
        return torch.topk(distances(x, eps), k, dim=-1, largest=False, sorted=True)
    # Duplicates are rare, and masking them is a pass over all N x N distances (a quarter of a
    # TwoNN call): look for them in each point's nearest distance first. None there, none at
    # all, and the distances masked would be these very ones.
    centred, dist, limit = _centred_distances(x, eps)
    values, indices = torch.topk(dist, k, dim=-1, largest=False, sorted=True)
    if not bool((values[..., :1] <= (eps if limit is None else limit)).any()):
        return values, indices
    if limit is not None:
        dist = _remeasured(centred, dist, limit)
    return torch.topk(dist.masked_fill_(dist <= eps, float("inf")), k, dim=-1, largest=False, sorted=True)
