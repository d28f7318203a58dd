"""What LIME and KernelSHAP share: interpretable features, the perturbed inputs in chunks, the maps."""

# NOTE [surrogate perturbations]
# An interpretable sample is a row of ``F`` zeros and ones, one per feature (a group of
# input elements, `feature_mask`): a one keeps the feature's elements of the input, a zero
# puts the baseline's there (captum's default transform). The ``n`` samples of every input
# sample, ``[*B, n, F]``, are drawn (or given) once; the perturbed inputs are built from
# them chunk by chunk, ``chunk_size`` per input sample, and every chunk of every input
# sample runs through ``f`` in one batched forward (captum runs one input sample at a
# time, ``perturbations_per_eval`` each). The chunks' target values ``[*B, n, T]`` are then
# fitted by the interpretable model in one batched solve (NOTE [batched surrogate fits]),
# and each coefficient is written on its feature's elements.

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from .._targets import Target, values_readable
from .._types import NestedKey, PureFn
from ._baselines import Baselines, attributed_keys, starts_by_key
from ._flat_copies import flat_copies, flat_target
from ._inputs import check_call
from ._metric_samples import check_count, chunks
from ._perturbation import target_columns
from ._target_values import target_values

__all__ = ["FeatureMask", "Surrogate", "check_n_samples", "check_weights", "checked_samples", "evaluate",
           "interpretable_samples", "maps", "prepare"]

FeatureMask = TensorDictBase | Mapping[NestedKey, torch.Tensor] | torch.Tensor
WeightFn = Callable[[TensorDictBase, TensorDictBase, torch.Tensor], torch.Tensor]


class Surrogate:
    """One call's inputs, baselines and features: what every chunk is built from.

    Attributes:
        inputs (TensorDict): the inputs, batch ``[*B]``.
        keys (tuple): the attributed (perturbed) keys.
        starts (dict): the baseline of each attributed key, in its shape.
        masks (dict): key -> feature index of every element, ``[*B, D]`` (one sample flattened).
        n_features (int): ``F``.
    """

    def __init__(self, inputs: TensorDictBase, keys: tuple[NestedKey, ...], starts: dict[NestedKey, torch.Tensor],
                 masks: dict[NestedKey, torch.Tensor], n_features: int) -> None:
        self.inputs, self.keys, self.starts, self.masks, self.n_features = inputs, keys, starts, masks, n_features

    def perturbed(self, samples: torch.Tensor) -> dict[NestedKey, torch.Tensor]:
        """The attributed inputs for the interpretable ``samples`` ``[*B, k, F]`` (bool): ``[*B, k, ...]`` by key."""
        batch, k = self.inputs.batch_size, samples.shape[-2]
        out = {}
        for key in self.keys:
            x, b, mask = self.inputs.get(key), self.starts[key], self.masks[key]
            index = mask.unsqueeze(-2).expand(*batch, k, mask.shape[-1])
            kept = samples.gather(-1, index).reshape(*batch, k, *x.shape[len(batch):])
            out[key] = torch.where(kept, x.unsqueeze(len(batch)), b.unsqueeze(len(batch)))
        return out


def prepare(caller: str, f: PureFn, params: TensorDictBase, inputs: TensorDictBase, baselines: Baselines,
            target: Target, feature_mask: FeatureMask | None, input_keys: NestedKey | Sequence[NestedKey] | None,
            chunk_size: int | None) -> Surrogate:
    """Check the arguments and resolve baselines and features, before anything runs."""
    check_count(caller, "chunk_size", chunk_size, optional=True)
    check_call(caller, f, params, inputs, (), target)
    keys = attributed_keys(caller, f, inputs, input_keys)
    for key in keys:
        if inputs.get(key, None) is None:
            raise KeyError(f"{caller}: the inputs have no attributed key {key!r} (keys: "
                           f"{list(inputs.keys(True, True))})")
    starts = starts_by_key(inputs, baselines, keys, caller)  # (a dict: only read by key)
    masks, n_features = feature_masks(caller, inputs, keys, feature_mask)
    return Surrogate(inputs, keys, starts, masks, n_features)


