"""DeepLift on LRP's walk: the inputs and their references stacked as one batch, the rescale rule at each nonlinearity.

`lrp` pulls the target back through the stacked batch with the rescale rules
(NOTE [deeplift as lrp rules]): one forward, one modified backward (per target: one-hot
cotangents, no further forward). `deeplift` and `layer_deeplift` take this path where the
chain walk does not apply (NOTE [deeplift on a chain]).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from .._functional import Functional
from .._taps import capture
from .._targets import Target, as_target
from .._types import NestedKey
from ._baselines import Baselines, path_starts
from ._deeplift_rules import needs_reference_gradients, rescale_rules
from ._engine import unflatten
from ._lrp.method import ruled_gradients
from ._replaced_derivatives import as_values

__all__ = ["stacked_deeplift", "stacked_layer_deeplift"]


def _shared(inputs: TensorDictBase, baselines: Baselines, starts: TensorDictBase, carried: bool) -> bool:
    """Whether every sample has the same reference, and the inputs hold nothing else (one reference row suffices)."""
    if carried:
        return False  # (the references' rows carry each sample's gradient)
    if set(inputs.keys(True, True)) != set(starts.keys(True, True)):
        return False  # (other inputs, e.g. masks or labels, differ per sample: one reference row per sample)
    if isinstance(baselines, (int, float)):
        return True
    dims = inputs.batch_dims
    return all(all(s == 0 for s in cast(torch.Tensor, v).stride()[:dims]) for v in starts.values(True, True))


def _stacked(inputs: TensorDictBase, baselines: Baselines, keys: Sequence[NestedKey], caller: str,
             carried: bool) -> tuple[TensorDictBase, TensorDictBase]:
    """The inputs' rows, then the references' (one, or one per sample), flat; and the references ``[*B]``."""
    starts = path_starts(inputs, baselines, keys, caller)
    flat = inputs.reshape(-1)
    if flat.batch_size[0] and _shared(inputs, baselines, starts, carried):  # (no row to take of an empty batch)
        lead = inputs.batch_dims
        reference = TensorDict({k: v.reshape(-1, *v.shape[lead:])[:1] for k, v in starts.items(True, True)},
                               batch_size=[1])
    else:
        reference = flat.clone(False)
        reference.update(starts.reshape(-1))
    return cast(TensorDictBase, torch.cat([flat, reference])), starts


def _on_rows(target: Target, f: Functional, n: int, batch: torch.Size,
             carried: bool) -> Callable[[TensorDictBase], Any]:
    """The target read at the inputs' rows of the stacked batch; at the references' too where they carry a gradient.

    Elsewhere zeros there: no gradient (NOTE [deeplift as lrp rules]).
    """
    select = as_target(target, outputs=f.out_keys)

    def read(offered: TensorDictBase) -> TensorDict:
        values = select(offered.reshape(batch))
        if isinstance(values, torch.Tensor):
            values = TensorDict({"target": values}, batch_size=batch)
        if not isinstance(values, TensorDictBase):
            raise TypeError(f"a target must return a TensorDict or a tensor, got {type(values).__name__}")
        for key, value in values.items(True, True):
            if value.shape[: len(batch)] != batch:
                raise ValueError(f"target returned {key!r} of shape {list(value.shape)}; its leading dims must be "
                                 f"the batch {list(batch)}")
        return cast(TensorDict, values)

    def on_rows(offered: TensorDictBase) -> TensorDict:
        at_inputs = read(offered[:n])
        at_references = read(offered[n:]) if carried else None
        rows = offered.batch_size[0] - n
        out = TensorDict({}, batch_size=offered.batch_size)
        for key, leaf in at_inputs.items(True, True):
            value = cast(torch.Tensor, leaf).reshape(n, *leaf.shape[len(batch):])
            other = (value.new_zeros((rows, *value.shape[1:])) if at_references is None
                     else cast(torch.Tensor, at_references.get(key)).reshape(rows, *value.shape[1:]))
            out.set(key, torch.cat([value, other]))
        return out

    return on_rows


def _input_rows(t: torch.Tensor, lead: int, n: int, batch: torch.Size) -> torch.Tensor:
    """A map of the stacked batch (after ``lead`` target dims) at the inputs' rows, batch ``[*B]`` again."""
    return unflatten(t.narrow(lead, 0, n), lead, batch)


