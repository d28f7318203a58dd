"""Pointing a shadow's attributes at shadows instead of the model's own modules."""

# NOTE [rebinding]
# A shadow starts as a copy of its original's ``__dict__``. Most attributes are plain
# values, but some refer back to the model: ``accelerate``'s ``add_hook_to_module`` stores
# ``forward = partial(new_forward, module)`` and ``_old_forward = module.forward`` (a bound
# method), users write ``m.forward = MethodType(...)``, register their own bound methods as
# hooks, or keep an unregistered back-reference to a parent. Run as copied, those run the
# *original* module with the model's own tensors: the call silently ignores the given
# params. So every such value is rebound to the shadow of the module it refers to:
#
# - a module of the model becomes its shadow;
# - a bound method of one is bound to its shadow instead, a weak reference to one refers to
#   its shadow instead;
# - a ``functools.partial`` is rebuilt with its function and arguments rebound (and the
#   attributes ``functools.update_wrapper`` gave it), as is a list or tuple *inside* one;
#
# - a function whose closure cells or defaults hold any of these is rebuilt with new cells
#   for those values (its other cells stay shared with the original function).
#
# A plain list, tuple or dict attribute (nested ones too) holding modules of the model is
# copied for each call with the shadows in their place; one holding parameters or buffers
# of the model, or an attribute that *is* one (``self.alias = self.lin.weight`` of a plain
# tensor), gets the call's tensors for those (NOTE [held tensors] in ``_shadow``).
#
# What is left after rebinding must not reach the model (NOTE [reaching the model]): a
# callable *object* (nnsight's forward ``Controller``), an object holding a module or a
# parameter, a closure over such an object, cannot be rebound without copying it, and is
# refused with an error naming the module, the attribute and the route to the model.
# ``accelerate``'s offloading hooks, which replace the module's parameters while it runs,
# are caught after the forward (see ``_shadow``).

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ._params import Key
from ._reach import SCALARS, reach

_PROXIES = (weakref.ProxyType, weakref.CallableProxyType)

__all__ = ["RebindError", "Rebinder", "filled", "storage_start"]

_CALLABLE_TYPES: frozenset[type] = frozenset({types.MethodType, functools.partial, types.FunctionType,
                                              weakref.ReferenceType})
_CONTAINER_TYPES: frozenset[type] = frozenset({list, tuple})
_PLAIN: frozenset[type] = frozenset({list, tuple, dict})
# NOTE [what is scanned]: every call scans each module's attributes for these types only
# (a C-level pass). Plain lists, tuples and dicts attributes that held modules or tensors
# of the model when the module's attributes were last checked are copied on every call
# (Rebinder.held_copy; a module that is not registered is refused): modules belong in
# nn.ModuleList / nn.ModuleDict. Lists and tuples are looked into inside partials and
# closures. Everything else is walked only when its identity changes (NOTE [reaching the model]).


class RebindError(ValueError):
    """An attribute refers to a module of the model in a way that cannot be rebound."""


