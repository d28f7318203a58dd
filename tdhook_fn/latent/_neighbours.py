"""Nearest neighbours of every point of a batch of point clouds ``(..., N, D)``."""

# NOTE [duplicates]
# A point at distance ``<= eps`` from another (its duplicate) is no neighbour of it, as in
# tdhook 0.1.3: the distance is set to ``inf`` before the ``k`` smallest are taken, so a
# point with fewer than ``k`` points farther than ``eps`` gets ``inf`` distances, and the
# estimators turn those into ``nan`` (documented on each). Its own distance is always
# excluded: the diagonal is set to ``inf`` explicitly, because ``torch.cdist`` computes
# ``|a|^2 + |b|^2 - 2 a.b`` for large inputs, whose rounding leaves ``|a - a|`` far
# above ``eps`` in float32.

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
    dist = torch.cdist(x, x)
    dist.diagonal(dim1=-2, dim2=-1).fill_(float("inf"))
    return dist.masked_fill_(dist <= eps, float("inf"))


def nearest(x: torch.Tensor, k: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` nearest neighbours of every point: distances and indices ``(..., N, k)``, nearest first."""
    if not untransformed():  # (no data-dependent branch under vmap or compile: duplicates masked always)
        return torch.topk(distances(x, eps), k, dim=-1, largest=False, sorted=True)
    # Duplicates are rare, and masking them is a pass over all N x N distances (a quarter of a
    # TwoNN call): look for them in each point's nearest distance first. None there, none at
    # all, and the distances masked would be these very ones.
    dist = torch.cdist(x, x)
    dist.diagonal(dim1=-2, dim2=-1).fill_(float("inf"))
    values, indices = torch.topk(dist, k, dim=-1, largest=False, sorted=True)
    if not bool((values[..., 0] <= eps).any()):
        return values, indices
    return torch.topk(dist.masked_fill_(dist <= eps, float("inf")), k, dim=-1, largest=False, sorted=True)
