"""Feature groups: which elements of the inputs are perturbed together (captum's ``feature_mask``)."""

# NOTE [feature masks]
# A feature mask holds one integer feature id per element of an input, in a tensor that
# broadcasts to the input's shape ``[*B, *feature_shape]``: one sample's shape (or
# ``[1, ...]``) groups every sample alike, the full shape groups each sample its own way.
# Ids are shared across keys: an id present in two inputs is one feature, perturbed in
# both at once. Without a mask every element is its own feature, numbered in key order
# (captum's default). Each element's id is kept as a *position* into the sorted features
# ``ids``, so a per-feature value ``[T, N, P]`` spreads onto the elements by one ``gather``.
#
# The default features depend only on the keys, each sample's shape and the device: they
# are kept between calls under the rules of NOTE [kept windows] (at most `_KEPT_FEATURES`
# of them; their tensors are only read), and their values spread by slicing, each key's
# features being one run ``offset .. offset + size``.

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase

from .._types import NestedKey
from ._perturbation import as_maps, check_no_extra, per_sample_view, plain_tensors_now

__all__ = ["FeatureMask", "Features", "features", "selected", "spread"]

FeatureMask = torch.Tensor | TensorDictBase | Mapping[NestedKey, torch.Tensor] | None
_KEPT_FEATURES = 2**16  # default features kept between calls up to this many; NOTE [feature masks]


@dataclass
class Features:
    """The features of a call.

    Attributes:
        ids (Tensor): the feature ids, sorted, ``[P]``.
        positions (dict): per key, each element's index into ``ids``, ``[N or 1, *feature_shape]``.
        offsets (dict | None): for the default features, per key, its first feature (its
            elements are the features ``offset ..`` in order); else None.
    """

    ids: torch.Tensor
    positions: dict[NestedKey, torch.Tensor]
    offsets: dict[NestedKey, int] | None = None

    def maps(self, values: torch.Tensor, keys: Sequence[NestedKey], batch: torch.Size,
             per_target: bool) -> TensorDict:
        """Per-feature values ``[T, N, P]`` spread on each key's elements, as the result (see `as_maps`)."""
        n, out = values.shape[1], {}
        for key in keys:
            positions = self.positions[key]
            if self.offsets is None:
                out[key] = spread(values, positions, n)
            else:  # (the default features: each element its own, in order)
                start = self.offsets[key]
                out[key] = values[..., start: start + positions.numel()].reshape(*values.shape[:2],
                                                                                 *positions.shape[1:])
        return as_maps(out, batch, per_target)


def features(caller: str, inputs: TensorDictBase, keys: Sequence[NestedKey], feature_mask: FeatureMask, *,
             dense: bool = False) -> Features:
    """The features of ``inputs``' ``keys`` under ``feature_mask``; NOTE [feature masks].

    ``dense`` numbers the features ``0 .. max id`` (captum's Shapley sampling permutes
    them all, ids absent from the mask included); otherwise they are the distinct ids.
    """
    if feature_mask is None:
        return _default(inputs, keys)
    masks = _per_key(caller, feature_mask, keys)
    flat = {key: _flat_mask(caller, key, masks[key], inputs.get(key), inputs.batch_dims) for key in keys}
    every = torch.cat([m.reshape(-1) for m in flat.values()])
    if dense:
        if bool((every < 0).any()):
            raise ValueError(f"{caller}: feature_mask holds negative ids; number the features 0, 1, 2, ...")
        ids = torch.arange(int(every.max()) + 1, device=every.device)
        return Features(ids, flat)
    ids = torch.unique(every)
    return Features(ids, {key: torch.searchsorted(ids, m) for key, m in flat.items()})


def _default(inputs: TensorDictBase, keys: Sequence[NestedKey]) -> Features:
    xs = [inputs.get(key) for key in keys]
    shapes = tuple((key, x.shape[inputs.batch_dims:], x.device) for key, x in zip(keys, xs, strict=True))
    if sum(shape.numel() for _, shape, _ in shapes) <= _KEPT_FEATURES and plain_tensors_now():
        return _kept_default(shapes)
    return _built_default(shapes)


