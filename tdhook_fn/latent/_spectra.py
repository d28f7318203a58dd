"""The PCA spectrum of every point's neighbourhood, all points of all clouds in one ``eigvalsh``."""

# NOTE [neighbourhood spectra]
# A neighbourhood is ``k + 1`` points, centred on their mean: the point and its ``k``
# nearest neighbours (local PCA), or its ``k + 1`` nearest neighbours (CA-PCA, as
# tdhook). Their covariance (``1 / k``, scikit-learn's ``explained_variance_``) has rank
# at most ``min(k, D)``. Its nonzero eigenvalues are those of the ``D x D``
# covariance or of the ``(k + 1) x (k + 1)`` Gram matrix of the centred points, whichever
# is smaller, so the spectrum costs ``min(D, k + 1)^3`` per point, not ``D^3``. The
# ``min(D, k + 1)`` eigenvalues come back in decreasing order, clamped at 0 (``eigvalsh``
# can return ``-1e-17`` for a zero), as scikit-learn's PCA returns them. They are
# computed in float64 whatever ``x``'s dtype (as tdhook, which hands scikit-learn float64):
# in float32 the zeros of a rank-deficient neighbourhood come out near ``1e-7`` of the
# largest eigenvalue instead of ``1e-16``, and the gap criteria compare ratios of them.

from __future__ import annotations

import torch

from ._neighbours import nearest

__all__ = ["neighbourhood_spectra"]


def neighbourhood_spectra(x: torch.Tensor, k: int, eps: float, with_self: bool
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues ``(..., N, min(D, k + 1))``, float64, decreasing, and the neighbour distances ``(..., N, k + 1)``.

    ``with_self``: the point and its ``k`` nearest neighbours, else its ``k + 1`` nearest.
    A point with fewer neighbours farther than ``eps`` has ``inf`` among the distances
    (the caller turns its result into ``nan``).
    """
    r, idx = nearest(x, k + 1, eps)
    if with_self:  # one gather of all k + 1 points: no copy of the (..., N, k + 1, D) block
        own = torch.arange(x.shape[-2], device=x.device).expand(idx.shape[:-1])[..., None]
        idx = torch.cat([own, idx[..., :k]], dim=-1)
    points = _gathered(x.double(), idx)
    centred = points.sub_(points.mean(dim=-2, keepdim=True))
    if x.shape[-1] <= k + 1:
        moments = centred.mT @ centred
    else:
        moments = centred @ centred.mT
    eigenvalues = torch.linalg.eigvalsh(moments / k).flip(-1).clamp(min=0)
    return eigenvalues, r


def _gathered(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` ``(..., N, m)`` of each cloud of ``x`` ``(..., N, D)``: ``(..., N, m, D)``.

    One index of the clouds stacked end to end: ``take_along_dim`` would first expand
    ``idx`` to ``(..., N, m, D)`` (as many int64s as the result has numbers: 2.7x slower).
    """
    n, d = x.shape[-2:]
    lead = x.shape[:-2]
    offsets = torch.arange(lead.numel(), device=x.device).reshape(*lead, 1, 1) * n
    return x.reshape(-1, d)[idx + offsets].reshape(*idx.shape, d)
