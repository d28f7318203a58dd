"""The attributed layers' activations (shape, dtype, which run): probed on meta tensors, remembered, checked."""

# NOTE [remembered layer specs]
# Layer attribution needs each layer's activation shape before the forward: the zero
# perturbation is a primal of the VJP (NOTE [layer gradients]). A forward on meta tensors
# finds it, but meta kernels run in Python (measured on torch 2.13 CPU: layer saliency of a
# 4-layer MLP at batch 64 took 11-12 ms probing every call, 2.5-3.5 ms remembering). So `remembered_specs` keeps
# the specs per model, keyed by the layers, the runs asked for and the inputs' keys,
# shapes and dtypes, and the call checks them against what it sees (`checked_taps`,
# `check_runs`): the activation's type, shape and dtype at the layer, and how many
# times its module ran. Any difference (the model was changed, or runs otherwise on these
# inputs) raises `StaleSpec` inside the forward; the engine then probes afresh and
# makes the call again. A fresh probe that the call contradicts raises a ``RuntimeError``
# naming the layer. Under torch.compile nothing is remembered: the probe is dead code in
# the graph there.

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from tensordict import TensorDictBase
from torch import nn

from .._functional import Functional
from .._probe import on_meta
from .._taps import Tap, capture
from .._types import Replace
from .._vjp import RandomState

__all__ = ["LayerSpec", "StaleSpec", "check_runs", "checked_taps", "layer_specs", "remembered_specs", "run_counters",
           "with_specs"]

