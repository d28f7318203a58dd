"""Centered kernel alignment: centered Gram matrices and their normalised inner products."""

# NOTE [one formula for every CKA]
# Biased HSIC is ``<HKH, HLH>_F / (N - 1)^2`` and the unbiased estimator of Song et al.
# (2012) is ``<U(K), U(L)>_F / (N (N - 3))`` with ``U`` the U-centering of Szekely and
# Rizzo (2014) (diagonal zeroed, row and column means removed with ``N - 2`` and
# ``(N - 1)(N - 2)`` in place of ``N``). The scale factors cancel in CKA, so every variant
# is ``<Kc, Lc> / (|Kc| |Lc|)`` for some centred Grams ``Kc`` and ``Lc``: the Grams are
# built once per representation and the pairs cost one batched inner product.
#
# NOTE [linear CKA from feature covariances]
# For the linear kernel ``<HXX^TH, HYY^TH> = |Xc^T Yc|_F^2``. Grams cost ``N^2 D`` per
# representation plus ``N^2`` per pair; covariances cost ``N Dx Dy`` per pair. The cheaper
# one is used: covariances for one pair of wide-sample inputs, Grams for all-pairs tables.

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._broadcast_einsum import broadcast, broadcast_einsum
from ._similarity_inputs import batch_shape, first_true, for_both, same_values, sample_range, values_visible


def cka_impl(x: Tensor, y: Tensor, *, kernel: str, debiased: bool, sigma: float | None,
             median_fraction: float) -> Tensor:
    """CKA of checked float ``x`` ``(..., N, Dx)`` and ``y`` ``(..., N, Dy)``."""
    if kernel == "linear" and not debiased and not _covariances_cheaper(x, y):
        plain = _plain_linear_cka(x, y)  # NOTE [linear CKA without the checks' passes]
        if plain is not None:
            return plain.clamp(0.0, 1.0)
    range_x, range_y = for_both(lambda arg, t: sample_range("cka", arg, t), x, y)
    constant_x, constant_y = _constant(range_x), _constant(range_y)
    _refuse_constant("x", constant_x)
    _refuse_constant("y", constant_y)
    if kernel == "linear" and not debiased and _covariances_cheaper(x, y):
        value = _linear_cka_from_covariances(x, y, {"x": range_x, "y": range_y})
    else:
        ranges = {"x": range_x, "y": range_y}
        kx, ky = for_both(lambda arg, t: _centred_gram(arg, t, ranges[arg], kernel=kernel, debiased=debiased,
                                                       sigma=sigma, median_fraction=median_fraction).flatten(-2),
                          x, y)
        value = _alignment(kx, ky)
    # under vmap or compile the refusal cannot branch: a constant representation gives NaN there
    nan = torch.full((), math.nan, dtype=value.dtype, device=value.device)
    value = torch.where(constant_x | constant_y, nan, value)
    return value.clamp(-1.0 if debiased else 0.0, 1.0)  # only rounding takes it out of range


# NOTE [linear CKA without the checks' passes]
# The checks of a CKA call (NaN or inf, a representation constant across its samples, the
# scale that keeps the sums of fourth powers in range) read each feature's least and
# largest value: two passes over the activations, and a third to divide by the scale,
# against a Gram matrix that is itself a few passes' worth (a fifth of an all-pairs call
# at 512 samples). Where the values are visible, the linear kernel first tries without
# them: a layer is constant when every sample equals its first (`torch.equal`, which
# stops at the first difference: microseconds for a layer that is not); the Gram of the
# centred samples bounds every entry by its diagonal (Cauchy-Schwarz), so its largest
# diagonal entry says whether the sums of squares stay in range unscaled (NaN or inf in
# the inputs make it NaN or inf: out of range). Any of these failing, the call takes the
# checked path, which raises or scales as before.


def _plain_linear_cka(x: Tensor, y: Tensor) -> Tensor | None:
    """Linear CKA from unscaled centred Grams, or ``None`` where the checked path must decide."""
    if not (values_visible(x) and values_visible(y)):
        return None
    same = same_values(x, y)
    if _any_constant(x) or (not same and _any_constant(y)):
        return None
    in_range = True

    def gram(arg: str, t: Tensor) -> Tensor:
        nonlocal in_range
        centred = t - t.mean(-2, keepdim=True)
        k = centred @ centred.mT
        in_range = in_range and _sums_in_range(k.diagonal(dim1=-2, dim2=-1).amax(-1), k.shape[-1])
        return k.flatten(-2)

    kx, ky = for_both(gram, x, y)
    return _alignment(kx, ky) if in_range else None


