"""CA-PCA (Gilbert and O'Neill 2023): local PCA calibrated on a curved, quadratic neighbourhood."""

# NOTE [CA-PCA]
# Around a point take its ``k + 1`` nearest neighbours and ``r = (R_k + R_(k+1)) / 2``
# (halfway between the ``k``-th and ``(k+1)``-th neighbour distances), as tdhook 0.1.3.
# The eigenvalues ``l_1 >= ... >= l_D`` of their covariance (centred on their mean,
# ``1 / k``), divided by ``r^2``, are compared with those of a ``d``-dimensional quadratic
# embedding: flat, the ``d`` tangent ones would be ``1 / (d + 2)`` (a uniform ``d``-ball)
# and the rest 0; curvature moves mass ``T_d = l_(d+1) + ... + l_D`` to the normal
# directions and shrinks each tangent one by ``(3d + 4) / (d (d + 4)) T_d``. The score of
# ``d`` is ``|| l_(1..d) + (3d + 4) / (d (d + 4)) T_d - 1 / (d + 2) || + 2 T_d`` and the
# estimate its argmin over ``d = 1..D``. All ``D`` scores of all points come from prefix
# sums of ``l`` and ``l^2`` (``O(N D)``), not a ``D x D`` table per point.
#
# NOTE [CA-PCA at the edges]
# Where a neighbourhood is lopsided (a point at the edge of the data, or where the density
# falls fast), its covariance is small against ``r^2``: all ``l_i`` fall below
# ``1 / (d + 2)``. The score of ``d`` is then about the norm of the target,
# ``sqrt(d) / (d + 2)``, which falls as ``d`` grows, so the largest ``d`` wins: the ambient
# dimension, even where the last eigenvalues are zero (tdhook 0.1.3 answers ``D`` at about
# 1% of the points of a noise-free 8-dimensional Gaussian in R^12 with ``k = 20``). A
# dimension ``d`` needs ``d`` directions of spread: here ``d`` is a candidate only where
# ``l_d >= support * l_1`` (``support = 0.01`` by default), which leaves the flat and curved
# cases as they were (the normal spread that curvature makes is counted in ``T_d``, not
# asked of ``l_d``) and removes the ambient answers at the edges: on Gaussians, cubes,
# spheres and a swiss roll, noise-free and noisy, no point lost its right answer and
# every ambient answer of a noise-free manifold went (tests/latent/test_dimension.py).
# Three other conventions (the point itself in its neighbourhood; second moments about
# the point; the spectrum scaled to a ball's total spread) each lost right answers
# elsewhere. ``support=0`` is tdhook's rule.

from __future__ import annotations

import math

import torch

from ._neighbours import check_eps, check_k, check_points
from ._spectra import neighbourhood_spectra

__all__ = ["ca_pca", "ca_pca_scores"]


def ca_pca_scores(eigenvalues: torch.Tensor) -> torch.Tensor:
    """Scores ``(..., D)`` of ``d = 1..D`` for spectra ``(..., D)`` already divided by ``r^2`` (NOTE [CA-PCA])."""
    D = eigenvalues.shape[-1]
    d = torch.arange(1, D + 1, dtype=eigenvalues.dtype, device=eigenvalues.device)
    head = eigenvalues.cumsum(-1)  # l_1 + ... + l_d
    head_sq = (eigenvalues * eigenvalues).cumsum(-1)
    tail = (eigenvalues.sum(-1, keepdim=True) - head).clamp(min=0)  # T_d
    shift = (3 * d + 4) / (d * (d + 4)) * tail - 1 / (d + 2)
    squared = head_sq + 2 * shift * head + d * shift * shift  # sum over i <= d of (l_i + shift)^2
    return squared.clamp(min=0).sqrt() + 2 * tail


def ca_pca(x: torch.Tensor, k: int, *, eps: float = 1e-5, support: float = 1e-2) -> torch.Tensor:
    """Each point's curvature-adjusted local PCA dimension (Gilbert and O'Neill 2023).

    Local PCA calibrated on a quadratic embedding instead of a flat ball, so curvature is
    not read as extra dimensions: the spectrum of each point's ``k + 1`` nearest
    neighbours, divided by ``r^2`` (``r`` halfway between the ``k``-th and ``(k+1)``-th
    neighbour distances), is scored against that of a ``d``-dimensional quadratic
    embedding for every ``d`` whose ``d``-th eigenvalue is at least ``support`` times the
    largest, and the best ``d`` wins. All points of all clouds: one ``topk``, one batched
    ``eigvalsh``, and prefix sums for the scores. With ``support=0`` it equals tdhook
    0.1.3's `CaPcaDimensionEstimator`, which answers the ambient dimension at some points
    on the edge of the data (a lopsided neighbourhood, whose whole spectrum is small
    against ``r^2``) even where the last eigenvalues are zero.

    Args:
        x (Tensor): ``(..., N, D)`` floating point, ``N >= k + 2``; leading dims are batch dims.
        k (int): ``k + 1`` neighbours form each point's neighbourhood, ``>= 1``.
        eps (float): points closer than this are duplicates, not neighbours (excluded, as
            in tdhook). Default: ``1e-5``.
        support (float): a dimension ``d`` is a candidate only where the ``d``-th eigenvalue
            is at least this share of the largest, in ``[0, 1)``; ``0`` is tdhook's rule.
            Default: ``0.01``.

    Returns:
        Tensor: ``(..., N)`` whole numbers in ``x``'s dtype; ``nan`` where a point has
        fewer than ``k + 1`` neighbours farther than ``eps``.

    Raises:
        TypeError: ``x`` not a floating tensor, ``k`` not an int.
        ValueError: ``k < 1``, ``N < k + 2``, ``eps < 0``, ``support`` outside ``[0, 1)``.

    Examples:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> sphere = torch.nn.functional.normalize(torch.randn(1000, 3, generator=g, dtype=torch.float64), dim=-1)
        >>> ca_pca(sphere, 20).median().item()  # the 2-sphere in R^3
        2.0
        >>> torch.vmap(lambda c: ca_pca(c, 20))(torch.stack([sphere, sphere])).shape
        torch.Size([2, 1000])
    """
    k = check_k("ca_pca", k)
    x = check_points("ca_pca", x, k + 2, f"k + 2 with k={k}")
    eps = check_eps("ca_pca", eps)
    if isinstance(support, bool) or not isinstance(support, (int, float)) or not 0 <= support < 1:
        raise ValueError(f"ca_pca: support must be a number in [0, 1), got {support!r}")
    eigenvalues, r = neighbourhood_spectra(x, k, eps, with_self=False)
    radius = (r[..., k - 1] + r[..., k]) / 2
    D = x.shape[-1]
    if eigenvalues.shape[-1] < D:  # the zeros of a rank-k covariance
        eigenvalues = torch.nn.functional.pad(eigenvalues, (0, D - eigenvalues.shape[-1]))
    valid = torch.isfinite(radius) & (radius > 0)
    safe = torch.where(valid, radius, 1.0).double()
    scores = ca_pca_scores(eigenvalues / (safe * safe)[..., None])
    if support:  # NOTE [CA-PCA at the edges]
        spread = eigenvalues >= support * eigenvalues[..., :1]
        spread[..., 0] = True
        scores = torch.where(spread, scores, math.inf)
    dimension = (scores.argmin(-1) + 1).to(x.dtype)
    return torch.where(valid, dimension, math.nan)
