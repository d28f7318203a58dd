"""Argument checks of the path methods (conductance, internal influence), run before anything else."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from .._targets import Target
from .._types import NestedKey
from ._baselines import Baselines, attributed_keys, path_starts
from ._inputs import check_call, check_layers

__all__ = ["check_chunk_size", "check_floating", "check_layer_paths", "check_steps", "checked_path_ends"]


def check_steps(caller: str, n_steps: Any, *, least: int) -> None:
    """``n_steps`` must be an int of at least ``least``."""
    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < least:
        raise ValueError(f"{caller}: n_steps must be an int >= {least}, got {n_steps!r}")


def check_chunk_size(caller: str, chunk_size: Any) -> None:
    """``chunk_size`` must be ``None`` or a positive int (path points per forward)."""
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"{caller}: chunk_size should be None or an int > 0 (path points per forward), "
                         f"got {chunk_size!r}")


def check_floating(caller: str, inputs: TensorDictBase, keys: Sequence[NestedKey]) -> None:
    """Each input on the path must be floating point: integer token ids round every path point to the baseline."""
    for key in keys:
        value = inputs.get(key, None)
        if isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex()):
            raise TypeError(f"{caller}: input {key!r} is {value.dtype} and cannot move along a path from the "
                            "baseline (every point would round to it); name only the floating-point inputs in "
                            "input_keys=[...] (the others are then passed unchanged)")


def check_layer_paths(caller: str, layers: Any) -> None:
    """``layers`` must be a non-empty list of submodule paths."""
    check_layers(caller, layers)
    if not layers:
        raise ValueError(f"{caller}: layers is empty; name the layers to attribute, e.g. layers=['encoder.linear1']")


def checked_path_ends(caller: str, f: Any, params: TensorDictBase, inputs: TensorDictBase, baselines: Baselines,
                      target: Target, input_keys: NestedKey | Sequence[NestedKey] | None,
                      ) -> tuple[tuple[NestedKey, ...], TensorDict]:
    """The attributed keys and their baselines, after checking the call and that those inputs can move."""
    check_call(caller, f, params, inputs, target=target)  # errors named here, before any path point runs
    keys = attributed_keys(caller, f, inputs, input_keys)
    check_floating(caller, inputs, keys)
    return keys, path_starts(inputs, baselines, keys, caller)
