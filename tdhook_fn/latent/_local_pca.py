"""Local PCA dimension: how many directions each point's neighbourhood spans."""

# NOTE [gap criterion]
# The ``k + 1`` centred points of a neighbourhood span at most ``k`` directions, so when
# ``D > k`` the last eigenvalue is zero by construction, whatever the data. tdhook 0.1.3's
# ``maxgap`` takes the largest ratio of consecutive eigenvalues over the whole spectrum,
# this structural zero included (``lambda_k / (0 + 1e-15)``): once the data have any
# noise its gap is the largest and the answer is ``k`` at every point. The default
# ``gap`` criterion takes the largest ratio among the ``min(k, D)`` eigenvalues that can
# be nonzero, and floors the denominators at a tenth of their median and at
# ``sqrt(machine eps) * lambda_1``: with ``k`` close to ``D`` the smallest noise
# eigenvalues fall towards 0 (the lower Marchenko-Pastur edge) and their ratios, like
# those of rounding errors, say nothing about the manifold. On noisy data the largest
# ratio is then the one between the manifold's directions and the noise's (tested on
# noisy subspaces, spheres and swiss rolls, ``D`` from 3 to 50). It needs ``k`` of about
# ``2 d`` or more: with ``d`` close to ``k`` the manifold's own smallest eigenvalues fall
# under the floor. tdhook's ``maxgap`` and ``ratio`` (the count of
# eigenvalues above ``alpha * lambda_1``, Fukunaga and Olsen 1971) are kept as they are.

from __future__ import annotations

import math
from typing import Literal

import torch

from ._neighbours import check_eps, check_k, check_points
from ._spectra import neighbourhood_spectra

__all__ = ["Criterion", "local_pca", "spectrum_dimension"]

Criterion = Literal["gap", "maxgap", "ratio"]
_CRITERIA = ("gap", "maxgap", "ratio")


def spectrum_dimension(eigenvalues: torch.Tensor, *, k: int | None = None, criterion: Criterion = "gap",
                       alpha: float = 0.05) -> torch.Tensor:
    """The dimension a decreasing PCA spectrum shows, by one of `local_pca`'s criteria.

    Args:
        eigenvalues (Tensor): ``(..., m)``, decreasing, ``>= 0`` (leading dims are batch dims).
        k (int | None): the spectrum is of ``k + 1`` centred points: for ``"gap"``, the
            eigenvalues after the ``k``-th are zero by construction and left out.
            Default: ``None``, all ``m`` count.
        criterion (str): ``"gap"``, ``"maxgap"`` or ``"ratio"``, as in `local_pca`.
            Default: ``"gap"``.
        alpha (float): the ``"ratio"`` threshold. Default: ``0.05``.

    Returns:
        Tensor: ``(...)`` whole numbers ``>= 1`` in the eigenvalues' dtype (1 for an
        empty or one-value spectrum).

    Examples:
        >>> import torch
        >>> spectrum_dimension(torch.tensor([4.0, 3.0, 0.01, 0.009, 0.0]), k=4)
        tensor(2.)
        >>> spectrum_dimension(torch.tensor([4.0, 3.0, 0.01, 0.009, 0.0]), criterion="maxgap")  # the zero
        tensor(4.)
    """
    m = eigenvalues.shape[-1]
    one = torch.ones(eigenvalues.shape[:-1], dtype=eigenvalues.dtype, device=eigenvalues.device)
    if criterion == "ratio":
        count = (eigenvalues > alpha * eigenvalues[..., :1]).sum(-1)
        return count.clamp(min=1).to(eigenvalues.dtype)
    if criterion == "maxgap":
        if m < 2:
            return one
        gaps = eigenvalues[..., :-1] / (eigenvalues[..., 1:] + 1e-15)
    else:
        usable = eigenvalues[..., : m if k is None else min(k, m)]
        if usable.shape[-1] < 2:
            return one
        floor = torch.maximum(math.sqrt(torch.finfo(eigenvalues.dtype).eps) * usable[..., :1],
                              0.1 * usable.median(dim=-1, keepdim=True).values)
        gaps = usable[..., :-1] / torch.maximum(usable[..., 1:], floor)
    return (gaps.argmax(-1) + 1).to(eigenvalues.dtype)


def local_pca(x: torch.Tensor, k: int, *, criterion: Criterion = "gap", alpha: float = 0.05,
              eps: float = 1e-5) -> torch.Tensor:
    """Each point's dimension from the PCA spectrum of its ``k``-neighbourhood (Fukunaga and Olsen 1971).

    The spectra of all points of all clouds come from one batched ``eigvalsh`` in float64
    (of the ``D x D`` covariance or the ``(k + 1) x (k + 1)`` Gram matrix, the smaller).
    The default criterion ``"gap"`` leaves out the eigenvalues that are zero by
    construction (``k + 1`` centred points span at most ``k`` directions) and floors the
    ratios' denominators at a tenth of the median eigenvalue, so noise does not make the
    largest ratio.

    Args:
        x (Tensor): ``(..., N, D)`` floating point, ``N >= k + 1``; leading dims are batch dims.
        k (int): neighbours per neighbourhood (the point itself is the ``k + 1``-th), ``>= 1``.
        criterion (str): ``"gap"``: the largest ratio of consecutive eigenvalues among
            those that can be nonzero (right on noisy data); ``"maxgap"``: tdhook 0.1.3's,
            over the whole spectrum (answers ``k`` on noisy data when ``D > k``);
            ``"ratio"``: the count of eigenvalues above ``alpha`` times the largest.
            Default: ``"gap"``.
        alpha (float): the ``"ratio"`` threshold, in ``(0, 1)``. Default: ``0.05``.
        eps (float): points closer than this are duplicates, not neighbours (excluded, as
            in tdhook). Default: ``1e-5``.

    Returns:
        Tensor: ``(..., N)`` whole numbers in ``x``'s dtype; ``nan`` where a point has
        fewer than ``k`` neighbours farther than ``eps``.

    Raises:
        TypeError: ``x`` not a floating tensor, ``k`` not an int.
        ValueError: ``k < 1``, ``N < k + 1``, an unknown ``criterion``, ``alpha`` outside
            ``(0, 1)``, ``eps < 0``.

    Examples:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> basis = torch.linalg.qr(torch.randn(20, 3, generator=g)).Q.T  # a 3-d subspace of R^20
        >>> x = torch.randn(500, 3, generator=g) @ basis + 0.01 * torch.randn(500, 20, generator=g)
        >>> local_pca(x, 15).median().item()
        3.0
        >>> local_pca(x, 15, criterion="maxgap").median().item()  # tdhook's: the structural zero
        15.0
        >>> torch.vmap(lambda c: local_pca(c, 15))(torch.stack([x, x])).shape
        torch.Size([2, 500])
    """
    k = check_k("local_pca", k)
    x = check_points("local_pca", x, k + 1, f"k + 1 with k={k}")
    if criterion not in _CRITERIA:
        raise ValueError(f"local_pca: criterion must be one of {_CRITERIA}, got {criterion!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise ValueError(f"local_pca: alpha must be in (0, 1), got {alpha!r}")
    eps = check_eps("local_pca", eps)
    eigenvalues, r = neighbourhood_spectra(x, k, eps, with_self=True)
    dimension = spectrum_dimension(eigenvalues, k=k, criterion=criterion, alpha=alpha)
    return torch.where(torch.isfinite(r[..., k - 1]), dimension.to(x.dtype), math.nan)
