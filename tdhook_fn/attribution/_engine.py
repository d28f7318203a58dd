"""The one mechanism behind every gradient method: a forward, a VJP, and what is put in at the targets (ones, one
one-hot per target, or the caller's cotangents) with the pullbacks run from it."""

# NOTE [attribution engine]
# ``gradients`` runs ``f`` once under a VJP (``torch.func.vjp``, or plain autograd where that
# is exact: NOTE [eager vjp]) with respect to the attributed
# inputs and to a zero perturbation of each attributed layer (NOTE [layer gradients]).
# The target callable reads the outputs (plus activations of ``target_layers`` under their
# path, plus the inputs' extra keys such as labels). Then:
#
# - summed targets: one pullback of ``ones``;
# - ``per_target=True``: the pullback of one-hot cotangents on the targets' last
#   dimension, so T maps cost one forward and T backwards (no T forwards, as a loop of
#   attributions would). On accelerators the pullback is ``vmap``-ed over the one-hots;
#   on the CPU it is called once per target, because ``vmap`` of a convolution's
#   backward is about twice as slow there as the same backwards one by one (measured on
#   torch 2.13: 950 vs 450 ms for ten maps of a small CNN; equal for MLPs). Both give the
#   same maps up to a few ulps (a vmapped backward runs batched kernels, which may round
#   differently).
#
# ``passes`` pull back from the one forward more than once, each pass to some of the
# attributed tensors after its own setup: a rule whose backward a pass switches (guided
# Grad-CAM: the layer's gradient by the plain backward, then the inputs' by guided
# backprop's), where two calls would run the forward twice. Each pass pulls back to its
# keys only (a pass to a layer runs no backward below it: NOTE [eager vjp]); the graph is
# kept until the last.
#
# TensorDict batch dims are flattened to exactly one before the model runs (models expect
# one batch dim: ``[]`` becomes ``[1]``, ``[2, 3]`` becomes ``[6]``) and restored after, so
# methods accept any batch size, and work per sample under ``vmap`` even for models that
# cannot take an unbatched sample (``nn.Flatten``).

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from .._functional import Functional, fresh_tensordict, one_key_as_list, with_copied_inputs
from .._params import leaf_keys, leaves
from .._pool_layout import FAST_POOLING
from .._taps import Tap, map_grad
from .._targets import Target, as_target, autograd_off_note
from .._types import GradFn, NestedKey, Replace
from .._vjp import vjp
from ._backward_passes import BackwardPass, one_hots, pull_each, pull_passes
from ._gradient_chain import plain_gradients
from ._inputs import check_call
from ._layer_specs import LayerSpec, check_runs, checked_taps, with_specs
from ._replaced_derivatives import as_values, refuse_level_zero_graph, replaces_any
from ._target_layers import check_target_layer_runs, target_layer_keys, target_layer_taps, target_layer_values

__all__ = [
    "Cotangents",
    "Gradients",
    "as_functional",
    "check_per_target_or_cotangents",
    "extras_of",
    "flat_inputs",
    "grad_taps",
    "gradients",
    "input_keys_of",
    "offer",
    "per_key",
    "scaled",
    "seed_cotangents",
    "unflatten",
]

_ACT = "_tdhook_fn_activation_"


@dataclass
class Gradients:
    """What `gradients` returns.

    Attributes:
        grads (TensorDict): by input key and layer path; batch ``[*B]``, or ``[T, *B]``
            with ``per_target``.
        activations (TensorDict): activations of the attributed layers, by path, ``[*B]``.
        targets (TensorDict | None): the target values, ``[*B]`` (plus a last ``T`` dim for
            several targets); ``None`` where the chain walk made the maps (it reads no target).
    """

    grads: TensorDict
    activations: TensorDict
    targets: TensorDictBase | None


def grad_taps(grad_fns: Mapping[str, GradFn] | None, taps: Sequence[Tap]) -> list[Tap]:
    """tdhook's ``output_grad_callbacks`` as taps, followed by any extra taps."""
    if not grad_fns:
        return list(taps)
    return [map_grad(path, fn) for path, fn in grad_fns.items()] + list(taps)


