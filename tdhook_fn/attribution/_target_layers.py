"""Target layers: activations a target reads besides the outputs, each captured from the one run of its module."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from .._taps import Tap, capture
from ._layer_specs import run_counters

__all__ = ["check_target_layer_runs", "target_layer_keys", "target_layer_taps", "target_layer_values"]

_TGT = "_tdhook_fn_target_layer_"


def target_layer_keys(target_layers: Sequence[str]) -> list[str]:
    """The keys under which `target_layer_taps` capture the target layers, in their order (private to the call)."""
    return [f"{_TGT}{i}" for i in range(len(target_layers))]


def target_layer_taps(target_layers: Sequence[str], runs: list[int]) -> list[Tap]:
    """A capture of each target layer, and counters of its module's runs (for `check_target_layer_runs`)."""
    return [*(capture(p, key=f"{_TGT}{i}") for i, p in enumerate(target_layers)), *run_counters(target_layers, runs)]


def check_target_layer_runs(caller: str, target_layers: Sequence[str], runs: Sequence[int]) -> None:
    """A target layer's module must run once: a capture of a module run twice would hold its last run."""
    if torch.compiler.is_compiling():
        return
    for path, n in zip(target_layers, runs, strict=True):
        if n == 0:
            raise ValueError(f"{caller}: target layer {path!r} never ran in the forward")
        if n > 1:
            raise ValueError(f"{caller}: target layer {path!r} ran {n} times in one forward; a target layer must run "
                             "once (the target would read one of its runs silently); read that run with a target "
                             "callable over a capture tap instead")


def target_layer_values(out: TensorDictBase, target_layers: Sequence[str]) -> TensorDict | None:
    """The target layers' activations by path, from their captures in ``out``; None without target layers."""
    if not target_layers:
        return None
    return TensorDict({p: out.get(f"{_TGT}{i}") for i, p in enumerate(target_layers)}, batch_size=out.batch_size)
