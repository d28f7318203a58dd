"""Where a path starts: the baselines of the attributed inputs, as integrated gradients and its delta take them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from .._functional import NestedKey
from ._engine import input_keys_of

__all__ = ["Baselines", "attributed_keys", "both_ends", "path_starts", "starts_by_key"]

Baselines = TensorDictBase | torch.Tensor | float


def attributed_keys(caller: str, f: Callable[..., Any], inputs: TensorDictBase,
                    input_keys: NestedKey | Sequence[NestedKey] | None) -> tuple[NestedKey, ...]:
    """The inputs the baselines replace: ``input_keys``, else every input ``f`` reads (one, or all positional)."""
    if input_keys is None and len(getattr(f, "keywords", {})) > 1:
        raise ValueError(
            f"{caller}: f passes {list(getattr(f, 'in_keys', ()))} as keyword arguments; say which of them the "
            "baselines replace with input_keys=[...] (e.g. input_keys=['input_ids']: the others, such as an "
            "attention mask, are then passed unchanged, as captum's additional_forward_args)")
    keys = input_keys_of(f, inputs, input_keys)
    if input_keys is None:
        return keys
    present = inputs.keys(True, True)
    missing = []
    for key in keys:  # (a loop, not a comprehension: one Python call less, on every compat call)
        if key not in present:
            missing.append(key)
    if missing:
        raise KeyError(f"{caller}: input_keys names {missing}, which the inputs do not hold; they hold "
                       f"{sorted(map(str, present))}")
    return keys


def path_starts(inputs: TensorDictBase, baselines: Baselines, keys: Sequence[NestedKey], caller: str) -> TensorDict:
    """The baseline of each of ``keys``, in the input's shape: from a TensorDict, a tensor or a number."""
    out = TensorDict({}, batch_size=inputs.batch_size)
    for key, b in starts_by_key(inputs, baselines, keys, caller).items():
        out.set(key, b)
    return out


def starts_by_key(inputs: TensorDictBase, baselines: Baselines, keys: Sequence[NestedKey],
                  caller: str) -> dict[NestedKey, torch.Tensor]:
    """`path_starts` as a dict by key (no TensorDict built: the perturbation methods read each key's)."""
    if isinstance(baselines, torch.Tensor) and len(keys) != 1:
        raise TypeError(f"{caller}: a tensor baseline fits one attributed input, but {len(keys)} are "
                        f"attributed {list(keys)}; pass baselines as a TensorDict with those keys, or a number")
    starts = {}
    for key in keys:  # (a loop, not a comprehension: one Python call less, on every call)
        starts[key] = _start(inputs.get(key), baselines, key, caller)
    return starts


def _start(x: torch.Tensor, baselines: Baselines, key: NestedKey, caller: str) -> torch.Tensor:
    """The baseline of the input ``x`` under ``key``, in its shape."""
    if isinstance(baselines, TensorDictBase):
        if key not in baselines.keys(True, True):
            raise KeyError(f"{caller}: no baseline for input {key!r}; give one, or name the inputs the baselines "
                           "replace with input_keys=[...]")
        b = baselines.get(key)
        if b.shape != x.shape:
            raise ValueError(f"{caller}: baseline {key!r} has shape {tuple(b.shape)}, input {tuple(x.shape)}")
        _check_kind(caller, key, b, x)
        return cast(torch.Tensor, b)
    if isinstance(baselines, torch.Tensor):
        return _broadcast(caller, key, baselines, x)
    if isinstance(baselines, (int, float)) and not isinstance(baselines, bool):
        if not (x.is_floating_point() or x.is_complex()) and not float(baselines).is_integer():
            raise ValueError(f"{caller}: input {key!r} is {x.dtype} (token ids) and the baseline "
                             f"{baselines!r} is not a whole number; give an id (a pad or mask token)")
        return torch.full_like(x, baselines)
    raise TypeError(f"{caller}: baselines must be a TensorDict, a tensor or a number, got "
                    f"{type(baselines).__name__}")


def both_ends(inputs: TensorDictBase, starts: TensorDictBase) -> TensorDictBase:
    """The path's start (the inputs, ``starts`` in place of theirs) and end in one batch ``[2, *B]``."""
    first = inputs.clone(False)
    first.update(starts)
    return cast(TensorDictBase, torch.stack([first, inputs]))


def _check_kind(caller: str, key: NestedKey, b: torch.Tensor, x: torch.Tensor) -> None:
    """A baseline of ids for ids, a floating-point one for floating-point inputs."""
    if (b.is_floating_point() or b.is_complex()) != (x.is_floating_point() or x.is_complex()):
        raise TypeError(f"{caller}: baselines is {b.dtype} for input {key!r}, which is {x.dtype} (token ids "
                        "take a baseline of ids, floating-point inputs a floating-point baseline)")


def _broadcast(caller: str, key: NestedKey, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A tensor baseline for input ``key``: its shape, or one that broadcasts to it (one sample's, ``[1, ...]``)."""
    _check_kind(caller, key, b, x)
    try:
        return b.to(x.dtype).expand(x.shape)
    except RuntimeError:
        raise ValueError(f"{caller}: baselines has shape {list(b.shape)}, which does not broadcast to "
                         f"input {key!r} of shape {list(x.shape)}; give the input's shape, one sample's "
                         f"{list(x.shape[1:])} or a number") from None