def input_keys_of(f: Callable[..., Any], inputs: TensorDictBase,
                  given: NestedKey | Sequence[NestedKey] | None = None) -> tuple[NestedKey, ...]:
    """The keys to attribute: ``given`` (a str is one key, as in ``functional``), else ``f.in_keys``
    for a Functional, else every float leaf."""
    if given is not None:
        return tuple(one_key_as_list(given))
    keys = getattr(f, "in_keys", None)
    if keys is not None:
        return tuple(keys)
    return tuple(k for k, v in inputs.items(True, True) if isinstance(v, torch.Tensor) and v.is_floating_point())


def per_key(fn: Callable[..., torch.Tensor], td: TensorDictBase, *others: TensorDictBase) -> TensorDict:
    """``fn(td[k], other[k], ...)`` for every leaf ``k`` of ``td``; keeps ``td``'s batch size."""
    out = TensorDict({}, batch_size=td.batch_size)
    for key, value in td.items(True, True):
        out.set(key, fn(value, *(o.get(key) for o in others)))
    return out


def scaled(grads: TensorDict, factors: Mapping[Any, torch.Tensor]) -> TensorDict:
    """``grads`` with each key in ``factors`` multiplied by it (input x gradient and kin).

    ``factors`` are shaped like one map (batch ``[*B]``); a leading target dim of
    ``grads`` broadcasts. Keys without a factor are left as they are.
    """
    out = grads.clone(False)
    for key, factor in factors.items():
        grad = grads.get(key)
        out.set(key, grad * factor.reshape((*[1] * (grad.dim() - factor.dim()), *factor.shape)))
    return out


def unflatten(t: torch.Tensor, lead: int, batch: torch.Size) -> torch.Tensor:
    """Restore batch dims flattened to one, after ``lead`` leading dims."""
    return t.reshape((*t.shape[:lead], *batch, *t.shape[lead + 1 :]))  # a tuple: the shape may be ()


def flat_inputs(inputs: TensorDictBase) -> TensorDictBase:
    """``inputs`` with their batch ``[*B]`` flattened to the one dim models expect, ``[N]`` (as they are where it is
    one dim already: a reshape to the same batch builds a new TensorDict)."""
    return inputs if inputs.batch_dims == 1 else inputs.reshape(-1)


def _check_targets(values: Any) -> TensorDictBase:
    if not isinstance(values, TensorDictBase):
        raise TypeError(f"a target must return a TensorDict or a tensor, got {type(values).__name__}")
    checked: TensorDictBase = values
    entries: Any = None
    if type(values) is TensorDict:  # its own dict where it holds tensors only (`items` costs calls, on every call)
        own = values.__dict__["_tensordict"]
        entries = own.items()
        for value in own.values():
            if type(value) is not torch.Tensor:
                entries = None
                break
    for key, value in values.items(True, True) if entries is None else entries:
        if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.requires_grad):
            raise ValueError(
                f"target {key!r} does not depend differentiably on the attributed inputs or layers"
                f"{autograd_off_note()}"
            )
    return checked


def as_functional(f: Callable[..., Any]) -> Functional:
    """``f``, which layers and taps need to be a `Functional`."""
    if isinstance(f, Functional):
        return f
    raise _untappable()


def _untappable() -> TypeError:
    return TypeError("layer attribution and taps need f to be a tdhook_fn.Functional (see tdhook_fn.functional)")


def extras_of(f: Callable[..., Any], flat: TensorDictBase, input_keys: Sequence[NestedKey]) -> TensorDictBase | None:
    """Inputs the model does not read (labels, weights): offered to the target; None where there are none."""
    read = {*input_keys, *getattr(f, "in_keys", ())}
    # (a loop, not a generator: one Python call less per key; a plain TensorDict's own dict: on every call)
    for key in flat.__dict__["_tensordict"] if type(flat) is TensorDict else flat.keys():
        if key not in read:
            return flat.exclude(*read)
    return None  # (the common case: no TensorDict built)


