"""The LRP chain walk from the params directly: each link planned once, run with the fewest Python steps."""

# NOTE [a planned walk]
# On the benchmarks' models the walk's numbers cost less than a plain gradient; what made
# lrp 1.6x one was Python: ~900 calls per call (rules resolved, kinds found, records
# built, checks repeated). The walk's plan (NOTE [plans per model]) holds, per link, what
# the forward needs: how it runs, its rule's scaling, the keys of its tensors in the
# params. A call then checks the params against the links' slots (keys, shapes: the only
# per-call facts), runs each link's op and leaves the record that pulls relevance back
# (`records`, as the general steps do). The hot kinds run inline here (linear layers and
# convolutions with a gradient-form rule or no rule, fused z+/alpha-beta, Pass on torch's
# activations, max pooling, reshapes); any other link is run by the general steps of
# `steps`, with the same numbers. Where no link needs those, an int target takes the
# walk bound once instead (NOTE [a bound walk]): the same ops with fewer Python calls.

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..._params import Key
from ..._types import Pullback
from .affine import Affine
from .gradient_form import GradientForm
from .max_pool import max_pool_with_indices
from .records import NotAChain, Passed, Pooled, Reshaped, affine_record
from .rules import Rule
from .stack_cache import StackCache

__all__ = ["ACTIVATION_OPS", "RESHAPES", "Planned", "Slotted", "own_values", "run_planned", "slots_of"]

# torch's activations whose forward is this one op (not in place): Pass runs the op directly
ACTIVATION_OPS: dict[type[torch.nn.Module], Callable[[torch.Tensor], torch.Tensor]] = {
    torch.nn.ReLU: torch.relu, torch.nn.Tanh: torch.tanh, torch.nn.Sigmoid: torch.sigmoid}
# torch's modules whose forward is a reshape of their input (their relevance or gradient: reshaped back)
RESHAPES = (torch.nn.Flatten, torch.nn.Unflatten, torch.nn.Identity)


@dataclass(frozen=True)
class Planned:
    """One link as the walk from the params runs it.

    ``kind``: ``"affine"``, ``"pass"``, ``"pool"``, ``"reshape"``; ``"general"``: by the
    general steps. ``slots``: ``(slot, key)`` of each of its tensors in the params;
    ``form``: an affine link's gradient-form rule (``None``: fused alpha-beta, its stacked
    weights kept in ``stacks``); ``op``: a Pass activation's forward.
    """

    kind: str
    link: tuple[str, torch.nn.Module]
    path: str
    rule: Rule | None
    slots: tuple[tuple[str, Key], ...] = ()
    affine: Affine | None = None
    form: GradientForm | None = None
    op: Callable[[torch.Tensor], torch.Tensor] | None = None
    pool: tuple[int, Callable[..., Any]] | None = None
    stacks: StackCache | None = None  # a fused link's stacked weights of earlier calls (NOTE [stacked weights kept])

    @property
    def module(self) -> torch.nn.Module:
        return self.link[1]


class Slotted(Protocol):
    """A link whose tensors the params hold: its module, and ``(slot, key)`` of each tensor in the params."""

    @property
    def module(self) -> torch.nn.Module: ...

    @property
    def slots(self) -> tuple[tuple[str, Key], ...]: ...


def slots_of(name: str, module: torch.nn.Module) -> tuple[tuple[str, Key], ...]:
    """``(slot, key)`` of each parameter of the chain's module ``name`` (dotted) in the params."""
    return tuple((slot, (*name.split("."), slot)) for slot, t in module.__dict__["_parameters"].items()
                 if t is not None)


def own_values(values: Mapping[Key, Any], links: Sequence[Slotted], *, frozen: bool = False,
               ) -> list[tuple[torch.Tensor, ...]] | None:
    """Each link's tensors from the params' ``values``, in slot order; ``None`` where they do not fit the model.

    The params must hold exactly the links' tensors, each in the shape of the
    model's own (a ``.data`` assignment may have changed that since the plan: checked here,
    per call); with ``frozen``, none that requires grad.
    """
    out: list[tuple[torch.Tensor, ...]] = []
    used = 0
    for link in links:
        if not link.slots:
            out.append(())
            continue
        own = link.module.__dict__["_parameters"]
        tensors = []
        for slot, key in link.slots:
            value, model_tensor = values.get(key), own[slot]
            if not isinstance(value, torch.Tensor) or model_tensor is None or value.shape != model_tensor.shape \
                    or (frozen and value.requires_grad):
                return None
            tensors.append(value)
        used += len(tensors)
        out.append(tuple(tensors))
    return out if used == len(values) else None


def run_planned(planned: list[Planned], h: torch.Tensor, tensors: list[tuple[torch.Tensor, ...]], backs: list[Pullback],
                general: Callable[[Planned, torch.Tensor, tuple[torch.Tensor, ...]], tuple[torch.Tensor, Pullback]],
                ) -> torch.Tensor:
    """The chain's output from ``h`` (under ``no_grad``), each link's pullback appended to ``backs``."""
    for step, own in zip(planned, tensors, strict=True):
        if not (isinstance(h, torch.Tensor) and h.is_floating_point()):
            raise NotAChain
        kind = step.kind
        if kind == "affine":
            assert step.affine is not None
            x = h.detach() if h.requires_grad else h  # (an op saved where it can be)
            done = affine_record(step.affine, step.form, step.rule, step.path, x, own[0],
                                 own[1] if len(own) > 1 else None, step.stacks)
            if done is None:  # (fused alpha-beta that does not fit the input: the general steps')
                h, back = general(step, h, own)
            else:
                h, back = done[0], done[1].back
        elif kind == "pass":
            assert step.op is not None
            h = step.op(h)
            back = Passed(h, h._version).back
        elif kind == "pool":
            pool = step.pool
            assert pool is not None
            shape = h.shape
            h, indices = max_pool_with_indices(pool, h, step.module.__dict__)  # NOTE [max pooling in channels-last]
            back = Pooled(shape, indices, pool[0]).back
        elif kind == "reshape":
            shape = h.shape
            h = type(step.module).forward(step.module, h)
            back = Reshaped(shape).back
        else:
            h, back = general(step, h, own)
        backs.append(back)
    return h
