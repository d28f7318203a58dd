"""Target values read as `gradients` reads them, for callers that run their own forward: `target_values`, of a
forward nothing differentiates (the perturbation and surrogate methods, convergence deltas, the walks' targets),
and `offered_targets`, inside a forward the caller differentiates (layer pullbacks, LRP's chain)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

from .._pool_layout import fast_pooling
from .._taps import Tap
from .._targets import Target
from .._types import NestedKey
from ._engine import as_functional, extras_of, flat_inputs, offer
from ._target_layers import check_target_layer_runs, target_layer_keys, target_layer_taps, target_layer_values

__all__ = ["offered_targets", "target_values"]


def target_values(f: Callable[..., Any], params: TensorDictBase, inputs: TensorDictBase, target: Target, *,
                  target_layers: Sequence[str] = (), taps: Sequence[Tap] = ()) -> TensorDictBase:
    """The target values of ``f(params, inputs)``, seen as `gradients` sees them.

    The callers read these values, never differentiate them: the forward runs on the shadows that pool in
    channels-last (NOTE [shadow max pooling]).
    """
    flat = flat_inputs(inputs)
    run: Any = f
    runs: list[int] = []
    private: list[str] = []
    if target_layers or taps:  # (built only where there are some: this runs on every perturbation call)
        runs = [0] * len(target_layers)
        run = as_functional(f).with_taps(*target_layer_taps(target_layers, runs), *taps)
        private = target_layer_keys(target_layers)
    with fast_pooling():
        out = run(params, flat)
    seen = None
    if target_layers:
        check_target_layer_runs("target_values", target_layers, runs)
        seen = target_layer_values(out, target_layers)
    return offer(out, private, seen, extras_of(f, flat, ()), inputs.batch_size, True, target, check=False)


def offered_targets(f: Callable[..., Any], out: TensorDictBase, flat: TensorDictBase,
                    input_keys: Sequence[NestedKey], batch: torch.Size, target: Target,
                    target_layers: Sequence[str] = ()) -> TensorDictBase:
    """The target values of ``f``'s outputs ``out`` on the flattened inputs ``flat``, as `gradients` sees them
    (``out`` holding the captures of `target_layer_taps` where there are ``target_layers``)."""
    private = target_layer_keys(target_layers) if target_layers else []
    return offer(out, private, target_layer_values(out, target_layers), extras_of(f, flat, input_keys), batch, True,
                 target, check=True)
