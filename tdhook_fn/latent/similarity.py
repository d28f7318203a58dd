"""How alike two representations are: CKA and information imbalance, batched over leading dims.

Both take activations ``x`` ``(..., N, Dx)`` and ``y`` ``(..., N, Dy)`` of the same ``N``
inputs; the leading dims broadcast, so ``cka(acts[:, None], acts[None, :])`` is the table
of every pair of layers in one batched call (each layer's Gram or distance matrix is
built once). Float64 stays float64, integers become the default float dtype, and both
work under ``torch.vmap``.

- `cka`: centered kernel alignment (Kornblith et al., 2019), linear or RBF kernel,
  biased or debiased HSIC.
- `information_imbalance`: how well nearest neighbours in one space predict those in
  the other (Glielmo et al., 2022), both directions.
"""

from __future__ import annotations

import math

from torch import Tensor

from ._cka import cka_impl
from ._imbalance import imbalance_impl
from ._similarity_inputs import as_float_pair

__all__ = ["cka", "information_imbalance"]

_KERNELS = ("linear", "rbf")


def cka(x: Tensor, y: Tensor, *, kernel: str = "linear", debiased: bool = False, sigma: float | None = None,
        median_fraction: float = 1.0) -> Tensor:
    """Centered kernel alignment between two representations of the same samples.

    ``CKA = HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L))`` with ``K`` and ``L`` the kernel
    (Gram) matrices of ``x`` and ``y`` over the ``N`` samples. It is invariant to
    orthogonal transforms and isotropic scaling of either representation, symmetric, 1
    for a representation against itself and in ``[0, 1]`` (debiased: in ``[-1, 1]``,
    near 0 for independent representations at any ``N``).

    Linear CKA uses Gram matrices or feature covariances, whichever is cheaper for the
    shapes given. A representation constant across the samples has no CKA with anything
    (0 / 0): it raises ``ValueError`` naming ``x`` or ``y`` and the batch index (tdhook
    0.1.3 returns NaN). Under ``torch.vmap`` or ``torch.compile``, where values cannot be
    inspected, such entries are NaN instead. Differentiable in ``x`` and ``y``.

    Args:
        x (Tensor): ``(..., N, Dx)``, row ``i`` the representation of sample ``i``.
        y (Tensor): ``(..., N, Dy)``, the same samples; its leading dims broadcast with
            those of ``x``.
        kernel (str): ``"linear"`` (``K = X X^T``) or ``"rbf"``
            (``K_ij = exp(-|x_i - x_j|^2 / (2 sigma^2))``). Default: ``"linear"``.
        debiased (bool): use the unbiased HSIC estimator (Song et al., 2012, as in
            Nguyen et al., 2021) instead of the biased one; needs ``N >= 4``.
            Default: ``False``.
        sigma (float, optional): RBF bandwidth, the same for every representation. If
            ``None``, each representation gets ``median_fraction`` times the (lower)
            median distance between its distinct samples (Kornblith et al., 2019).
            Default: ``None``.
        median_fraction (float): the fraction of the median distance used as ``sigma``
            when ``sigma`` is ``None`` (Kornblith et al. report 0.2 to 0.8).
            Default: ``1.0``.

    Returns:
        Tensor: the broadcast batch shape of ``x`` and ``y`` (a scalar for two
        ``(N, D)`` inputs), in their floating dtype.

    Raises:
        ValueError: shapes that do not match or broadcast, fewer than 2 samples (4 when
            debiased), a constant representation, NaN or inf, an unknown ``kernel``.

    Examples:
        >>> import torch
        >>> from tdhook_fn.latent.similarity import cka
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.randn(100, 8, generator=g, dtype=torch.float64)
        >>> q, _ = torch.linalg.qr(torch.randn(8, 8, generator=g, dtype=torch.float64))
        >>> round(cka(x, 3 * x @ q).item(), 6)
        1.0
        >>> acts = torch.randn(4, 100, 8, generator=g)   # 4 layers
        >>> table = cka(acts[:, None], acts[None, :])  # every pair, one call
        >>> table.shape
        torch.Size([4, 4])
        >>> torch.vmap(cka)(acts, acts.flip(0)).shape
        torch.Size([4])
    """
    if kernel not in _KERNELS:
        raise ValueError(f"cka: kernel must be one of {_KERNELS}, got {kernel!r}")
    if sigma is not None and not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"cka: sigma must be a positive finite number or None (the median heuristic), got {sigma!r}")
    if not (isinstance(median_fraction, (int, float)) and math.isfinite(median_fraction) and median_fraction > 0):
        raise ValueError(f"cka: median_fraction must be a positive finite number, got {median_fraction!r}")
    x, y = as_float_pair("cka", x, y, min_samples=4 if debiased else 2)
    return cka_impl(x, y, kernel=kernel, debiased=debiased, sigma=sigma, median_fraction=median_fraction)


def information_imbalance(x: Tensor, y: Tensor, *, p: float = 2.0) -> tuple[Tensor, Tensor]:
    """Information imbalance between two representations, in both directions.

    ``Delta(x -> y) = 2/N * mean_i r^y_i(j_i)`` where ``j_i`` is the nearest neighbour
    of sample ``i`` in ``x`` and ``r^y_i(j)`` the rank of ``j`` among the neighbours of
    ``i`` in ``y`` (1 for the nearest). Near ``2/N`` when ``x``'s neighbourhoods predict
    ``y``'s, near 1 when they say nothing about them (Glielmo et al., 2022); tdhook 0.1.3's
    definition. Ranks come from counting, not from sorting the ``N x N`` distances. For
    ties, the neighbour is the lowest index among the closest points and its rank is
    ``1 +`` the number of points strictly closer in ``y`` (tdhook orders ties by an
    unstable sort, so tied data can differ from it). Memory: one ``N x N`` distance
    matrix per representation and a boolean ``N x N`` per pair, while counting.

    Args:
        x (Tensor): ``(..., N, Dx)``, row ``i`` the representation of sample ``i``.
        y (Tensor): ``(..., N, Dy)``, the same samples; its leading dims broadcast with
            those of ``x``.
        p (float): the Minkowski exponent of the distances (``torch.cdist``'s ``p``,
            ``float("inf")`` allowed). Default: ``2.0``.

    Returns:
        tuple[Tensor, Tensor]: ``(Delta(x -> y), Delta(y -> x))``, each of the broadcast
        batch shape, in the floating dtype of the inputs.

    Raises:
        ValueError: shapes that do not match or broadcast, fewer than 2 samples, NaN or
            inf, ``p`` not positive.

    Examples:
        >>> import torch
        >>> from tdhook_fn.latent.similarity import information_imbalance
        >>> t = torch.linspace(0, 1, 50, dtype=torch.float64)[:, None] ** 2  # no ties
        >>> x_to_y, y_to_x = information_imbalance(torch.cat([t, t.sin()], -1), t)
        >>> round(x_to_y.item(), 4), round(y_to_x.item(), 4)   # 2/N: the neighbours agree
        (0.04, 0.04)
        >>> acts = torch.randn(3, 50, 8)
        >>> a_to_b, b_to_a = information_imbalance(acts[:, None], acts[None, :])
        >>> a_to_b.shape
        torch.Size([3, 3])
    """
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not p > 0:
        raise ValueError(f"information_imbalance: p must be a positive number (or float('inf')), got {p!r}")
    x, y = as_float_pair("information_imbalance", x, y, min_samples=2)
    return imbalance_impl(x, y, p=float(p))