def _any_constant(t: Tensor) -> bool:
    """Whether a representation of ``t`` ``(..., N, D)`` is the same vector for every sample."""
    for layer in t.reshape(-1, *t.shape[-2:]):
        if torch.equal(layer, layer[:1].expand_as(layer)):
            return True
    return False


def _sums_in_range(diagonal_max: Tensor, n: int) -> bool:
    """Whether sums of squares of ``n x n`` Gram entries, each at most ``diagonal_max``, stay well in range."""
    info = torch.finfo(diagonal_max.dtype)
    square = diagonal_max.double() ** 2
    return bool(((square > info.tiny * 1e6) & (square * float(n) ** 2 < info.max / 1e6)).all())


def _constant(extremes: Tensor) -> Tensor:
    """Whether each representation is the same vector for every sample, from `sample_range`."""
    return (extremes[..., 0, :] == extremes[..., 1, :]).all(-1)


def _refuse_constant(arg: str, constant: Tensor) -> None:
    where = first_true(constant)
    if where is not None:
        at = f" (batch index {where})" if where else ""
        raise ValueError(f"cka: {arg} is constant across its samples{at}: its centred Gram matrix is zero and CKA "
                         f"is undefined (tdhook returns NaN); drop that representation or compare non-constant ones")


def _covariances_cheaper(x: Tensor, y: Tensor) -> bool:
    n, dx, dy = x.shape[-2], x.shape[-1], y.shape[-1]
    bx, by = math.prod(x.shape[:-2]), math.prod(y.shape[:-2])
    pairs = math.prod(batch_shape(x, y))
    if same_values(x, y):  # (the all-pairs call: one side's Grams or covariances serve both)
        by = 0
    grams = (bx * dx + by * dy + pairs) * n * n
    covariances = pairs * n * dx * dy + (bx * dx * dx + by * dy * dy) * n
    return covariances < grams


def _centred(t: Tensor, extremes: Tensor | None) -> Tensor:
    """``t`` minus its mean sample; given its `sample_range`, also divided by its largest entry.

    Centring first: a large mean (common in residual streams) would drown the spread in
    the rounding of a Gram of the raw ``t``. Linear CKA is scale-invariant, and its sums
    of fourth powers overflow float32 from entries near ``1e9`` (tdhook returns NaN
    there): unit scale keeps them in range.
    """
    mean = t.mean(-2, keepdim=True)
    t = t - mean
    if extremes is None:
        return t
    largest = torch.maximum(extremes[..., 1:, :] - mean, mean - extremes[..., :1, :]).amax(-1, keepdim=True)
    if _in_range_unscaled(largest, t.shape[-2] * t.shape[-1]):
        return t  # (a pass over t saved: the common case)
    return t.div_(largest.clamp_min(torch.finfo(t.dtype).tiny))


def _in_range_unscaled(largest: Tensor, size: int) -> bool:
    """Whether CKA's sums of squares of Gram (or covariance) entries stay well inside the dtype's range unscaled.

    A Gram entry is at most ``D * largest**2`` in magnitude (a covariance entry ``N * largest**2``), so each sum of
    squares over the ``N**2`` (``D**2``) entries, and the inner product of two, is at most ``size**2 * largest**4``
    (``size = N * D``); the Gram entry of the sample holding the largest entry is at least ``largest**2``. Only
    where the values are visible (else always scaled).
    """
    if not values_visible(largest):
        return False
    info = torch.finfo(largest.dtype)
    fourth = largest.double() ** 4
    return bool(((fourth > info.tiny * 1e6) & (fourth * float(size) ** 2 < info.max / 1e6)).all())


def _linear_cka_from_covariances(x: Tensor, y: Tensor, ranges: dict[str, Tensor]) -> Tensor:
    centred: dict[str, Tensor] = {}

    def own_term(arg: str, t: Tensor) -> Tensor:
        centred[arg] = c = _centred(t, ranges[arg])
        return (c.mT @ c).square().sum((-2, -1))

    self_x, self_y = for_both(own_term, x, y)  # (once in the all-pairs call)
    xc = centred["x"]
    yc = centred["y"] if "y" in centred else xc.reshape(y.shape[:-2] + xc.shape[-2:])
    cross = broadcast_einsum("nd", "ne", "de", xc, yc).square().sum((-2, -1))
    return cross / self_x.sqrt() / self_y.sqrt()


