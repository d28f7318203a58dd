"""What the noise methods share: per-key standard deviations, Gaussian draws in captum's order, sums over copies."""

# NOTE [noise draws]
# SmoothGrad and GradientSHAP evaluate ``k`` noisy copies of every sample. The copies sit
# on a new last batch dim, ``[*B, k]`` (`repeated`), whose memory order is captum's
# ``repeat_interleave`` layout ``[N * k]``. Per chunk of copies, the noise of each
# attributed key is drawn in that memory order, key after key, with
# ``torch.randn(..., generator=generator) * stdev``: the numbers captum's
# ``torch.normal(0, stdev)`` draws from the same generator state, since
# ``torch.normal`` with a tensor of standard deviations draws unit normals and scales
# them. So with the same seed, chunks (``chunk_size`` = captum's
# ``nt_samples_batch_size``) and draw dtype, the noisy inputs are captum's, bitwise.
# captum draws its noise in the default dtype (float32) whatever the inputs' dtype;
# here it is drawn in the input's dtype unless ``noise_dtype`` says otherwise.

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from .._functional import fresh_tensordict
from .._types import NestedKey
from .._vjp import untransformed

__all__ = [
    "Stdevs",
    "check_noisable",
    "check_nt_type",
    "entry",
    "fold_copies",
    "mean_maps",
    "noise_draws",
    "noised",
    "stdevs_by_key",
]

Stdevs = float | Sequence[float] | Mapping[Any, float]

NT_TYPES = ("smoothgrad", "smoothgrad_sq", "vargrad")


def check_nt_type(caller: str, nt_type: Any) -> None:
    """``nt_type`` must be one of captum's noise tunnel types."""
    if nt_type not in NT_TYPES:
        raise ValueError(f"{caller}: nt_type must be one of {list(NT_TYPES)} (captum's NoiseTunnel types), "
                         f"got {nt_type!r}")


def check_noisable(caller: str, inputs: TensorDictBase, keys: Sequence[NestedKey]) -> None:
    """Every noised input must be present and floating point (token ids take no Gaussian noise)."""
    for key in keys:
        value = entry(inputs, key)
        if not isinstance(value, torch.Tensor):
            keys_held = list(inputs.keys(True, True))
            raise KeyError(f"{caller}: the inputs have no attributed key {key!r} (keys: {keys_held})")
        if not value.is_floating_point():
            raise TypeError(f"{caller}: input {key!r} is {value.dtype}; noise is added to floating-point inputs only "
                            "(for token ids, noise the embeddings: run the method on an f that takes them)")


def stdevs_by_key(caller: str, stdevs: Any, keys: Sequence[NestedKey]) -> dict[NestedKey, float]:
    """The standard deviation of each key's noise: one number for all, one per key in order, or a mapping."""
    if isinstance(stdevs, Mapping):
        missing = [k for k in keys if k not in stdevs]
        if missing:
            raise KeyError(f"{caller}: stdevs has no entry for input {missing[0]!r}; give one per attributed input")
        values = {k: stdevs[k] for k in keys}
    elif isinstance(stdevs, (list, tuple)):
        if len(stdevs) != len(keys):
            raise ValueError(f"{caller}: stdevs holds {len(stdevs)} values for {len(keys)} attributed inputs "
                             f"{list(keys)}; give one per input, in that order, or one number for all")
        values = dict(zip(keys, stdevs, strict=True))
    else:
        values = dict.fromkeys(keys, stdevs)
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{caller}: stdevs for input {key!r} must be a number >= 0, got {value!r}")
    return {k: float(v) for k, v in values.items()}


def noise_draws(inputs: TensorDictBase, stdevs: Mapping[NestedKey, float], k: int,
                generator: torch.Generator | None, dtype: torch.dtype | None) -> dict[NestedKey, torch.Tensor]:
    """Gaussian noise for ``k`` copies of every sample, ``[*B, k, ...]`` by key, drawn as NOTE [noise draws] says."""
    batch = inputs.batch_size
    out = {}
    for key, stdev in stdevs.items():
        x = entry(inputs, key)
        shape = (*batch, k, *x.shape[len(batch):])
        out[key] = torch.randn(shape, dtype=dtype or x.dtype, device=x.device, generator=generator).mul_(stdev)
    return out


