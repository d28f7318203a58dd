"""The chain walk's steps (NOTE [lrp on a chain]): each module's forward, recording how it hands relevance back.

A module of known backward runs without a graph; any other on a fresh leaf, by its own
graph. Run on the call's shadow (`run_chain`), or link by link from the params where the
planned walk leaves a link to them (NOTE [a planned walk]).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from .affine import Affine, affine_of
from .checks import check_module_call, check_pass
from .composites import ACTIVATIONS
from .gradient_form import gradient_form
from .max_pool import MAX_POOLS, max_pool_with_indices
from .model_chain import Link
from .module_call import ModuleCall, Template
from .records import Local, NotAChain, Passed, Pooled, Record, Reshaped, Ruled, affine_record
from .rules import Pass, Rule
from .walk import RESHAPES

__all__ = ["GRAPH", "PASS", "Kind", "Steps", "kind_of"]


def _known(module: nn.Module, classes: tuple[type[nn.Module], ...]) -> bool:
    """Whether ``module`` is exactly one of torch's ``classes``, with their forward and not in place.

    Such a module never writes its input and its output depends on it, so it runs
    without the leaf and the graph that catch other modules doing so.
    """
    return type(module) in classes and "forward" not in module.__dict__ and not getattr(module, "inplace", False)


@dataclass(frozen=True)
class Kind:
    """How the walk runs a module: ``"affine"``, ``"pool"``, ``"pass"``, ``"reshape"``, or with its own ``"graph"``."""

    name: str
    affine: Affine | None = None
    pool: tuple[int, Callable[..., Any]] | None = None


PASS, RESHAPE, GRAPH = Kind("pass"), Kind("reshape"), Kind("graph")


def kind_of(module: nn.Module, rule: Rule | None) -> Kind:
    """How the walk runs ``module`` with ``rule``: its backward known (no graph), or by its own graph."""
    state = module.__dict__
    if not isinstance(rule, Pass):
        affine = affine_of(type(module), state, state["_parameters"])
        if affine is not None:
            return Kind("affine", affine)
    if rule is None and "forward" not in state:
        pool = MAX_POOLS.get(type(module))
        if pool is not None and state.get("return_indices") is False:
            return Kind("pool", pool=pool)
    if isinstance(rule, Pass) and _known(module, ACTIVATIONS):
        return PASS
    if rule is None and _known(module, RESHAPES):
        return RESHAPE
    return GRAPH


class Steps:
    """The forward of the chain, one module at a time, recording how each hands relevance back.

    Modules of known backward run without a graph (NOTE [lrp on a chain]). Every other
    module runs on a fresh leaf that requires grad, as on the taps' graph: a module that
    writes its input in place without saying so (no ``inplace=True``) raises there as
    here, and never writes the caller's tensors.
    """

    def __init__(self, ruled: dict[int, tuple[str, Rule]], caller: str):  # by module identity; errors name caller
        self.ruled, self.caller = ruled, caller
        self.records: list[Record] = []

    def rule_of(self, link: Link) -> tuple[str, Rule | None]:
        return self.ruled.get(id(link[1]), ("", None))  # (the path only names ruled modules)

    def __call__(self, link: Link, module: nn.Module, h: Any, own: dict[str, torch.Tensor] | None = None,
                 kind: Kind | None = None) -> torch.Tensor:
        """One module's forward, under ``no_grad``; ``own``: its parameters where ``module`` is the model's own."""
        if not (isinstance(h, torch.Tensor) and h.is_floating_point()):
            raise NotAChain
        path, rule = self.rule_of(link)
        kind = kind_of(module, rule) if kind is None else kind
        state = module.__dict__
        if kind.affine is not None:
            tensors = state["_parameters"] if own is None else own
            return self._affine_step(path, rule, module, kind.affine, h.detach(), tensors)
        if kind.pool is not None:  # (the kernel autograd runs: ties go to the same input)
            out, indices = max_pool_with_indices(kind.pool, h, state)  # NOTE [max pooling in channels-last]
            self.records.append(Pooled(h.shape, indices, kind.pool[0]))
            return out
        if kind is PASS or kind is RESHAPE:
            # torch's own class, no instance forward, and the chain is hook-free: its forward is the call
            out = type(module).forward(module, h)
            if kind is RESHAPE:
                self.records.append(Reshaped(h.shape))
            else:
                check_pass(self.caller, path, (h,), out)
                self.records.append(Passed(out, out._version))
            return cast(torch.Tensor, out)
        return self._step_with_graph(path, rule, module, h)

    def _step_with_graph(self, path: str, rule: Rule | None, module: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """Any other module: on a fresh leaf that requires grad, its own graph for its backward."""
        writes = getattr(module, "inplace", False) is True  # it gets a copy (NOTE [lrp on a chain])
        x = h.detach().requires_grad_()
        try:
            with torch.enable_grad():
                y = module(x.clone() if writes else x)
        except RuntimeError as e:  # e.g. an unannounced in-place write to the leaf; a real error comes again
            raise NotAChain from e
        if rule is not None:
            check_module_call(self.caller, path, (x,), {}, y)
        if not (isinstance(y, torch.Tensor) and y.requires_grad):
            raise NotAChain
        out = y.detach()
        output_factor = getattr(rule, "output_factor", None)  # the gradient form (NOTE [gradient-form rules])
        if rule is None or callable(output_factor):
            factor = None if output_factor is None else output_factor(path, 1, out)
            self.records.append(Local(x, y, factor, bool(getattr(rule, "scales_inputs", False)), y._version))
        elif isinstance(rule, Pass):
            check_pass(self.caller, path, (x,), y)
            self.records.append(Passed(out, out._version))
        else:
            self._ruled(path, rule, module, x.detach(), out, None)
        return out

    def _affine_step(self, path: str, rule: Rule | None, module: nn.Module, affine: Affine, x: torch.Tensor,
                     own: Mapping[str, torch.Tensor | None]) -> torch.Tensor:
        """A linear layer or a convolution: run without a graph, its adjoint is one op (NOTE [affine modules])."""
        weight, bias = own["weight"], own.get("bias")
        assert weight is not None  # (affine_of asks for one)
        done = affine_record(affine, gradient_form(rule), rule, path, x, weight, bias)
        if done is not None:
            self.records.append(done[1])
            return done[0]
        y = affine.run(x, weight, bias)
        assert rule is not None  # (no rule is the gradient form's)
        self._ruled(path, rule, module, x, y, own)
        return y

    def _ruled(self, path: str, rule: Rule, module: nn.Module, x: torch.Tensor, y: torch.Tensor,
               own: Mapping[str, torch.Tensor | None] | None) -> None:
        """Record ``rule.relevance`` on what ``module`` saw; ``own``: its parameters, if not its own slots'."""
        tensors: list[torch.Tensor] = []
        template = Template.of(module, tensors)
        slots = module.__dict__["_parameters"]
        if own is not None and own is not slots:  # the model's own module (it holds no buffer): the call's tensors
            tensors = [cast(torch.Tensor, own[name]) for name, t in slots.items() if t is not None]
        call = ModuleCall(path, (x,), y, template, tuple(tensors), {}, self.caller)
        self.records.append(Ruled(rule, call, (x._version, y._version)))
