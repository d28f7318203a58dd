"""What the chain walk plans of a chain once (NOTE [plans per model]): each link's kind, and the walk from the
params where it needs no shadow."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import nn

from ..._params import Key
from .affine import Affine
from .bound import BoundStep, bind
from .gradient_form import gradient_form
from .model_chain import Link
from .rules import AlphaBeta, Rule
from .stack_cache import StackCache
from .steps import GRAPH, PASS, Kind, kind_of
from .walk import ACTIVATION_OPS, Planned, slots_of

__all__ = ["Walk", "walk_of"]


def _planned(model: nn.Module, links: list[Link], kinds: list[Kind],
             by_module: dict[int, tuple[str, Rule]]) -> list[Planned] | None:
    """Each link as the walk from the params runs it, where it needs no shadow (NOTE [walks without a shadow])."""
    # NOTE [walks without a shadow]
    # The call's shadow (NOTE [shadow modules]) puts the params in private copies of the
    # modules, so that a module's forward computes with them and never with the model's.
    # On the walk a linear layer or a convolution is computed from its tensors directly,
    # and the other modules of known backward (pooling, torch's activations and reshapes)
    # hold no tensor at all: their forward reads plain attributes only, and runs on the
    # model's own module without changing it. Where every link is such a module, and the
    # params hold exactly those layers' tensors in the model's shapes, the walk takes the
    # tensors from the params and needs no shadow (~0.1 ms a call on the benchmarks'
    # MLP). Anything else (a buffer, a parameter elsewhere, a module of another kind, a
    # key or shape that differs: the shadow names what is wrong) takes the shadow.
    if any(m.__dict__["_parameters"] or m.__dict__["_buffers"] for m in _containers(model)):
        return None
    planned = []
    for link, kind in zip(links, kinds, strict=True):
        name, module = link
        state = module.__dict__
        if kind is GRAPH or state["_buffers"] or (kind.affine is None and state["_parameters"]):
            return None
        slots = slots_of(name, module)
        path, rule = by_module.get(id(module), ("", None))
        if kind.affine is not None:
            planned.append(_plan_affine(link, path, rule, kind.affine, slots))
        elif kind is PASS:
            op = ACTIVATION_OPS.get(type(module)) or functools.partial(type(module).forward, module)
            planned.append(Planned("pass", link, path, rule, op=op))
        else:
            planned.append(Planned(kind.name, link, path, rule, pool=kind.pool))
    return planned


def _plan_affine(link: Link, path: str, rule: Rule | None, affine: Affine,
                 slots: tuple[tuple[str, Key], ...]) -> Planned:
    """As `Steps._affine_step` runs it: a gradient-form rule (or none), fused alpha-beta, or the rule's own."""
    form = gradient_form(rule)
    if form is None and not (type(rule) is AlphaBeta and affine.groups == 1):
        return Planned("general", link, path, rule, slots)
    return Planned("affine", link, path, rule, slots, affine, form, stacks=StackCache() if form is None else None)


def _containers(model: nn.Module) -> list[nn.Module]:
    """The nested ``Sequential`` s of a chain, the root first."""
    found = [model]
    for module in found:
        found.extend(m for m in module._modules.values() if isinstance(m, nn.Sequential))
    return found


@dataclass(frozen=True)
class Walk:
    """The walk's plan of a chain: each link's kind, whether it draws at random, and the walk from the params
    (planned, and bound where it can be)."""

    links: list[Link]
    kinds: list[Kind]
    random: bool  # a walk given up gives the taps the random state it found (dropout); known modules draw none
    planned: list[Planned] | None  # None: on a shadow
    bound: list[BoundStep] | None  # the planned walk bound (NOTE [a bound walk]); None: a link needs the steps


def walk_of(model: nn.Module, links: list[Link], by_module: dict[int, tuple[str, Rule]]) -> Walk:
    kinds = [kind_of(module, by_module.get(id(module), ("", None))[1]) for _, module in links]
    random = any(kind is GRAPH or isinstance(link[1], nn.RReLU) for link, kind in zip(links, kinds, strict=True))
    planned = _planned(model, links, kinds, by_module)
    return Walk(links, kinds, random, planned, None if planned is None else bind(planned))