T = TypeVar("T")
_PER_MODEL = 8  # remembered input signatures per model
_memory: weakref.WeakKeyDictionary[nn.Module, OrderedDict[Any, list[LayerSpec]]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


@dataclass(frozen=True)
class LayerSpec:
    """What one probe forward tells about an attributed layer: its activation and which run."""

    shape: torch.Size
    dtype: torch.dtype
    call: int | None  # the run attributed; None when the module runs once
    runs: int = 1  # how many times the module ran in the probe


class StaleSpec(Exception):
    """A remembered spec does not fit this call (see NOTE [remembered layer specs])."""

    def __init__(self, path: str, seen: str, spec: str):
        super().__init__(f"layer {path!r}: this call sees {seen}, the probe saw {spec}")
        self.path = path


def layer_specs(f: Functional, params: TensorDictBase, td: TensorDictBase, paths: Sequence[str],
                layer_calls: Mapping[str, int] | None = None, *, caller: str = "attribution",
                every_tap: bool = False) -> list[LayerSpec]:
    """Shape, dtype and run of each layer's activation, from a forward on meta tensors (no compute); ``every_tap``:
    one that the taps leaving probes alone run in too (`tdhook_fn._probe.on_meta`)."""
    # NOTE [modules that run more than once]
    # A module called several times in one forward (a shared block, a weight-tied layer) has
    # one activation per run. The gradient and the activation of a layer always come from the
    # same run: the one ``layer_calls[path]`` names (``0`` first, ``-1`` last). Without an
    # entry such a layer raises, naming the path and the number of runs, rather than mixing
    # the gradient summed over runs with the last run's activation.
    seen: dict[str, list[tuple[torch.Size, torch.dtype]]] = {path: [] for path in paths}

    def recorder(path: str) -> Callable[[Any], Any]:
        def record(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"{caller}: layer {path!r} outputs a {type(value).__name__}, not a tensor; attribute a "
                    "submodule whose output is one tensor (for a block returning a tuple, one of its sublayers)"
                )
            seen[path].append((value.shape, value.dtype))
            return value
        return record

    wanted = dict(layer_calls or {})
    unknown = sorted(set(wanted) - set(paths))
    if unknown:
        raise ValueError(f"{caller}: layer_calls names {unknown}, which are not among the layers {list(paths)}")
    probe = f.with_taps(*(Tap(p, "capture", recorder(p), key=f"_tdhook_fn_probe_{i}") for i, p in enumerate(paths)))

    def reset() -> None:
        for runs in seen.values():
            runs.clear()

    on_meta(probe, params, td, reset=reset, every_tap=every_tap)
    specs = []
    for path in paths:
        call = _chosen_run(caller, path, len(seen[path]), wanted.get(path))
        shape, dtype = seen[path][call or 0]
        if td.batch_size and shape[:1] != td.batch_size[:1]:
            raise ValueError(
                f"{caller}: layer {path!r} outputs shape {list(shape)}, whose first dim is not the batch "
                f"(this forward's {td.batch_size[0]} rows): a layer is attributed per sample, "
                "so its activation needs one row per sample, batch first. A batch-free activation (a positional "
                "embedding shared by the samples, a layer of a batch_first=False model) cannot be; attribute a "
                "layer after it joins the batch, or give the model batch-first inputs")
        specs.append(LayerSpec(shape, dtype, call, len(seen[path])))
    return specs


def remembered_specs(f: Functional, params: TensorDictBase, td: TensorDictBase, paths: Sequence[str],
                     layer_calls: Mapping[str, int] | None = None, *, caller: str = "attribution",
                     fresh: bool = False, every_tap: bool = False) -> tuple[list[LayerSpec], bool]:
    """`layer_specs`, remembered per model; and whether they came from memory (to be checked)."""
    if torch.compiler.is_compiling():
        return layer_specs(f, params, td, paths, layer_calls, caller=caller, every_tap=every_tap), False
    inputs = [(k, tuple(v.shape), v.dtype, v.device) for k, v in td.items(True, True) if isinstance(v, torch.Tensor)]
    key = (tuple(paths), tuple(sorted((k, repr(v)) for k, v in (layer_calls or {}).items())), tuple(inputs))
    with _lock:
        known = _memory.setdefault(f.model, OrderedDict())
        specs = None if fresh else known.get(key)
        if specs is not None:
            known.move_to_end(key)
            return specs, True
    specs = layer_specs(f, params, td, paths, layer_calls, caller=caller, every_tap=every_tap)
    with _lock:
        known[key] = specs
        while len(known) > _PER_MODEL:
            known.popitem(last=False)
    return specs, False


def with_specs(f: Functional, params: TensorDictBase, td: TensorDictBase, paths: Sequence[str],
               layer_calls: Mapping[str, int] | None, caller: str, run: Callable[[list[LayerSpec]], T]) -> T:
    """``run(specs)`` with remembered specs; made again with fresh ones where they are stale (see the NOTE)."""
    specs, remembered = remembered_specs(f, params, td, paths, layer_calls, caller=caller)
    # NOTE [a forward run again draws the same numbers]; under torch.compile nothing is remembered or probed again
    drawn = None if torch.compiler.is_compiling() else RandomState()
    # after a stale run, fresh probes: a measuring one where the specs were remembered, then one that the taps
    # leaving probes alone run in too (NOTE [taps in probes]); each is ``every_tap``
    probes = iter((False, True) if remembered else (True,))
    while True:
        try:
            return run(specs)
        except StaleSpec as stale:
            every_tap = next(probes, None)
            if every_tap is None or drawn is None:
                raise RuntimeError(f"{caller}: {stale}; the model runs differently from one forward to the next on "
                                   "the same inputs, so its layers cannot be attributed") from stale
            drawn.restore()
        specs, _ = remembered_specs(f, params, td, paths, layer_calls, caller=caller, fresh=True, every_tap=every_tap)


def run_counters(paths: Sequence[str], runs: list[int]) -> list[Tap]:
    """Taps counting in ``runs[i]`` the runs of ``paths[i]``'s module, for `check_runs`."""
    if torch.compiler.is_compiling():
        return []
    # (the key given: no capture reads it, and deriving it from the path costs as much as the tap)
    return [Tap(path, "intervene", _counter(runs, i), "output", path) for i, path in enumerate(paths)]


def checked_taps(paths: Sequence[str], layers: Mapping[str, Replace | None], deltas: Sequence[torch.Tensor],
                 specs: Sequence[LayerSpec], act_key: Callable[[int], str], runs: list[int]) -> list[Tap]:
    """Per layer: the perturbation ``replace(act) + delta`` at its run, a capture, and a run counter.

    The perturbation raises `StaleSpec` where the activation does not fit ``delta``;
    ``runs[i]`` counts the runs of layer ``i``'s module, for `check_runs`.
    """
    taps = []
    for i, (path, delta, spec) in enumerate(zip(paths, deltas, specs, strict=True)):
        # (written back into an in-place module's input: every reader of the activation gets the perturbation)
        taps.append(Tap(path, "intervene", _plus(path, layers[path], delta), "output", path, spec.call,
                        writes_back=True))
        taps.append(capture(path, key=act_key(i), call=spec.call))
    return [*taps, *run_counters(paths, runs)]


def check_runs(paths: Sequence[str], specs: Sequence[LayerSpec], runs: Sequence[int]) -> None:
    """Raise `StaleSpec` where a module ran another number of times than in the probe."""
    if torch.compiler.is_compiling():
        return
    for path, spec, n in zip(paths, specs, runs, strict=True):
        if n != spec.runs:
            raise StaleSpec(path, f"{n} runs of the module", f"{spec.runs}")


def _plus(path: str, replace: Replace | None, delta: torch.Tensor) -> Replace:
    def perturbed(act: Any) -> torch.Tensor:
        value = act if replace is None else replace(act)
        if not isinstance(value, torch.Tensor) or value.shape != delta.shape or value.dtype != delta.dtype:
            seen = (f"{type(value).__name__}" if not isinstance(value, torch.Tensor)
                    else f"{list(value.shape)} {value.dtype}")
            raise StaleSpec(path, seen, f"{list(delta.shape)} {delta.dtype}")
        return value + delta

    return perturbed


def _counter(runs: list[int], i: int) -> Replace:
    def count(act: torch.Tensor) -> torch.Tensor:
        runs[i] += 1
        return act

    return count


def _chosen_run(caller: str, path: str, runs: int, wanted: int | None) -> int | None:
    if runs == 0:
        raise ValueError(
            f"{caller}: layer {path!r} never ran in the forward (the module exists, but the model's forward does "
            "not call it); attribute a module that runs"
        )
    if wanted is None:
        if runs > 1:
            raise ValueError(
                f"{caller}: layer {path!r} runs {runs} times in one forward; say which run to attribute with "
                f"layer_calls={{{path!r}: k}} (0 is the first, -1 the last; gradient and activation both come "
                "from that run)"
            )
        return None
    if isinstance(wanted, bool) or not isinstance(wanted, int) or not -runs <= wanted < runs:
        raise ValueError(f"{caller}: layer_calls[{path!r}] must be an int in [{-runs}, {runs}), got {wanted!r}")
    return wanted % runs if runs > 1 else None