def _alignment(kx: Tensor, ky: Tensor) -> Tensor:
    """``<kx, ky> / (|kx| |ky|)`` over the last dim, the leading dims broadcast (NOTE [all pairs by broadcasting])."""
    inner = _inner_products(kx, ky)
    norm_x = torch.linalg.vector_norm(kx, dim=-1)
    norm_y = norm_x.reshape(ky.shape[:-1]) if same_values(kx, ky, core=1) else torch.linalg.vector_norm(ky, dim=-1)
    for arg, norm in (("x", norm_x), ("y", norm_y)):
        where = first_true(norm == 0)
        if where is not None:  # a non-constant representation can still have a zero U-centred Gram (tiny N)
            at = f" (batch index {where})" if where else ""
            raise ValueError(f"cka: the centred Gram matrix of {arg} is zero{at}, so CKA is undefined; use more "
                             f"samples or debiased=False")
    value: Tensor = inner / norm_x / norm_y
    return value


def _inner_products(kx: Tensor, ky: Tensor) -> Tensor:
    """``<kx, ky>`` over the last dim, the leading dims broadcast.

    Where ``x`` and ``y`` each spread over one batch dim, and not the same one (the all-pairs
    call ``acts[:, None]``, ``acts[None, :]``, or two families of layers), that is one matrix
    product: torch's einsum makes it a batched product of one batch, a third slower than
    ``mm`` on the CPU.
    """
    batch_x, batch_y = kx.shape[:-1], ky.shape[:-1]
    spread_x = [i for i, n in enumerate(batch_x) if n != 1]
    spread_y = [i for i, n in enumerate(batch_y) if n != 1]
    if len(batch_x) == len(batch_y) and len(spread_x) == len(spread_y) == 1 and spread_x != spread_y:
        a, b = kx.reshape(-1, kx.shape[-1]), ky.reshape(-1, ky.shape[-1])
        products = a @ b.T if spread_x < spread_y else b @ a.T  # (rows along the earlier dim)
        return products.reshape(broadcast(batch_x, batch_y))
    return broadcast_einsum("z", "z", "", kx, ky)


def _centred_gram(arg: str, t: Tensor, extremes: Tensor, *, kernel: str, debiased: bool, sigma: float | None,
                  median_fraction: float) -> Tensor:
    t = _centred(t, extremes if kernel == "linear" else None)
    gram = t @ t.mT  # of centred samples: for the linear kernel already H K H
    if kernel == "rbf":
        gram = _rbf(arg, gram, sigma=sigma, median_fraction=median_fraction)
    if debiased:
        return _u_centre(gram)
    return _double_centre(gram) if kernel == "rbf" else gram


def _rbf(arg: str, gram: Tensor, *, sigma: float | None, median_fraction: float) -> Tensor:
    """``exp(-|ti - tj|^2 / (2 sigma^2))`` from the linear Gram of ``t``."""
    n = gram.shape[-1]
    sq_norms = torch.diagonal(gram, dim1=-2, dim2=-1)
    sq_dist = (sq_norms[..., :, None] + sq_norms[..., None, :] - 2 * gram).clamp_min(0)
    off_diagonal = ~torch.eye(n, dtype=torch.bool, device=gram.device)
    sq_dist = torch.where(off_diagonal, sq_dist, torch.zeros((), dtype=gram.dtype, device=gram.device))
    if sigma is not None:
        two_sigma_sq = torch.full((), 2 * sigma * sigma, dtype=gram.dtype, device=gram.device)
    else:
        rows, cols = torch.triu_indices(n, n, 1, device=gram.device)
        # the lower median of the squared distances is the square of the lower median distance
        median_sq = torch.median(sq_dist[..., rows, cols], dim=-1).values
        where = first_true(median_sq == 0)
        if where is not None:
            at = f" (batch index {where})" if where else ""
            raise ValueError(f"cka: half or more of the pairs of samples of {arg} coincide{at}, so the median "
                             f"distance is 0 and gives no RBF bandwidth; pass sigma=")
        two_sigma_sq = (2 * median_fraction * median_fraction * median_sq)[..., None, None]
    return torch.exp(-sq_dist / two_sigma_sq)


def _double_centre(k: Tensor) -> Tensor:
    """``H K H`` with ``H = I - 11^T / N``."""
    return k - k.mean(-1, keepdim=True) - k.mean(-2, keepdim=True) + k.mean((-2, -1), keepdim=True)


def _u_centre(k: Tensor) -> Tensor:
    """The U-centering of ``k`` (NOTE [one formula for every CKA]); needs ``N >= 4``."""
    n = k.shape[-1]
    off_diagonal = ~torch.eye(n, dtype=torch.bool, device=k.device)
    zero = torch.zeros((), dtype=k.dtype, device=k.device)
    k = torch.where(off_diagonal, k, zero)
    rows = k.sum(-1, keepdim=True) / (n - 2)
    cols = k.sum(-2, keepdim=True) / (n - 2)
    total = k.sum((-2, -1), keepdim=True) / ((n - 1) * (n - 2))
    return torch.where(off_diagonal, k - rows - cols + total, zero)
