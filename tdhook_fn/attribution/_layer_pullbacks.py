"""One forward of the path points, pulled back from the targets to layers and from layers to the inputs."""

# NOTE [two pullbacks of one forward]
# Conductance needs, at each path point, the target's gradient at a layer (and for a
# neuron, that neuron's gradient with respect to the inputs). Both come from one forward
# that returns the target values and the layers' activations, each with a zero
# perturbation added whose gradient is the target's at the layer (NOTE [layer gradients]).
# Eager and untransformed, the pullbacks are plain `torch.autograd.grad` calls on that
# graph, each walking only its part of it (targets -> layers; layers -> inputs; or
# targets -> inputs and layers, for integrated gradients read at layers while the inputs
# move), once per target, so no ``[T, points, ...]`` stack of gradients is ever held.
# Under a functorch transform, or where the forward reaches a tensor that requires grad
# (NOTE [eager vjp]), one `torch.func.vjp` gives them all, each pullback fed zero
# cotangents on the other outputs.

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from .._functional import Functional, with_copied_inputs
from .._taps import Tap
from .._targets import Target, autograd_off_note
from .._types import NestedKey
from .._vjp import RandomState, any_requires_grad, reaches_other_leaves, untransformed
from ._layer_specs import LayerSpec, StaleSpec, check_runs, checked_taps, run_counters, with_specs
from ._target_layers import check_target_layer_runs, target_layer_taps
from ._target_values import offered_targets

__all__ = ["Pullbacks", "layer_pullbacks"]

Primals = tuple[TensorDictBase, list[torch.Tensor]]
Forward = Callable[..., tuple[TensorDictBase, list[torch.Tensor]]]  # (primals[, kept]) -> (values, acts)
_KEY = "_tdhook_fn_path_layer_"


@dataclass
class Pullbacks:
    """The forward's outputs on the flattened points ``[R, ...]`` and its two pullbacks.

    Attributes:
        values (TensorDict): the target values, batch of the points.
        acts (list[Tensor]): each layer's activation (detached where the pullbacks are autograd's).
        to_layers (Callable): cotangents on ``values`` -> the gradient at each layer.
        to_inputs (Callable): a cotangent on each activation -> gradients of the inputs, by key.
        to_both (Callable): cotangents on ``values`` -> the gradients of the inputs, by key, and at
            each layer.
    """

    values: TensorDictBase
    acts: list[torch.Tensor]
    to_layers: Callable[[TensorDictBase], list[torch.Tensor]]
    to_inputs: Callable[[list[torch.Tensor]], TensorDictBase]
    to_both: Callable[[TensorDictBase], tuple[TensorDictBase, list[torch.Tensor]]]


def layer_pullbacks(f: Functional, params: TensorDictBase, points: TensorDictBase, target: Target,
                    layers: Sequence[str], keys: Sequence[NestedKey], calls: Mapping[str, int],
                    caller: str, *, taps: Sequence[Tap] = (), target_layers: Sequence[str] = ()) -> Pullbacks:
    """Run ``f`` once on ``points`` (flattened) with ``layers`` read and perturbed; see the NOTE.

    ``keys`` are the inputs differentiated (none for layer conductance); ``taps`` further
    taps of the call, after the layers' own; ``target_layers`` paths whose activations the
    target sees, as in `gradients`.
    """
    # (else torch's own error, about version counters, would be the message; Dynamo cannot trace the question)
    if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
        raise ValueError(f"{caller}: the gradients at layers {list(layers)} need autograd{autograd_off_note()}")
    batch = points.batch_size
    flat = points.reshape(-1)
    names = [f"{_KEY}{i}" for i in range(len(layers))]

    def attempt(specs: list[LayerSpec]) -> Pullbacks:
        device = next(iter(flat.values(True, True))).device

        def forward(primals: Primals, kept: list[Any] | None = None) -> tuple[TensorDictBase, list[torch.Tensor]]:
            feed = with_copied_inputs(flat, keys)
            if not primals[0].is_empty():  # under torch.compile an empty one comes back with batch size [0]
                feed.update(primals[0])
            runs, target_runs = [0] * len(layers), [0] * len(target_layers)
            if kept is None:
                own = checked_taps(layers, dict.fromkeys(layers), primals[1], specs, lambda i: names[i], runs)
            else:  # NOTE [activations read without a copy]
                own = [*_kept_sums(layers, primals[1], specs, kept), *run_counters(layers, runs)]
            out = f.with_taps(*own, *target_layer_taps(target_layers, target_runs), *taps)(params, feed)
            check_runs(layers, specs, runs)
            check_target_layer_runs(caller, target_layers, target_runs)
            if kept is not None:
                return offered_targets(f, out, flat, keys, batch, target, target_layers), [act for act, _ in kept]
            acts = [out.get(n) for n in names]
            return offered_targets(f, out.exclude(*names), flat, keys, batch, target, target_layers), acts

        return _pullbacks(forward, flat.select(*keys), specs, device, (params, flat))

    return with_specs(f.with_taps(*taps) if taps else f, params, flat, layers, calls, caller, attempt)


