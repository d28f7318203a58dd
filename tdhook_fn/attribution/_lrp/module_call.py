"""What an LRP rule sees of one module run: `ModuleCall`, and the `Template` to run it again.

The call's shadow module is emptied when its forward returns, and a rule runs in the
backward; so the module's structure is kept as a template without tensors, and the
tensors the call saw travel to the backward as inputs (NOTE [lrp as modified vjps]).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch
from torch import nn

from ..._in_place import writes_in_place
from ..._shadow import HOOK_DICTS
from ..._vjp import vjp
from .affine import Affine, affine_of

__all__ = ["Modify", "ModuleCall", "Template"]

Modify = Callable[[str, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _Own:
    """An instance attribute bound to the module itself: a method, or a partial of it as first argument.

    Instance-level ``forward`` wrappers (accelerate's hooks) are these; the rebuilt module
    gets them bound to itself, not to the emptied shadow.
    """

    fn: Callable[..., Any]
    partial: functools.partial[Any] | None = None

    @staticmethod
    def of(value: Any, module: nn.Module) -> Any:
        if isinstance(value, MethodType) and value.__self__ is module:
            return _Own(value.__func__)
        if isinstance(value, functools.partial) and value.args[:1] == (module,):
            return _Own(value.func, value)
        return value

    def bind(self, module: nn.Module) -> Any:
        if self.partial is None:
            return MethodType(self.fn, module)
        bound = functools.partial(self.fn, module, *self.partial.args[1:], **self.partial.keywords)
        return functools.update_wrapper(bound, self.partial)


@dataclass(frozen=True)
class Template:
    """A module's structure without its tensors, to rebuild it after its call ended.

    The call's shadow module is emptied when the forward returns, and a rule runs in the
    backward: it runs a fresh, hook-free instance built from this template and the
    tensors the call saw (passed to the backward as inputs, so that every transform sees
    them).
    """

    cls: type[nn.Module]
    state: dict[str, Any]
    params: tuple[tuple[str, bool], ...]  # own slot names, and whether the slot holds a tensor
    buffers: tuple[tuple[str, bool], ...]
    children: tuple[tuple[str, Template | None], ...]
    affine: Affine | None  # the module's map in one op, where it is one (NOTE [affine modules])

    @staticmethod
    def of(module: nn.Module, tensors: list[torch.Tensor]) -> Template:
        """The template of ``module``; its tensors are appended to ``tensors`` (own params first)."""
        state = {k: _Own.of(v, module) for k, v in module.__dict__.items()
                 if k not in ("_parameters", "_buffers", "_modules", *HOOK_DICTS)}
        slots = []
        for kind in ("_parameters", "_buffers"):
            own = module.__dict__[kind]
            slots.append(tuple((name, value is not None) for name, value in own.items()))
            tensors.extend(value for value in own.values() if value is not None)
        children = tuple((name, None if child is None else Template.of(child, tensors))
                         for name, child in module.__dict__["_modules"].items())
        affine = affine_of(type(module), state, module._parameters)
        return Template(type(module), state, slots[0], slots[1], children, affine)

    def build(self, tensors: Iterator[torch.Tensor]) -> nn.Module:
        """A new module of this structure holding ``tensors`` (in `of`'s order)."""
        module = self.cls.__new__(self.cls)
        state = module.__dict__
        state.update((k, v.bind(module) if isinstance(v, _Own) else v) for k, v in self.state.items())
        state["_parameters"] = {name: next(tensors) if full else None for name, full in self.params}
        state["_buffers"] = {name: next(tensors) if full else None for name, full in self.buffers}
        state["_modules"] = {name: None if child is None else child.build(tensors) for name, child in self.children}
        state.update((name, OrderedDict()) for name in HOOK_DICTS)
        return module


@dataclass(frozen=True)
class ModuleCall:
    """One run of a module, as a rule sees it in the backward.

    Attributes:
        path (str): the module's path.
        inputs (tuple[Tensor, ...]): its positional inputs.
        output (Tensor): its output.
        template (Template): its structure, to run it again.
        tensors (tuple[Tensor, ...]): its parameters and buffers as the call saw them
            (the call's params, never the model's own), own parameters first.
        kwargs (dict): its keyword arguments (no tensors).
        caller (str): the method whose rules run (``"lrp"``, ``"deeplift"``), which its errors name.
    """

    path: str
    inputs: tuple[torch.Tensor, ...]
    output: torch.Tensor
    template: Template
    tensors: tuple[torch.Tensor, ...]
    kwargs: dict[str, Any]
    caller: str = "lrp"

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """The module's own parameters (not its submodules'), by name."""
        names = [name for name, full in self.template.params if full]
        return dict(zip(names, self.tensors, strict=False))

    def run(self, inputs: Sequence[torch.Tensor], modify: Modify | None = None) -> torch.Tensor:
        """The module's forward on ``inputs``, its own parameters replaced by ``modify(name, p)``."""
        affine = self._affine(inputs)
        if affine is not None:
            return affine.run(inputs[0], *self._weight_and_bias(modify))
        tensors = list(self.tensors)
        if modify is not None:
            for i, name in enumerate(self.params):
                tensors[i] = modify(name, tensors[i])
        module = self.template.build(iter(tensors))
        if writes_in_place(module):  # (it would write the inputs the rule reads, or a vjp's leaves)
            inputs = [x.clone() for x in inputs]
        output = module(*inputs, **self.kwargs)
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"{self.caller}: module {self.path!r} returns a {type(output).__name__}; rules need one "
                            "tensor")
        return output

    def vjp(self, inputs: Sequence[torch.Tensor], cotangent: torch.Tensor,
            modify: Modify | None = None) -> tuple[torch.Tensor, ...]:
        """``J^T cotangent`` of `run` at ``inputs``, for each input."""
        return self.linearize(inputs, modify)[1](cotangent)

    def linearize(self, inputs: Sequence[torch.Tensor], modify: Modify | None = None,
                  ) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, ...]]]:
        """`run` at ``inputs`` and its pullback ``cotangent -> J^T cotangent`` (one forward)."""
        affine = self._affine(inputs)
        if affine is not None:
            weight, bias = self._weight_and_bias(modify)
            output = affine.run(inputs[0], weight, bias)
            pullback = affine.pullback(weight, inputs[0].shape, output.shape)
            return output, lambda cotangent: (pullback(cotangent),)
        output, pull, _ = vjp(lambda xs: (self.run(xs, modify), ()), tuple(inputs))
        return output, lambda cotangent: tuple(pull(cotangent)[0])

    def _affine(self, inputs: Sequence[torch.Tensor]) -> Affine | None:
        """The module's map in one op, for one positional input and no keywords (NOTE [affine modules])."""
        return self.template.affine if len(inputs) == 1 and not self.kwargs else None

    def _weight_and_bias(self, modify: Modify | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        own = self.params
        if modify is not None:
            own = {name: modify(name, p) for name, p in own.items()}
        return own["weight"], own.get("bias")