def feature_masks(caller: str, inputs: TensorDictBase, keys: Sequence[NestedKey],
                  feature_mask: FeatureMask | None) -> tuple[dict[NestedKey, torch.Tensor], int]:
    """Each key's feature indices, ``[*B, D]`` from 0, and the number of features (captum's rules).

    No mask: every element its own feature, numbered across the keys in order. A mask
    broadcasts to its input (one sample's shape, ``[1, ...]``, or per sample); indices
    that do not start at 0 are shifted there, with a warning, as in captum.
    """
    batch = inputs.batch_size
    if feature_mask is None:
        out, offset = {}, 0
        for key in keys:
            x = inputs.get(key)
            size = x[(0,) * len(batch)].numel() if len(batch) else x.numel()
            out[key] = (torch.arange(size, device=x.device) + offset).expand(*batch, size)
            offset += size
        return out, offset
    given = _masks_by_key(caller, keys, feature_mask)
    out = {}
    for key in keys:
        out[key] = _broadcast_mask(caller, key, given[key], inputs.get(key), batch)
    bounds = [[int(b) for b in torch.aminmax(m)] for m in out.values() if m.numel()]  # (one op a key)
    low, high = min(b[0] for b in bounds), max(b[1] for b in bounds)
    if low < 0:
        raise ValueError(f"{caller}: feature_mask holds the index {low}; feature indices are 0, 1, 2, ...")
    if low > 0:
        warnings.warn(f"{caller}: the smallest index in feature_mask is {low}, not 0; shifting the indices to "
                      "start at 0 (as captum does)", stacklevel=3)
        out = {key: m - low for key, m in out.items()}
    return out, high - low + 1


def _masks_by_key(caller: str, keys: Sequence[NestedKey], feature_mask: FeatureMask) -> dict[NestedKey, Any]:
    if isinstance(feature_mask, torch.Tensor):
        if len(keys) != 1:
            raise TypeError(f"{caller}: a tensor feature_mask fits one attributed input, but {len(keys)} are "
                            f"attributed {list(keys)}; pass a TensorDict (or dict) with a mask per key")
        return {keys[0]: feature_mask}
    if not isinstance(feature_mask, (TensorDictBase, Mapping)):
        raise TypeError(f"{caller}: feature_mask must be a tensor, a TensorDict or a dict of integer tensors, got "
                        f"{type(feature_mask).__name__}")
    out = {}
    for key in keys:
        mask = feature_mask.get(key, None)
        if mask is None:
            raise KeyError(f"{caller}: feature_mask has no mask for the attributed input {key!r}; give one per "
                           f"attributed input")
        out[key] = mask
    return out


def _broadcast_mask(caller: str, key: NestedKey, mask: Any, x: torch.Tensor, batch: torch.Size) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.is_floating_point() or mask.is_complex() or mask.dtype == torch.bool:
        kind = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"{caller}: feature_mask {key!r} must hold integer feature indices, got {kind}")
    try:
        full = mask.to(device=x.device, dtype=torch.long).expand(x.shape)
    except RuntimeError:
        raise ValueError(f"{caller}: feature_mask {key!r} has shape {list(mask.shape)}, which does not broadcast to "
                         f"the input's {list(x.shape)}; give one sample's shape or the input's") from None
    return full.reshape(*batch, -1)


