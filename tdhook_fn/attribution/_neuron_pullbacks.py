"""One forward, two pullbacks: from the targets to a layer, and from that layer to the inputs.

# NOTE [two pullbacks of one forward]
Neuron conductance multiplies, at each path point, the target's gradient at a neuron by
the neuron's gradient with respect to the inputs. Both come from one forward that
returns the target values and the layer's activation (with a zero perturbation added,
whose gradient is the target's at the layer: NOTE [layer gradients]). Eager and
untransformed, the two are plain `torch.autograd.grad` calls on that graph, each walking
only its part of it (targets -> layer; layer -> inputs). Under a functorch transform, or
where the forward reaches a tensor that requires grad (NOTE [eager vjp]), one
`torch.func.vjp` gives both, each pullback fed a zero cotangent on the other output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from .._vjp import any_requires_grad, reaches_other_leaves, untransformed

__all__ = ["Pullbacks", "pullbacks"]

Forward = Callable[[tuple[TensorDictBase, torch.Tensor]], tuple[TensorDictBase, torch.Tensor]]


@dataclass
class Pullbacks:
    """The forward's outputs and its two pullbacks.

    Attributes:
        values (TensorDict): the target values.
        act (Tensor): the layer's activation (detached where the pullbacks are autograd's).
        to_layer (Callable): cotangents on ``values`` -> gradient at the layer.
        to_inputs (Callable): cotangent on ``act`` -> gradients of the inputs, by key.
    """

    values: TensorDictBase
    act: torch.Tensor
    to_layer: Callable[[TensorDictBase], torch.Tensor]
    to_inputs: Callable[[torch.Tensor], TensorDictBase]


def pullbacks(forward: Forward, inputs: TensorDictBase, delta: torch.Tensor, constants: tuple[TensorDictBase, ...],
              ) -> Pullbacks:
    """Run ``forward((inputs, delta))`` once; see NOTE [two pullbacks of one forward]."""
    if untransformed() and not any_requires_grad(constants, [delta, *_leaves(inputs)]):
        mine = cast(TensorDictBase, inputs.apply(lambda t: t.detach().requires_grad_()))
        zero = delta.detach().requires_grad_()
        with torch.enable_grad():
            values, act = forward((mine, zero))
        leaves = [*_leaves(mine), zero]
        if not reaches_other_leaves([*_leaves(values), act], leaves):
            return _by_autograd(values, act, mine, zero)
    return _by_functorch(forward, inputs, delta)


def _by_autograd(values: TensorDictBase, act: torch.Tensor, mine: TensorDictBase, zero: torch.Tensor) -> Pullbacks:
    outs = _leaves(values)

    def to_layer(cot: TensorDictBase) -> torch.Tensor:
        cots = [cot.get(key) for key, _ in values.items(True, True)]
        (grad,) = torch.autograd.grad(outs, [zero], cots, retain_graph=True, materialize_grads=True)
        return grad

    def to_inputs(cot: torch.Tensor) -> TensorDictBase:
        grads = torch.autograd.grad([act], _leaves(mine), [cot], retain_graph=True, materialize_grads=True)
        return _like(mine, grads)

    return Pullbacks(values.detach(), act.detach(), to_layer, to_inputs)


def _by_functorch(forward: Forward, inputs: TensorDictBase, delta: torch.Tensor) -> Pullbacks:
    out: Any = torch.func.vjp(forward, (inputs, delta))
    (values, act), pullback = out[0], out[1]
    zero_values = values.apply(torch.zeros_like)

    def to_layer(cot: TensorDictBase) -> torch.Tensor:
        return cast(torch.Tensor, pullback((cot, torch.zeros_like(act)))[0][1])

    def to_inputs(cot: torch.Tensor) -> TensorDictBase:
        return cast(TensorDictBase, pullback((zero_values, cot))[0][0])

    return Pullbacks(values, act, to_layer, to_inputs)


def _leaves(td: TensorDictBase) -> list[torch.Tensor]:
    return [cast(torch.Tensor, v) for v in td.values(True, True)]


def _like(td: TensorDictBase, tensors: Any) -> TensorDict:
    out = TensorDict({}, batch_size=td.batch_size)
    for (key, _), t in zip(td.items(True, True), tensors, strict=True):
        out.set(key, t)
    return out