@functools.lru_cache(maxsize=16)  # (16 sets of 2**16 features: 8 MiB of positions at most)
def _kept_default(shapes: tuple[tuple[NestedKey, torch.Size, torch.device], ...]) -> Features:
    """`_built_default`, kept for the next call on the same keys, shapes and devices: NOTE [feature masks]."""
    return _built_default(shapes)


def _built_default(shapes: tuple[tuple[NestedKey, torch.Size, torch.device], ...]) -> Features:
    positions, offsets, offset = {}, {}, 0
    for key, shape, device in shapes:
        n = shape.numel()
        positions[key] = (torch.arange(n, device=device) + offset).reshape(1, *shape)
        offsets[key] = offset
        offset += n
    return Features(torch.arange(offset, device=shapes[0][2] if shapes else None), positions, offsets)


def _per_key(caller: str, feature_mask: FeatureMask, keys: Sequence[NestedKey]) -> dict[NestedKey, torch.Tensor]:
    if isinstance(feature_mask, torch.Tensor):
        if len(keys) != 1:
            raise TypeError(f"{caller}: a tensor feature_mask fits one perturbed input, but {len(keys)} are "
                            f"perturbed {list(keys)}; pass a TensorDict (or dict) with a mask per key")
        return {keys[0]: feature_mask}
    if isinstance(feature_mask, TensorDictBase):
        given = {key: feature_mask.get(key) for key in feature_mask.keys(True, True)}
    elif isinstance(feature_mask, Mapping):
        given = dict(feature_mask)
    else:
        raise TypeError(f"{caller}: feature_mask must be a tensor, a TensorDict or a dict of tensors, got "
                        f"{type(feature_mask).__name__}")
    check_no_extra(caller, "feature_mask", given, keys)
    missing = [key for key in keys if key not in given]
    if missing:
        raise KeyError(f"{caller}: feature_mask has no mask for input {missing[0]!r}; give one for every "
                       f"perturbed input {list(keys)} (or name them with input_keys=[...])")
    return given


def _flat_mask(caller: str, key: NestedKey, mask: torch.Tensor, x: torch.Tensor, batch_dims: int) -> torch.Tensor:
    """``mask`` as positions ``[N, *feat]``, or ``[1, *feat]`` where every sample shares it."""
    if not isinstance(mask, torch.Tensor) or mask.is_floating_point() or mask.is_complex() \
            or mask.dtype == torch.bool:
        kind = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"{caller}: feature_mask {key!r} must hold integer feature ids, got {kind}; convert "
                        "whole numbers with .long()")
    while mask.dim() > x.dim() and mask.shape[0] == 1:  # (captum's [1, *feat] for a sample without batch dims)
        mask = mask[0]
    try:
        full = torch.broadcast_to(mask, x.shape)
    except RuntimeError:
        raise ValueError(f"{caller}: feature_mask {key!r} has shape {list(mask.shape)}, which does not broadcast to "
                         f"the input's {list(x.shape)}; give one sample's shape {list(x.shape[batch_dims:])} or "
                         "the input's") from None
    feature_dims = x.dim() - batch_dims
    shared = all(s == 1 for s in mask.shape[: max(mask.dim() - feature_dims, 0)])
    if shared:
        return full[(0,) * batch_dims].reshape(1, *x.shape[batch_dims:]).long().contiguous()
    return per_sample_view(full, batch_dims).long().contiguous()


def selected(positions: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Which elements rows ``lo .. hi - 1`` perturb, row ``r`` feature ``r - 1``: ``[p, N or 1, *feat]``."""
    rows = torch.arange(lo - 1, hi - 1, device=positions.device)
    return positions.unsqueeze(0) == rows.reshape(-1, *[1] * positions.dim())


def spread(values: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
    """Per-feature values ``[T, N, P]`` on the elements: ``[T, N, *feat]``."""
    t = values.shape[0]
    index = positions.reshape(positions.shape[0], -1).expand(n, -1)
    picked = values.gather(2, index.unsqueeze(0).expand(t, -1, -1))
    return picked.reshape(t, n, *positions.shape[1:])