def offer(out: TensorDictBase, private: Sequence[str], seen: TensorDict | None, extras: TensorDictBase | None,
          batch: torch.Size, use_outputs: bool, target: Target, check: bool) -> TensorDictBase:
    """Target values from the outputs, the target layers' activations (``seen``; None: none) and the extras."""
    if use_outputs and not private and seen is None and extras is None:
        offered = out  # nothing to add or take away: read as it is (this runs on every call)
        if callable(target):
            select = target  # (a callable is its own target, as `as_target` returns it: no names to list for it)
        else:
            names: list[Any] | None = None  # a plain TensorDict's names where it holds tensors only (as `leaf_keys`)
            if type(out) is TensorDict:
                names = []
                for name, value in out.__dict__["_tensordict"].items():  # (a loop inline: on every call)
                    if type(value) is not torch.Tensor:
                        names = None
                        break
                    names.append(name)
            select = as_target(target, outputs=leaf_keys(out) if names is None else names)
    else:
        offered = out.exclude(*private) if use_outputs else TensorDict({}, batch_size=out.batch_size)
        select = target if callable(target) else as_target(target, outputs=list(offered.keys(True, True)))
        if seen is not None:
            offered.update(seen)
        for key, value in (extras.items(True, True) if extras is not None else ()):
            if key not in offered.keys(True, True):
                offered.set(key, value)
    values = _as_target_values(select(offered if offered.batch_size == batch else offered.reshape(batch)), batch)
    return _check_targets(values) if check else values


def _as_target_values(values: Any, batch: torch.Size) -> Any:
    """The target values as a TensorDict of batch ``batch`` (a plain tensor as the one key ``"target"``).

    Every value must have the batch as its leading dims, in a TensorDict as in a plain
    tensor: values for fewer samples (``output[:2]``) or for the path points of integrated
    gradients read as samples would give maps of zeros, or of the wrong samples, silently.
    A TensorDict built with another batch size but holding per-sample values is re-batched.
    """
    if isinstance(values, torch.Tensor):
        _check_leading_batch("a tensor", values, batch)
        return fresh_tensordict({"target": values}, batch)
    if not isinstance(values, TensorDictBase) or values.batch_size == batch:
        return values
    out = TensorDict({}, batch_size=batch)
    for key, value in values.items(True, True):
        if isinstance(value, torch.Tensor):
            _check_leading_batch(f"a TensorDict (batch size {list(values.batch_size)}) holding {key!r}", value, batch)
        out.set(key, value)
    return out


def _check_leading_batch(what: str, value: torch.Tensor, batch: torch.Size) -> None:
    if value.shape[: len(batch)] != batch:
        raise ValueError(
            f"target returned {what} of shape {list(value.shape)}; its leading dims must be the batch "
            f"{list(batch)} of the outputs it is given (one value per sample, with a last dim for several targets: "
            "build it from every sample, e.g. TensorDict(key=out[..., i], batch_size=out.batch_size))"
        )