def evaluate(caller: str, f: PureFn, params: TensorDictBase, surrogate: Surrogate, samples: torch.Tensor,
             target: Target, per_target: bool, chunk_size: int | None,
             weigh: WeightFn | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target values ``[*B, n, T]`` of every interpretable sample, and ``weigh``'s weights ``[*B, n]``.

    Several targets are summed unless ``per_target`` (``T = 1`` then); so are several
    target keys. Each chunk is built, weighed and run, then dropped.
    """
    batch = surrogate.inputs.batch_size
    # (both built alike from a dict, so that their keys come in one order)
    attributed = TensorDict({key: surrogate.inputs.get(key) for key in surrogate.keys}, batch_size=batch) \
        if weigh is not None else surrogate.inputs
    values, weights, start = [], [], 0
    for k in chunks(samples.shape[-2], chunk_size):
        part = samples[..., start:start + k, :]
        start += k
        perturbed = surrogate.perturbed(part)
        if weigh is not None:
            weights.append(weigh(attributed, TensorDict(perturbed, batch_size=[*batch, k]), part))
        feed = flat_copies(surrogate.inputs, k, perturbed)  # NOTE [flat copies]
        outputs = target_values(f, params, feed, flat_target(target, batch, k))
        values.append(target_columns(caller, outputs, feed.batch_size,
                                     per_target).reshape(*batch, k, -1))
    if len(values) == 1:  # (one chunk: no copy)
        return values[0], (weights[0] if weigh is not None else None)
    return torch.cat(values, -2), (torch.cat(weights, -1) if weigh is not None else None)


def maps(surrogate: Surrogate, coefs: torch.Tensor, per_target: bool) -> TensorDict:
    """Each coefficient ``[*B, T, F]`` on its feature's elements: maps ``[*B]`` (``[T, *B]`` per target)."""
    batch = surrogate.inputs.batch_size
    lead = [coefs.shape[-2]] if per_target else []
    out = TensorDict({}, batch_size=[*lead, *batch])
    for key in surrogate.keys:
        x, mask = surrogate.inputs.get(key), surrogate.masks[key]
        index = mask.unsqueeze(-2).expand(*batch, coefs.shape[-2], mask.shape[-1])
        picked = coefs.gather(-1, index).reshape(*batch, coefs.shape[-2], *x.shape[len(batch):])
        out.set(key, picked.movedim(len(batch), 0) if per_target else picked.squeeze(len(batch)))
    return out


def interpretable_samples(caller: str, surrogate: Surrogate, samples: Any, n_samples: int | None,
                          draw: Callable[[torch.Size, int], torch.Tensor]) -> torch.Tensor:
    """The interpretable samples ``[*B, n, F]`` on the inputs' device: ``samples`` checked, else ``draw(batch, n)``.

    ``n`` is ``n_samples``, else 25 (captum's), checked by `check_n_samples`.
    """
    batch, n_features = surrogate.inputs.batch_size, surrogate.n_features
    if samples is not None:
        samples = checked_samples(caller, samples, batch, n_features)
    n = check_n_samples(caller, n_samples, samples, 25)
    if samples is None:
        samples = draw(batch, n)
    return cast(torch.Tensor, samples).to(surrogate.starts[surrogate.keys[0]].device)


def checked_samples(caller: str, samples: Any, batch: torch.Size, n_features: int) -> torch.Tensor:
    """User-given interpretable samples, ``[n, F]`` or ``[*B, n, F]`` of zeros and ones, as bool ``[*B, n, F]``."""
    if not isinstance(samples, torch.Tensor):
        raise TypeError(f"{caller}: samples must be a tensor of zeros and ones, got {type(samples).__name__}")
    if samples.dim() < 2 or samples.shape[-1] != n_features or samples.shape[:-2] not in (torch.Size(), batch):
        raise ValueError(f"{caller}: samples has shape {list(samples.shape)}; give [n, {n_features}] (the same for "
                         f"every input sample) or {[*batch, 'n', n_features]} ({n_features} features)")
    if samples.dtype != torch.bool and values_readable(samples) and bool(((samples != 0) & (samples != 1)).any()):
        raise ValueError(f"{caller}: samples must hold only zeros and ones (a one keeps a feature, a zero puts "
                         "the baseline there)")
    return samples.bool().expand(*batch, *samples.shape[-2:])


def check_n_samples(caller: str, n_samples: int | None, samples: torch.Tensor | None, default: int) -> int:
    """The number of interpretable samples: ``n_samples``, else the given samples', else ``default``.

    At least 2: a linear model with an intercept fitted to one sample is all zeros.
    """
    check_count(caller, "n_samples", n_samples, optional=True)
    if samples is not None and n_samples is not None and n_samples != samples.shape[-2]:
        raise ValueError(f"{caller}: n_samples={n_samples}, but samples holds {samples.shape[-2]} rows; give one of "
                         "them")
    n = int(samples.shape[-2]) if samples is not None else default if n_samples is None else n_samples
    if n < 2:
        raise ValueError(f"{caller}: needs at least 2 interpretable samples (n_samples), got {n}: a linear model with "
                         "an intercept fitted to one sample has all coefficients 0")
    return n


def check_weights(caller: str, weights: torch.Tensor) -> None:
    """Raise where every weight of an input sample is 0: its fit would be 0 / 0 (where the values can be read)."""
    if not values_readable(weights):
        return
    empty = weights.sum(-1) == 0
    if bool(empty.any()):
        raise ValueError(f"{caller}: every similarity weight of {int(empty.sum())} input sample(s) is 0 (the kernel "
                         "underflows: the perturbed inputs are too far for kernel_width); increase kernel_width, or "
                         "give a similarity_func with positive weights")