class Rebinder:
    """Maps values that refer to the model's modules onto their shadows.

    Args:
        shadows (Mapping[int, nn.Module]): ``id(original module) -> shadow``. Originals are
            alive while a call runs, so an id found here is that module.
        module_types (set[type]): the classes of the model's modules (a cheap first test).
        paths (Mapping[int, str]): ``id(original module) -> its path``, for messages.
        tensor_keys (Mapping[int, Key]): ``id(the model's parameter or buffer) -> its key``.
        storages (Mapping[int, Key]): ``storage_start(the model's parameter) -> its key``.
    """

    def __init__(self, shadows: Mapping[int, nn.Module], module_types: set[type], paths: Mapping[int, str],
                 tensor_keys: Mapping[int, Key], storages: Mapping[int, Key] | None = None):
        self.shadows = shadows
        self.paths = paths
        self.tensor_keys = tensor_keys
        self.storages = storages or {}
        self.suspects = frozenset(module_types) | _CALLABLE_TYPES
        self.inner_suspects = self.suspects | _CONTAINER_TYPES

    def may_refer(self, values: Any) -> bool:
        """Whether any of ``values`` has a type that can refer to the model (fast path)."""
        return not self.suspects.isdisjoint(map(type, values))

    def rebind_all(self, state: dict[str, Any], source: Mapping[str, Any], path: str, what: str) -> None:
        """Replace in ``state`` each value of ``source`` that refers to the model."""
        suspects = self.suspects
        for name, value in source.items():
            if type(value) in suspects:
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
        if kind is weakref.ReferenceType:  # a weak back-reference to a module (a parent) refers to its shadow
            target = value()
            shadow = None if target is None else self.shadows.get(id(target))
            return value if shadow is None or not isinstance(target, nn.Module) else weakref.ref(shadow)
        if kind is functools.partial:
            return self._partial(value, path, attr)
        if kind is types.FunctionType:
            return self._function(value, path, attr)
        if kind in _CONTAINER_TYPES:
            if self.inner_suspects.isdisjoint(map(type, value)):
                return value
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

    def _function(self, fn: types.FunctionType, path: str, attr: str) -> Any:
        """A closure over the model's modules, rebuilt with new cells for those (others stay shared)."""
        closure = fn.__closure__ or ()
        if not closure and not fn.__kwdefaults__ and self.inner_suspects.isdisjoint(map(type, fn.__defaults__ or ())):
            return fn
        cells = [_rebound_cell(c, self, path, attr) for c in closure]
        defaults = tuple(self.rebind(d, path, attr) for d in fn.__defaults__ or ())
        kwdefaults = {k: self.rebind(v, path, attr) for k, v in (fn.__kwdefaults__ or {}).items()}
        same = all(a is b for a, b in zip(cells, closure, strict=True)) and all(
            a is b for a, b in zip(defaults, fn.__defaults__ or (), strict=True)) and all(
            kwdefaults[k] is v for k, v in (fn.__kwdefaults__ or {}).items())
        if same:
            return fn
        new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, defaults or None, tuple(cells) or None)
        new.__kwdefaults__ = kwdefaults or None
        new.__dict__.update(fn.__dict__)
        new.__qualname__ = fn.__qualname__
        return new

    def held_copy(self, value: Any, path: str, attr: str,
                  tensors: Callable[[torch.Tensor], Any] | None = None) -> Any:
        """A plain list, tuple or dict (nested ones too) with each module of the model replaced by its shadow.

        With ``tensors``, each parameter or buffer of the model (also ``value`` itself) is
        replaced by ``tensors(it)``. Other items are rebound (`rebind`).

        Raises:
            RebindError: it holds a module that is not a registered submodule of the model
                (no shadow runs it, no params or taps reach it).
        """
        kind = type(value)
        if kind is dict:
            return {key: self.held_copy(item, path, attr, tensors) for key, item in value.items()}
        if kind is list or kind is tuple:
            return kind(self.held_copy(item, path, attr, tensors) for item in value)
        if isinstance(value, nn.Module):
            shadow = self.shadows.get(id(value))
            if shadow is None:
                raise RebindError(
                    f"module {path or '<root>'!r}: its attribute {attr!r} holds a {type(value).__name__} that is not "
                    "a registered submodule, so it would run with its own tensors, and no params, tap or rule "
                    "would reach it. Hold modules in nn.ModuleList / nn.ModuleDict")
            return shadow
        if isinstance(value, torch.Tensor):
            return tensors(value) if tensors is not None and id(value) in self.tensor_keys else value
        return self.rebind(value, path, attr)

    def holds(self, value: Any, path: str, attr: str, seen: dict[int, Any]) -> tuple[bool, bool]:
        """Whether a plain container (or a tensor) attribute holds modules, and tensors, of the model.

        Raises:
            RebindError: an item of it reaches the model in a way that cannot be rebound
                (`check_reach`), or is a module that is not registered.
        """
        kind = type(value)
        if kind in _PLAIN:
            modules = tensors = False
            for item in value.values() if kind is dict else value:
                m, t = self.holds(item, path, attr, seen)
                modules, tensors = modules or m, tensors or t
            return modules, tensors
        if isinstance(value, torch.Tensor):
            if id(value) in self.tensor_keys:
                return False, True
            key = self.storages.get(storage_start(value))
            if key is not None:  # a view of a parameter (a transpose kept as an attribute): not the call's tensor
                raise RebindError(
                    f"module {path or '<root>'!r}: its attribute {attr!r} shares memory with the parameter "
                    f"{'.'.join(key)!r} (a view of it, kept outside the registered slots), so the call would compute "
                    "with the model's own values, not the params you gave. Compute it from the parameter in forward")
            return False, False
        if isinstance(value, nn.Module):
            self.held_copy(value, path, attr)  # raises if it is not registered
            return True, False
        self.check_reach(self.rebind(value, path, attr), path, f"attribute {attr!r}", seen)
        return False, False

    def check_reach(self, value: Any, path: str, attr: str, seen: dict[int, Any]) -> None:
        """Refuse ``value`` (as the shadow holds it, rebound) if it still reaches a module or tensor of the model.

        Raises:
            RebindError: naming the module, ``attr`` and the route to the model.
        """
        if type(value) in SCALARS:
            return
        found = reach(value, self._target, seen)
        if found is None:
            return
        route, what = found
        raise RebindError(
            f"module {path or '<root>'!r}: its {attr} is a {type(value).__name__} object that reaches {what} of the "
            f"model (through {route or 'itself'}); tdhook_fn runs each call on a private copy of the model and cannot "
            "point that object at the copy, so the call would compute with the model's own tensors, not the params "
            "you gave. Remove it from the model (a library that wraps a model in place, as nnsight's NNsight does "
            "with every module's forward, should wrap a copy: NNsight(copy.deepcopy(model))), or use a method, a "
            "functools.partial taking the module, or a hook that uses its module argument, and keep tensors in "
            "registered modules")

    def _target(self, obj: Any) -> str | None:
        if type(obj) in _PROXIES and isinstance(obj, nn.Module):  # a weakref.proxy: its referent is what it reaches
            obj = obj.get_submodule("")  # (torch's lookup: "" is the module itself)
        if isinstance(obj, nn.Module):
            return f"module {self.paths.get(id(obj)) or '<root>'!r}" if id(obj) in self.shadows else None
        key = self.tensor_keys.get(id(obj))
        return None if key is None else f"tensor {'.'.join(key)!r}"

    def check_hook_object(self, value: Any, path: str, attr: str, depth: int = 2) -> None:
        """Refuse a hook object (accelerate's ``_hf_hook``) keeping a module or tensor of the model in an attribute.

        accelerate calls ``module._hf_hook.pre_forward(module, ...)`` with the module it runs
        (the shadow); a hook that stored its module in ``init_hook`` would read the
        model's own tensors instead. A ``SequentialHook``'s hooks are looked into.
        """
        state = getattr(value, "__dict__", None)
        if not isinstance(state, dict):
            return
        for name, item in state.items():
            inner = item if type(item) in _CONTAINER_TYPES else (item,)
            if any(self._refers(v) for v in inner):
                raise RebindError(
                    f"module {path or '<root>'!r}: its {attr} ({type(value).__name__}) keeps a module or tensor of the "
                    f"model in its attribute {name!r}; tdhook_fn runs calls on a private copy of the model, so the "
                    "hook would read the model's own tensors. Use the module argument that pre_forward/post_forward "
                    "receive")
            if depth > 1:
                for v in inner:
                    if not isinstance(v, nn.Module) and hasattr(v, "__dict__") and not callable(v):
                        self.check_hook_object(v, path, attr, depth - 1)

    def _refers(self, value: Any) -> bool:
        kind = type(value)
        if kind is types.MethodType:
            return id(value.__self__) in self.shadows
        if kind is functools.partial:
            return any(self._refers(v) for v in (value.func, *value.args, *value.keywords.values()))
        if isinstance(value, torch.Tensor):  # a parameter or buffer kept by the hook: the model's own, not the call's
            return id(value) in self.tensor_keys
        return id(value) in self.shadows and isinstance(value, nn.Module)


def storage_start(tensor: torch.Tensor) -> int:
    """Where a tensor's memory starts (0 for none: meta, uninitialized or empty tensors, wrapped ones)."""
    try:
        return int(tensor.untyped_storage().data_ptr()) if tensor.numel() else 0
    except (RuntimeError, NotImplementedError, ValueError):
        return 0


def _rebound_cell(cell: types.CellType, rebinder: Rebinder, path: str, attr: str) -> types.CellType:
    if not filled(cell):
        return cell
    new = rebinder.rebind(cell.cell_contents, path, attr)
    return cell if new is cell.cell_contents else types.CellType(new)


def filled(cell: types.CellType) -> bool:
    """Whether a closure cell holds a value (an unassigned one raises when read)."""
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True