def gradients(
    f: Callable[[TensorDictBase, TensorDictBase], TensorDictBase],
    params: TensorDictBase,
    inputs: TensorDictBase,
    target: Target,
    *,
    input_keys: Sequence[NestedKey],
    layers: Mapping[str, Replace | None] | None = None,
    target_layers: Sequence[str] = (),
    taps: Sequence[Tap] = (),
    per_target: bool = False,
    cotangents: Cotangents | None = None,
    use_outputs: bool = True,
    layer_calls: Mapping[str, int] | None = None,
    caller: str = "attribution",
    checked: bool = False,
    passes: Sequence[BackwardPass] = (),
) -> Gradients:
    """Gradients of ``target(f(params, inputs))``; see NOTE [attribution engine].

    ``layers`` maps a path to ``None`` (differentiate its activation) or to a function
    whose result replaces the activation before the perturbation is added (layer
    integrated gradients interpolates there). An int or tuple ``target`` indexes the
    single output of ``f`` (extra input keys and target layers do not count).
    ``layer_calls`` picks the run of a layer whose module runs more than once
    (NOTE [modules that run more than once]); ``caller``, the public function's name, starts
    its errors. ``checked``: the caller ran `check_call` on its own arguments and checked the
    attributed keys (methods calling this once per chunk of points or copies), and read its
    inputs with `as_values` where a tap replaces a derivative, so neither is run again.
    ``passes``: several pullbacks from the one forward, each giving the gradients of
    its keys (every input key and layer in one of them); default, one giving all.
    """
    if not checked:
        check_call(caller, f, params, inputs, input_keys, target)
    check_per_target_or_cotangents(caller, per_target, cotangents)
    walked = None if layers or target_layers or taps or passes or layer_calls or callable(target) or not use_outputs \
        or cotangents is not None else plain_gradients(f, params, inputs, target, input_keys, per_target)
    if walked is not None:  # the input maps alone, on a chain: by the walk (NOTE [plain gradients on a chain])
        return Gradients(walked, fresh_tensordict({}, inputs.batch_size), None)
    replaced = bool(taps) and replaces_any(taps)  # the maps are values (asked only where there are taps)
    if replaced and not checked:  # NOTE [replaced derivatives are not differentiated] (checked: the caller did)
        inputs = as_values(caller, params, inputs)
    layers = dict(layers or {})
    tappable = f if isinstance(f, Functional) else None
    if tappable is None and (layers or target_layers or taps):
        raise _untappable()
    batch = inputs.batch_size
    flat = flat_inputs(inputs)
    paths = list(layers)
    extras = extras_of(f, flat, input_keys)
    private: list[str] = []  # (built where there are layers: the comprehensions cost calls on every call)
    if paths or target_layers:
        private = [f"{_ACT}{i}" for i in range(len(paths))] + target_layer_keys(target_layers)
    attributed = tuple(dict.fromkeys(input_keys))  # (each key once: its tensor is one primal)
    n_inputs = len(attributed)
    # the inputs are the attributed tensors alone (the common call): the model's inputs are then the primals, built
    # unchecked (NOTE [unchecked TensorDicts]), not a copy written over (a loop inline: this runs on every call)
    held: Any = flat.__dict__.get("_tensordict") if type(flat) is TensorDict else None  # (its own dict, as `leaves`)
    only_attributed = isinstance(held, dict) and len(held) == n_inputs
    for key in attributed if only_attributed else ():
        if type(key) is not str or not isinstance(held.get(key), torch.Tensor):
            only_attributed = False

    def attempt(specs: list[LayerSpec]) -> tuple[Any, Any, Any]:
        deltas: list[torch.Tensor] = []
        if specs:
            device = next(iter(flat.values(True, True))).device if not flat.is_empty() else None
            deltas = [torch.zeros(spec.shape, dtype=spec.dtype, device=device) for spec in specs]

        def forward(diff: list[torch.Tensor]) -> tuple[TensorDictBase, list[torch.Tensor]]:
            if only_attributed:  # the primals are all the model reads: no copy to write them in
                feed: TensorDictBase = fresh_tensordict(dict(zip(attributed, diff, strict=False)), flat.batch_size,
                                                        flat.device)
            else:
                feed = with_copied_inputs(flat, attributed)
                for key, value in zip(attributed, diff, strict=False):  # (the inputs' primals first, then the deltas)
                    feed.set(key, value)
            tapped: Any = f
            runs, target_runs = [0] * len(paths), [0] * len(target_layers)
            if tappable is not None and (paths or target_layers or taps):
                tapped = tappable.with_taps(*checked_taps(paths, layers, diff[n_inputs:], specs, _act_key, runs),
                                            *target_layer_taps(target_layers, target_runs), *taps)
            out = tapped(params, feed)
            if not paths and not target_layers:  # (input maps only: nothing to count or read, on every call)
                return offer(out, private, None, extras, batch, use_outputs, target, check=True), []
            check_runs(paths, specs, runs)
            check_target_layer_runs(caller, target_layers, target_runs)
            acts = [out.get(_act_key(i)) for i in range(len(paths))]
            seen = target_layer_values(out, target_layers)
            return offer(out, private, seen, extras, batch, use_outputs, target, check=True), acts

        # one flat list, the attributed inputs' tensors then the deltas: what `vjp` flattens and rebuilds in one
        # step (a TensorDict or nested containers cost a step each, on every call)
        primals: list[torch.Tensor] = []
        for key in attributed:  # (read from its own dict where that holds them all: `get` costs a few calls)
            primals.append(held[key] if only_attributed else flat.get(key))
        primals += deltas
        # (the inputs are constants where they hold more than the primals, which `vjp` looks at anyway)
        result: tuple[Any, Any, Any] = vjp(forward, primals, constants=(params,) if only_attributed else (params, flat))
        return result

    # the shadows that pool in channels-last (NOTE [shadow max pooling]; `fast_pooling`'s block inline: its two
    # calls would run on every call)
    fast = None if torch.compiler.is_compiling() else FAST_POOLING.set(True)
    try:
        if tappable is None or not paths:
            values, pullback, acts = attempt([])
        else:
            values, pullback, acts = with_specs(tappable.with_taps(*taps), params, flat, paths, layer_calls, caller,
                                                attempt)
    finally:
        if fast is not None:
            FAST_POOLING.reset(fast)
    cot, lead = seed_cotangents(values, per_target, cotangents)
    if passes:
        pulled = pull_passes(pullback, cot, lead, passes, (*attributed, *paths))
    else:  # one pullback: the graph is freed as it goes (NOTE [eager vjp])
        pulled = pull_each(pullback, cot) if lead else pullback(cot, retain_graph=False)[0]
    one_dim = inputs.batch_dims == 1  # (the model's batch: nothing to restore)
    maps: dict[Any, Any] = {}
    for key, value in zip((*attributed, *paths), pulled, strict=True):  # (the inputs' primals, then the layers')
        maps[key] = value if one_dim else unflatten(value, lead, batch)
    grads = fresh_tensordict(maps, torch.Size([*cot.batch_size[:1], *batch]) if lead else batch)
    if replaced:
        refuse_level_zero_graph(caller, grads)
    activations = fresh_tensordict({}, batch)
    for path, value in zip(paths, acts, strict=True):
        activations.set(path, value if one_dim else unflatten(value, 0, batch))
    return Gradients(grads, activations, values)


