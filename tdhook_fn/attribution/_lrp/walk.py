"""The LRP chain walk from the params directly: each link planned once, run with the fewest Python steps."""

# NOTE [a planned walk]
# On the benchmarks' models the walk's numbers cost less than a plain gradient; what made
# lrp 1.6x one was Python: ~900 calls per call (rules resolved, kinds found, records
# built, checks repeated). The walk's plan (NOTE [plans per model]) holds, per link, what
# the forward needs: how it runs, its rule's scaling, the keys of its tensors in the
# params. A call then checks the params against the links' slots (keys, shapes: the only
# per-call facts), runs each link's op and leaves a closure that pulls relevance back. The
# hot kinds run inline here (linear layers and convolutions with a gradient-form rule or
# no rule, fused z+/alpha-beta, Pass on torch's activations, max pooling, reshapes); any
# other link is run by the general steps of `chain`, with the same numbers.

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..._params import Key
from .affine import Affine
from .fused import fused
from .max_pool import max_pool_with_indices
from .records import NotAChain
from .rules import AlphaBeta, Rule

__all__ = ["ACTIVATION_OPS", "Back", "Planned", "own_values", "plan_affine", "run_planned"]

Back = Callable[[torch.Tensor], torch.Tensor]  # the relevance at a link's output -> at its input

# torch's activations whose forward is this one op (not in place): Pass runs the op directly
ACTIVATION_OPS: dict[type[torch.nn.Module], Callable[[torch.Tensor], torch.Tensor]] = {
    torch.nn.ReLU: torch.relu, torch.nn.Tanh: torch.tanh, torch.nn.Sigmoid: torch.sigmoid}


@dataclass(frozen=True)
class Planned:
    """One link as the walk from the params runs it.

    ``kind``: ``"affine"``, ``"pass"``, ``"pool"``, ``"reshape"``; ``"general"``: by the
    general steps. ``slots``: ``(slot, key)`` of each of its tensors in the params;
    ``share``: the rule's output divisor (``divides``) or factor, for a gradient-form rule,
    asked in the backward (fewer tensors alive at once);
    ``op``: a Pass activation's forward.
    """

    kind: str
    link: tuple[str, torch.nn.Module]
    path: str
    rule: Rule | None
    slots: tuple[tuple[str, Key], ...] = ()
    affine: Affine | None = None
    share: Callable[..., torch.Tensor] | None = None
    divides: bool = False
    scales: bool = False
    fuses: bool = False
    op: Callable[[torch.Tensor], torch.Tensor] | None = None
    pool: tuple[int, Callable[..., Any]] | None = None


def plan_affine(link: tuple[str, torch.nn.Module], path: str, rule: Rule | None, affine: Affine,
                slots: tuple[tuple[str, Key], ...], share: Callable[..., torch.Tensor] | None,
                divides: bool) -> Planned:
    """A linear layer or a convolution, with a gradient-form rule (or none), or fused alpha-beta."""
    if type(rule) is AlphaBeta and affine.groups == 1:
        return Planned("affine", link, path, rule, slots, affine, fuses=True)
    scales = bool(getattr(rule, "scales_inputs", False))
    return Planned("affine", link, path, rule, slots, affine, share, divides, scales)


def own_values(values: Mapping[Key, Any], planned: list[Planned]) -> list[tuple[torch.Tensor, ...]] | None:
    """Each link's tensors from the params' ``values``, in slot order; ``None`` where they do not fit the model.

    The params must hold exactly the links' tensors, each in the shape of the model's own
    (a ``.data`` assignment may have changed that since the plan: checked here, per call).
    """
    out: list[tuple[torch.Tensor, ...]] = []
    used = 0
    for step in planned:
        if not step.slots:
            out.append(())
            continue
        own = step.link[1].__dict__["_parameters"]
        tensors = []
        for slot, key in step.slots:
            value, model_tensor = values.get(key), own[slot]
            if not isinstance(value, torch.Tensor) or model_tensor is None or value.shape != model_tensor.shape:
                return None
            tensors.append(value)
        used += len(tensors)
        out.append(tuple(tensors))
    return out if used == len(values) else None


def _affine(step: Planned, x: torch.Tensor, tensors: tuple[torch.Tensor, ...],
            backs: list[Back]) -> torch.Tensor | None:
    """A linear layer or a convolution; ``None`` where fused alpha-beta does not fit the input (the general steps')."""
    affine, rule = step.affine, step.rule
    assert affine is not None
    weight, bias = tensors[0], (tensors[1] if len(tensors) > 1 else None)
    if step.fuses:
        assert rule is not None
        done = fused(rule, affine, x, weight, bias)
        if done is None:
            return None
        y, pull = done
        versions = (x._version, y._version)

        def back_fused(relevance: torch.Tensor) -> torch.Tensor:
            if (x._version, y._version) != versions:
                raise NotAChain
            return pull(relevance)

        backs.append(back_fused)
        return y
    y = affine.run(x, weight, bias)
    adjoint, version, shape = affine.adjoint(weight, fast=True), (x._version, y._version), x.shape

    def back(relevance: torch.Tensor) -> torch.Tensor:
        if (x._version, y._version) != version:
            raise NotAChain
        if step.share is not None:  # (asked here, not in the forward: fewer tensors alive at once)
            by = step.share(step.path, 1, y)
            relevance = relevance / by if step.divides else relevance * by
        c = adjoint(relevance, shape)
        return x * c if step.scales else c

    backs.append(back)
    return y


def _pooled(step: Planned, h: torch.Tensor, backs: list[Back]) -> torch.Tensor:
    assert step.pool is not None
    dims, pool = step.pool
    out, indices = max_pool_with_indices(pool, h, step.link[1].__dict__)  # NOTE [max pooling in channels-last]
    shape = h.shape

    def back(relevance: torch.Tensor) -> torch.Tensor:
        plane = relevance.new_zeros(shape).flatten(-dims)
        return plane.scatter_add_(-1, indices.flatten(-dims), relevance.flatten(-dims)).view(shape)

    backs.append(back)
    return out


def run_planned(planned: list[Planned], h: torch.Tensor, tensors: list[tuple[torch.Tensor, ...]], backs: list[Back],
                general: Callable[[Planned, torch.Tensor, tuple[torch.Tensor, ...]], tuple[torch.Tensor, Back]],
                ) -> torch.Tensor:
    """The chain's output from ``h`` (under ``no_grad``), each link's pullback appended to ``backs``."""
    for step, own in zip(planned, tensors, strict=True):
        if not (isinstance(h, torch.Tensor) and h.is_floating_point()):
            raise NotAChain
        kind = step.kind
        if kind == "affine":
            y = _affine(step, h.detach() if h.requires_grad else h, own, backs)  # (an op saved where it can be)
            if y is None:
                y, back = general(step, h, own)
                backs.append(back)
            h = y
        elif kind == "pass":
            assert step.op is not None
            h = step.op(h)
            backs.append(_passed(h))
        elif kind == "pool":
            h = _pooled(step, h, backs)
        elif kind == "reshape":
            shape = h.shape
            h = type(step.link[1]).forward(step.link[1], h)
            backs.append(lambda relevance, shape=shape: relevance.reshape(shape))  # type: ignore[misc]
        else:
            h, back = general(step, h, own)
            backs.append(back)
    return h


def _passed(y: torch.Tensor) -> Back:
    """Pass: the relevance as it is, unless something wrote the output in place since (the taps differ then)."""
    version = y._version

    def back(relevance: torch.Tensor) -> torch.Tensor:
        if y._version != version:
            raise NotAChain
        return relevance

    return back
