"""Pointing a shadow's attributes at shadows instead of the model's own modules.

# NOTE [rebinding]
A shadow starts as a copy of its original's ``__dict__``. Most attributes are plain
values, but some refer back to the model: ``accelerate``'s ``add_hook_to_module`` stores
``forward = partial(new_forward, module)`` and ``_old_forward = module.forward`` (a bound
method), users write ``m.forward = MethodType(...)``, register their own bound methods as
hooks, or keep an unregistered back-reference to a parent. Run as copied, those run the
*original* module with the model's own tensors: the call silently ignores the given
params. So every such value is rebound to the shadow of the module it refers to:

- a module of the model becomes its shadow;
- a bound method of one is bound to its shadow instead;
- a ``functools.partial`` is rebuilt with its function and arguments rebound (and the
  attributes ``functools.update_wrapper`` gave it);
- a list or tuple holding any of these is rebuilt.

A plain function whose closure cells or defaults refer to a module of the model cannot
be rebound safely (its cells may be shared state), so it is refused with an error
naming the module and the attribute. Values that only reach the model through other
objects cannot be seen here; ``accelerate``'s offloading hooks, which replace the
module's parameters while it runs, are caught after the forward (see ``_shadow``).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["RebindError", "Rebinder"]

_CALLABLE_TYPES: frozenset[type] = frozenset({types.MethodType, functools.partial, types.FunctionType})
_CONTAINER_TYPES: frozenset[type] = frozenset({list, tuple})


class RebindError(ValueError):
    """An attribute refers to a module of the model in a way that cannot be rebound."""


class Rebinder:
    """Maps values that refer to the model's modules onto their shadows.

    Args:
        shadows (Mapping[int, nn.Module]): ``id(original module) -> shadow``. Originals are
            alive while a call runs, so an id found here is that module.
        module_types (set[type]): the classes of the model's modules (a cheap first test).
    """

    def __init__(self, shadows: Mapping[int, nn.Module], module_types: set[type]):
        self.shadows = shadows
        self.suspects = frozenset(module_types) | _CALLABLE_TYPES | _CONTAINER_TYPES

    def may_refer(self, values: Any) -> bool:
        """Whether any of ``values`` has a type that can refer to the model (fast path)."""
        return not self.suspects.isdisjoint(map(type, values))

    def rebind_all(self, state: dict[str, Any], source: Mapping[str, Any], path: str, what: str) -> None:
        """Replace in ``state`` each value of ``source`` that refers to the model."""
        for name, value in source.items():
            new = self.rebind(value, path, f"{what}{name}")
            if new is not value:
                state[name] = new

    def rebind(self, value: Any, path: str, attr: str) -> Any:
        """``value`` pointing at shadows; ``value`` itself when it does not refer to the model."""
        kind = type(value)
        shadow = self.shadows.get(id(value))
        if shadow is not None and isinstance(value, nn.Module):
            return shadow
        if kind is types.MethodType:
            owner = self.shadows.get(id(value.__self__))
            return value if owner is None else types.MethodType(value.__func__, owner)
        if kind is functools.partial:
            return self._partial(value, path, attr)
        if kind is types.FunctionType:
            self._check_function(value, path, attr)
            return value
        if kind in _CONTAINER_TYPES:
            items = [self.rebind(v, path, attr) for v in value]
            if all(a is b for a, b in zip(items, value, strict=True)):
                return value
            return kind(items)
        return value

    def _partial(self, value: functools.partial[Any], path: str, attr: str) -> Any:
        func = self.rebind(value.func, path, attr)
        args = tuple(self.rebind(a, path, attr) for a in value.args)
        kwargs = {k: self.rebind(v, path, attr) for k, v in value.keywords.items()}
        same = func is value.func and all(a is b for a, b in zip(args, value.args, strict=True)) and all(
            kwargs[k] is v for k, v in value.keywords.items())
        if same:
            return value
        new = functools.partial(func, *args, **kwargs)
        new.__dict__.update({k: self.rebind(v, path, attr) for k, v in value.__dict__.items()})
        return new

    def _check_function(self, fn: types.FunctionType, path: str, attr: str) -> None:
        cells = [c.cell_contents for c in fn.__closure__ or () if _filled(c)]
        for value in (*cells, *(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()):
            if self._refers(value):
                raise RebindError(
                    f"module {path or '<root>'!r}: its {attr} is the function {fn.__qualname__!r}, whose closure or "
                    "defaults refer to a module of the model; tdhook_fn runs calls on a private copy and cannot "
                    "point that closure at it, so the call would read the model's own tensors. Make it a method "
                    "(types.MethodType), a functools.partial taking the module, or a hook that uses its module "
                    "argument"
                )

    def _refers(self, value: Any) -> bool:
        kind = type(value)
        if kind is types.MethodType:
            return id(value.__self__) in self.shadows
        if kind is functools.partial:
            return any(self._refers(v) for v in (value.func, *value.args, *value.keywords.values()))
        return id(value) in self.shadows and isinstance(value, nn.Module)


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True