def _pullbacks(forward: Forward, inputs: TensorDictBase, specs: Sequence[LayerSpec], device: torch.device | None,
               constants: tuple[TensorDictBase, ...]) -> Pullbacks:
    if untransformed() and not any_requires_grad(constants, _leaves(inputs)):
        mine = cast(TensorDictBase, inputs.apply(lambda t: t.detach().requires_grad_()))
        # NOTE [a zero that is one number]
        # Each layer's zero perturbation is one 0-d zero expanded to the activation's shape:
        # ``autograd.grad`` gives the gradient at the expanded view as at a full tensor of
        # zeros, and no tensor the size of the activation is allocated and filled for it.
        seeds = [torch.zeros((), dtype=spec.dtype, device=device, requires_grad=True) for spec in specs]
        zeros = [seed.expand(spec.shape) for seed, spec in zip(seeds, specs, strict=True)]
        kept: list[Any] = [None] * len(specs)
        drawn = RandomState()  # NOTE [a forward run again draws the same numbers]
        with torch.enable_grad():
            values, acts = forward((mine, zeros), kept)
            if any(act._version != version for act, version in kept):  # written in place after it was read
                drawn.restore()
                values, acts = forward((mine, zeros))
        if not reaches_other_leaves([*_leaves(values), *acts], [*_leaves(mine), *seeds]):
            return _by_autograd(values, acts, mine, zeros)
        drawn.restore()  # functorch runs the forward again
    deltas = [torch.zeros(spec.shape, dtype=spec.dtype, device=device) for spec in specs]
    return _by_functorch(forward, inputs, deltas)


def _kept_sums(layers: Sequence[str], deltas: Sequence[torch.Tensor], specs: Sequence[LayerSpec],
               kept: list[Any]) -> list[Tap]:
    """Per layer: the perturbation ``act + delta`` at its run, kept in ``kept[i]`` with its version."""
    # NOTE [activations read without a copy]
    # A capture tap stores a copy of the activation, since a later module may write it in
    # place (``ReLU(inplace=True)``). Eager, the pullbacks keep the perturbed activation
    # ``act + delta`` itself (a fresh tensor) with its version counter instead, and run the
    # forward again with captures where a write bumped it: one copy the size of each
    # attributed activation less per call (a few percent of conductance on the CPU).
    def tap(i: int, path: str, delta: torch.Tensor, spec: LayerSpec) -> Tap:
        def perturbed(value: Any) -> torch.Tensor:
            if not isinstance(value, torch.Tensor) or value.shape != delta.shape or value.dtype != delta.dtype:
                seen = (f"{type(value).__name__}" if not isinstance(value, torch.Tensor)
                        else f"{list(value.shape)} {value.dtype}")
                raise StaleSpec(path, seen, f"{list(delta.shape)} {delta.dtype}")
            out = value + delta
            kept[i] = (out, out._version)
            return out

        return Tap(path, "intervene", perturbed, call=spec.call, writes_back=True)  # (as in `checked_taps`)

    return [tap(i, path, delta, spec) for i, (path, delta, spec) in enumerate(zip(layers, deltas, specs, strict=True))]


def _by_autograd(values: TensorDictBase, acts: list[torch.Tensor], mine: TensorDictBase,
                 zeros: list[torch.Tensor]) -> Pullbacks:
    outs = _leaves(values)

    def to_layers(cot: TensorDictBase) -> list[torch.Tensor]:
        cots = [cot.get(key) for key, _ in values.items(True, True)]
        return list(torch.autograd.grad(outs, zeros, cots, retain_graph=True, materialize_grads=True))

    def to_inputs(cots: list[torch.Tensor]) -> TensorDictBase:
        grads = torch.autograd.grad(acts, _leaves(mine), cots, retain_graph=True, materialize_grads=True)
        return _like(mine, grads)

    def to_both(cot: TensorDictBase) -> tuple[TensorDictBase, list[torch.Tensor]]:
        cots = [cot.get(key) for key, _ in values.items(True, True)]
        wrt = _leaves(mine)
        grads = torch.autograd.grad(outs, [*wrt, *zeros], cots, retain_graph=True, materialize_grads=True)
        return _like(mine, grads[: len(wrt)]), list(grads[len(wrt):])

    return Pullbacks(values.detach(), [a.detach() for a in acts], to_layers, to_inputs, to_both)


def _by_functorch(forward: Forward, inputs: TensorDictBase, deltas: list[torch.Tensor]) -> Pullbacks:
    out: Any = torch.func.vjp(forward, (inputs, deltas))
    (values, acts), pullback = out[0], out[1]
    zero_values = values.apply(torch.zeros_like)

    def to_layers(cot: TensorDictBase) -> list[torch.Tensor]:
        return cast(list[torch.Tensor], pullback((cot, [torch.zeros_like(a) for a in acts]))[0][1])

    def to_inputs(cots: list[torch.Tensor]) -> TensorDictBase:
        return cast(TensorDictBase, pullback((zero_values, cots))[0][0])

    def to_both(cot: TensorDictBase) -> tuple[TensorDictBase, list[torch.Tensor]]:
        grads = pullback((cot, [torch.zeros_like(a) for a in acts]))[0]
        return cast(TensorDictBase, grads[0]), cast(list[torch.Tensor], grads[1])

    return Pullbacks(values, acts, to_layers, to_inputs, to_both)


def _leaves(td: TensorDictBase) -> list[torch.Tensor]:
    return [cast(torch.Tensor, v) for v in td.values(True, True)]


def _like(td: TensorDictBase, tensors: Any) -> TensorDict:
    out = TensorDict({}, batch_size=td.batch_size)
    for (key, _), t in zip(td.items(True, True), tensors, strict=True):
        out.set(key, t)
    return out