def _multipliers(caller: str, f: Functional, params: TensorDictBase, inputs: TensorDictBase, baselines: Baselines,
                 target: Target, eps: float, per_target: bool, keys: Sequence[NestedKey],
                 layers: Sequence[str]) -> tuple[TensorDict, TensorDictBase, TensorDictBase]:
    """DeepLift's multipliers (batch ``[*B]`` or ``[T, *B]``), the references, the stacked inputs.

    ``keys`` are replaced by the baselines; they are attributed unless ``layers`` are.
    """
    batch = inputs.batch_size
    n = batch.numel()
    lead = 1 if per_target else 0
    # (refused under its own name, not lrp's: NOTE [replaced derivatives are not differentiated])
    inputs = as_values(caller, params, inputs)
    carried = needs_reference_gradients(f.model)
    stacked, starts = _stacked(inputs, baselines, keys, caller, carried)
    maps, _ = ruled_gradients(caller, f, params, stacked, _on_rows(target, f, n, batch, carried),
                              rescale_rules(n, stacked.batch_size[0], eps, carried), per_target=per_target,
                              layers=layers, use_inputs=not layers, input_keys=list(keys), warn_on_missing_rule=False)
    out = TensorDict({}, batch_size=[*maps.batch_size[:lead], *batch])
    for key, value in maps.items(True, True):
        out.set(key, _input_rows(cast(torch.Tensor, value), lead, n, batch))
    return out, starts, stacked


def stacked_deeplift(caller: str, f: Functional, params: TensorDictBase, inputs: TensorDictBase,
                     baselines: Baselines, target: Target, eps: float, per_target: bool, keys: Sequence[NestedKey],
                     multiply: bool) -> TensorDict:
    """`deeplift`'s maps of the inputs ``keys`` on LRP's walk (``f`` and ``eps`` checked), errors named by
    ``caller``."""
    grads, starts, _ = _multipliers(caller, f, params, inputs, baselines, target, eps, per_target, keys, ())
    if not multiply:
        return grads
    out = TensorDict({}, batch_size=grads.batch_size)
    with torch.no_grad():  # (not differentiable: a graph through the inputs' factor alone would be a wrong one)
        for key in keys:
            out.set(key, grads.get(key) * (inputs.get(key) - starts.get(key)))
    return out


def stacked_layer_deeplift(f: Functional, params: TensorDictBase, inputs: TensorDictBase, baselines: Baselines,
                           target: Target, eps: float, per_target: bool, keys: Sequence[NestedKey],
                           layers: Sequence[str], multiply: bool) -> TensorDict:
    """`layer_deeplift`'s maps of the ``layers`` on LRP's walk, the baselines replacing ``keys`` (``f`` and ``eps``
    checked)."""
    try:
        grads, _, stacked = _multipliers("layer_deeplift", f, params, inputs, baselines, target, eps, per_target,
                                         keys, layers)
    except ValueError as error:
        _refuse_layers_run_twice(f, params, inputs, layers, error)
        raise
    if not multiply:
        return grads
    return _times_layer_change(f, params, stacked, grads, layers, inputs.batch_size)


def _refuse_layers_run_twice(f: Functional, params: TensorDictBase, inputs: TensorDictBase, layers: Sequence[str],
                             error: ValueError) -> None:
    """Raise, naming `layer_deeplift`, where ``error`` came of a layer whose module runs more than once.

    LRP's walk refuses such a layer naming ``lrp`` and its ``layer_calls``, which
    `layer_deeplift` does not take; the runs are counted here, only once the call has failed.
    """
    runs = dict.fromkeys(layers, 0)

    def counter(path: str) -> Callable[[Any], Any]:
        def count(value: Any) -> Any:
            runs[path] += 1
            return value

        return count

    try:
        with torch.no_grad():
            f.with_taps(*(capture(path, key=f"_tdhook_fn_runs_{i}", fn=counter(path))
                          for i, path in enumerate(layers)))(params, inputs)
    except Exception:
        return  # (the forward itself fails: the first error says why)
    for path, count in runs.items():
        if count > 1:
            raise ValueError(
                f"layer_deeplift: layer {path!r} runs {count} times in one forward; DeepLift attributes a layer "
                "whose module runs once: give each call its own module (a copy of the shared one, with the same "
                "weights) and attribute the one you mean, or attribute the inputs with deeplift"
            ) from error


def _times_layer_change(f: Any, params: TensorDictBase, stacked: TensorDictBase, grads: TensorDict,
                        layers: Sequence[str], batch: torch.Size) -> TensorDict:
    """The multipliers at each layer times the layer's activation at the inputs minus at the references."""
    n = batch.numel()
    keys = [f"_tdhook_fn_deeplift_{i}" for i in range(len(layers))]
    with torch.no_grad():
        seen = f.with_taps(*(capture(path, key=key) for path, key in zip(layers, keys, strict=True)))(params, stacked)
    out = TensorDict({}, batch_size=grads.batch_size)
    for path, key in zip(layers, keys, strict=True):
        act = seen.get(key)
        change = act[:n] - act[n:]
        out.set(path, grads.get(path) * unflatten(change, 0, batch))
    return out
