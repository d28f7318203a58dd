"""A planned LRP walk bound once: each link's forward a closure with its constants resolved, returning its pullback."""

# NOTE [a bound walk]
# A planned walk (NOTE [a planned walk]) still asks at every call, for every link, which
# kind it is and which form its rule takes, and builds a record object to pull the
# relevance back. Where no link of the plan is left to the general steps, the plan also
# keeps the walk bound:
# one closure per link, made once, with its op, its adjoint and its rule's constants (the
# epsilon) read off then; a call runs the closures in turn, and each leaves its pullback
# (a closure over what it saw) for the walk back. Pass leaves none: the relevance passes.
# On the benchmarks' MLP a call makes ~250 Python calls where it made ~290.
#
# The pullbacks of the epsilon rule write in place only the tensors they make (the
# stabilised output takes the division, `divide_stabilized`; the adjoint's product the
# input's factor): three tensors of a layer's size fewer per layer (the MLP's ops, hand-written, took 0.75x the
# input gradient so against 0.81x), with the same bits as `stabilize`, the division and
# the product of `records` (tested).
#
# No link of a bound walk writes a tensor (torch's own modules, never in place), so the
# per-link version checks of the records (NOTE [versions on the walk]) would find nothing
# between links. Only a target may write what the pullbacks read (a callable is given the
# output and the inputs), so the bound walk serves an int target alone, whose relevance is
# put in without running any code of the caller's; any other target takes the records.

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..._types import Pullback
from .affine import Affine
from .fused import fused
from .gradient_form import GradientForm
from .max_pool import max_pool_with_indices
from .records import NotAChain, Pooled
from .rules import Epsilon, divide_stabilized
from .walk import Planned

__all__ = ["BoundStep", "bind", "run_bound"]

# (a link's input, its tensors in the params, the pullbacks so far) -> its output; it appends its pullback
BoundStep = Callable[[torch.Tensor, tuple[torch.Tensor, ...], list[Pullback]], torch.Tensor]


def bind(planned: list[Planned]) -> list[BoundStep] | None:
    """Each link of ``planned`` as a closure (NOTE [a bound walk]); ``None`` where a link needs the general steps."""
    steps = []
    for step in planned:
        bound = _bind(step)
        if bound is None:
            return None
        steps.append(bound)
    return steps


def run_bound(steps: list[BoundStep], h: torch.Tensor, tensors: list[tuple[torch.Tensor, ...]],
              backs: list[Pullback]) -> torch.Tensor:
    """The chain's output from ``h`` (under ``no_grad``), each link's pullback (if any) appended to ``backs``."""
    if not (isinstance(h, torch.Tensor) and h.is_floating_point()):
        raise NotAChain  # (what the links make of a float input is float: checked once)
    for step, own in zip(steps, tensors, strict=True):
        h = step(h, own, backs)
    return h


def _bind(step: Planned) -> BoundStep | None:
    kind = step.kind
    if kind == "affine":
        assert step.affine is not None
        if step.form is None:
            return _fused_step(step)
        return _affine_step(step.affine, step.form, step.rule, step.path)
    if kind == "pass":
        assert step.op is not None
        return _pass_step(step.op)
    if kind == "pool":
        assert step.pool is not None
        return _pool_step(step.pool, step.module.__dict__)
    if kind == "reshape":
        return _reshape_step(step.module)
    return None


def _epsilon_of(rule: Any, form: GradientForm) -> float | None:
    """The epsilon of a rule whose divisor is `Epsilon`'s own, as the walk asks it (one input): ``stabilize``."""
    if form.divides and isinstance(rule, Epsilon) and type(rule).output_divisor is Epsilon.output_divisor:
        return rule.epsilon
    return None


def _affine_step(affine: Affine, form: GradientForm, rule: Any, path: str) -> BoundStep:
    """A linear layer or a convolution with a gradient-form rule or none (`records.AffineLocal`'s numbers)."""
    epsilon = _epsilon_of(rule, form)
    # (a linear layer's forward is the op itself, chosen here: `Affine.run` would choose it at every call)
    forward = F.linear if affine.conv is None else affine.run
    scales = form.scales_inputs

    def step(x: torch.Tensor, own: tuple[torch.Tensor, ...], backs: list[Pullback]) -> torch.Tensor:
        weight = own[0]
        bias = own[1] if len(own) > 1 else None
        y = forward(x, weight, bias)
        pullback = affine.pullback(weight, x.shape, y.shape)

        def back(relevance: torch.Tensor) -> torch.Tensor:
            if epsilon is not None:
                share = divide_stabilized(relevance, y, epsilon)
            elif form.share is not None:
                by = form.share(path, 1, y)
                share = relevance / by if form.divides else relevance * by
            else:
                share = relevance
            c = pullback(share)
            return c.mul_(x) if scales else c  # (the adjoint's product has the input's shape)

        backs.append(back)
        return y

    return step


def _fused_step(planned: Planned) -> BoundStep:
    """Fused alpha-beta (NOTE [fused alpha-beta]); an input it does not fit leaves the walk."""
    rule, affine, stacks = planned.rule, planned.affine, planned.stacks
    assert rule is not None and affine is not None

    def step(x: torch.Tensor, own: tuple[torch.Tensor, ...], backs: list[Pullback]) -> torch.Tensor:
        done = fused(rule, affine, x, own[0], own[1] if len(own) > 1 else None, stacks)
        if done is None:
            raise NotAChain  # (the general path's module op says what does not fit)
        backs.append(done[1])
        return done[0]

    return step


def _pass_step(op: Callable[[torch.Tensor], torch.Tensor]) -> BoundStep:
    def step(h: torch.Tensor, _own: tuple[torch.Tensor, ...], _backs: list[Pullback]) -> torch.Tensor:
        return op(h)

    return step


def _pool_step(pool: tuple[int, Callable[..., Any]], state: dict[str, Any]) -> BoundStep:
    """Max pooling: each window's relevance to where its maximum came from (`records.Pooled`)."""
    dims = pool[0]

    def step(h: torch.Tensor, _own: tuple[torch.Tensor, ...], backs: list[Pullback]) -> torch.Tensor:
        shape = h.shape
        out, indices = max_pool_with_indices(pool, h, state)  # NOTE [max pooling in channels-last]
        backs.append(Pooled(shape, indices, dims).back)
        return out

    return step


def _reshape_step(module: torch.nn.Module) -> BoundStep:
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = type(module).forward  # (a reshape's)

    def step(h: torch.Tensor, _own: tuple[torch.Tensor, ...], backs: list[Pullback]) -> torch.Tensor:
        shape = h.shape
        backs.append(lambda relevance: relevance.reshape(shape))
        return forward(module, h)

    return step