def noised(inputs: TensorDictBase, noise: dict[NestedKey, torch.Tensor]) -> dict[NestedKey, torch.Tensor]:
    """The noisy copies ``[*B, k, ...]`` by key: each input plus its noise (`noise_draws`', which this may reuse).

    Eagerly, where the sum has the noise's dtype and the input is contiguous, it is added in
    the noise's own memory (a new tensor the draws made; the same numbers: ``x + e == e + x``).
    Otherwise ``x + e`` writes a new tensor in the input's memory order: the copies of a
    channels_last input are channels_last (a convolution then reads them without converting
    them, and its input gradient comes back in that order too), while the noise is still
    drawn in captum's order.
    """
    dims = inputs.batch_dims
    eager = untransformed()
    out = {}
    for key, value in noise.items():
        x = inputs.get(key)
        in_place = eager and x.is_contiguous() and torch.result_type(x, value) == value.dtype
        x = x.unsqueeze(dims)  # every copy the sample: broadcast, not repeated
        out[key] = value.add_(x) if in_place else x + value
    return out


def fold_copies(total: dict[NestedKey, torch.Tensor] | None, maps: TensorDictBase, batch: torch.Size, k: int, *,
                flat: bool, square: bool = False,
                factors: Mapping[NestedKey, torch.Tensor] | None = None) -> dict[NestedKey, torch.Tensor]:
    """``total`` plus the sum of ``maps`` (of their squares) over the copies, by key.

    ``maps`` hold the copies last in their batch: ``[*T, N * k]`` where ``flat``, else
    ``[*T, *B, k]``. ``factors``, by key, ``[*B, k, ...]`` (or broadcasting to it), multiply
    each map before the sum (GradientSHAP's ``x - b``; a leading ``T`` broadcasts).
    """
    lead = maps.batch_size[:maps.batch_dims - (1 if flat else len(batch) + 1)]
    out: dict[NestedKey, torch.Tensor] = {}
    for key, leaf in _entries(maps):
        value = cast(torch.Tensor, leaf)
        value = value.reshape(*lead, *batch, k, *value.shape[maps.batch_dims:])
        if factors is not None and key in factors:
            value = value * factors[key]
        part = (value * value if square else value).sum(len(lead) + len(batch))
        out[key] = part if total is None else total[key] + part
    return out


def entry(td: TensorDictBase, key: NestedKey) -> Any:
    """``td.get(key, None)``; a plain TensorDict's one-name entry read from its own dict (`get` costs a few calls)."""
    if type(td) is TensorDict and type(key) is str:
        return td.__dict__["_tensordict"].get(key)
    return td.get(key, None)


def _entries(td: TensorDictBase) -> Any:
    """``td.items(True, True)``; a plain TensorDict of tensors read from its own dict (a tenth of the calls)."""
    if type(td) is TensorDict:
        own = td.__dict__["_tensordict"]
        for value in own.values():  # (a loop, not a generator: on every call)
            if type(value) is not torch.Tensor:
                return td.items(True, True)
        return own.items()
    return td.items(True, True)


def mean_maps(total: Mapping[NestedKey, torch.Tensor], squares: Mapping[NestedKey, torch.Tensor] | None, n: int,
              nt_type: str, batch_size: Sequence[int]) -> TensorDict:
    """The maps of ``nt_type`` from the sums over ``n`` copies (and of their squares), batch ``batch_size``."""
    maps: dict[Any, Any] = {}
    for key, t in total.items():
        if nt_type == "smoothgrad":
            maps[key] = t / n
        else:
            assert squares is not None
            sq = squares[key] / n
            maps[key] = sq if nt_type == "smoothgrad_sq" else sq - (t / n) * (t / n)
    return fresh_tensordict(maps, batch_size)  # (sums over the copies of maps of batch batch_size)