def _act_key(i: int) -> str:
    return f"{_ACT}{i}"


# -- what is put in at the targets, and the pullbacks run from it ----------------------------------------------------

Cotangents = Callable[[TensorDictBase], TensorDictBase]


def check_per_target_or_cotangents(caller: str, per_target: bool, cotangents: Cotangents | None) -> None:
    """``per_target`` and ``cotangents`` both say what is put in at the targets: one of them."""
    if per_target and cotangents is not None:
        raise ValueError(f"{caller}: per_target and cotangents exclude each other (cotangents say what is put in at "
                         "the targets, per_target puts in one one-hot per target); give one of them")


def seed_cotangents(values: TensorDictBase, per_target: bool, cotangents: Cotangents | None,
                    ) -> tuple[TensorDictBase, int]:
    """What is put in at the target values, and its number of leading (target) dims.

    ``cotangents(values)``; or one-hots ``[T, *B, T]`` with ``per_target``; or ones.
    """
    if cotangents is not None:
        cot = cotangents(values)
        if not isinstance(cot, TensorDictBase):
            raise TypeError(f"cotangents must return a TensorDict, got {type(cot).__name__}")
        return cot, 0
    if per_target:
        return one_hots(values), 1
    return _ones_like(values), 0


def _ones_like(values: TensorDictBase) -> TensorDictBase:
    """``values.apply(torch.ones_like)``, built directly for a plain TensorDict (``apply`` costs more)."""
    if type(values) is not TensorDict:
        return cast(TensorDictBase, values.apply(torch.ones_like))
    ones: dict[Any, Any] = {}
    for name, value in values.__dict__["_tensordict"].items():  # its own entries, read as `leaves` reads them
        if type(value) is not torch.Tensor:  # a nested TensorDict (or a tensor subclass): by key, levels made by set
            out = values.empty(recurse=True)
            for key, leaf in leaves(values).items():
                out.set(key, torch.ones_like(leaf))
            return out
        ones[name] = torch.ones_like(value)
    return fresh_tensordict(ones, values.batch_size, values.device)  # (shaped as the values)
