"""Whether a value reaches a module or tensor of the model, through any objects in between."""

# NOTE [reaching the model]
# The rebinder (NOTE [rebinding]) points bound methods, partials, closures and plain
# containers at the shadows. What it cannot rebuild, a callable object (nnsight installs a
# ``Controller`` holding a weak reference to its module as every module's ``forward``), an
# object with a module in its attributes, a closure cell holding such an object, would
# still compute with the model's own tensors. So each instance attribute and hook, as the
# shadow holds it after rebinding, is walked: attributes (``__dict__`` and ``__slots__``),
# the targets of weak references, bound methods' ``__self__`` and ``__func__``, closure
# cells and defaults, partials, and the items of dicts, lists, tuples and sets. Modules and
# tensors end a route: one of the model's is what we look for, any other is left alone
# (a module's own attributes are walked as its own node). A weak reference to a tensor is
# not followed: it can only tell whether the tensor changed (``nn.LSTM`` keeps them, to
# rebuild its ``_flat_weights`` when the registered parameters differ). Not walked: a function's
# globals (a global ``model`` cannot be told from a library's modules), the metadata
# ``functools.update_wrapper`` gives functions and partials, hook handles, classes and
# Python modules. The walk is bounded (``_LIMIT`` objects per value); past it a value is
# taken as not reaching the model.
#
# The walk runs when a shadow is built and again only when the identities of a module's
# attributes or hooks change (NOTE [checked attributes] in ``_shadow_node``), so an ordinary
# call pays a length and a few ids per module.

from __future__ import annotations

import collections
import functools
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["SCALARS", "reach"]

SCALARS: frozenset[type] = frozenset({bool, int, float, complex, str, bytes, type(None)})
_LEAVES: frozenset[type] = SCALARS | frozenset({
    torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format, types.ModuleType,
    types.BuiltinFunctionType, types.CodeType, types.MethodWrapperType, types.WrapperDescriptorType,
    RemovableHandle, range, slice})
_SEQUENCES = (list, tuple, set, frozenset, collections.deque)
_LIMIT = 10_000


def reach(value: Any, target: Callable[[Any], str | None], seen: dict[int, Any]) -> tuple[str, str] | None:
    """``(route, what)``: the first module or tensor of the model that ``value`` reaches, else None.

    Args:
        value (Any): where the walk starts.
        target (Callable): a module or tensor's description (``"module 'lin'"``) if it is the
            model's, else None.
        seen (dict[int, Any]): objects already walked without reaching the model, by id (shared
            across the values of one check; the walk adds to it and keeps them alive, so no id is reused).

    Returns:
        tuple[str, str] | None: the route from ``value`` (``".module_ref()"``) and the description.
    """
    queue: collections.deque[tuple[Any, str]] = collections.deque([(value, "")])  # breadth first: the shortest route
    budget = _LIMIT
    while queue and budget:
        obj, route = queue.popleft()
        if id(obj) in seen:
            continue
        kind = type(obj)
        if kind in _LEAVES or isinstance(obj, type):
            continue
        if isinstance(obj, (nn.Module, torch.Tensor)):
            what = target(obj)
            if what is not None:
                return route, what
            continue
        seen[id(obj)] = obj
        budget -= 1
        queue.extend((child, route + step) for step, child in _children(obj))
    return None


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    kind = type(obj)
    if isinstance(obj, weakref.ref):
        target = obj()
        if not isinstance(target, torch.Tensor):  # (a weak reference to a tensor tells only whether it changed)
            yield "()", target
    elif kind is types.MethodType:
        yield ".__self__", obj.__self__
        yield ".__func__", obj.__func__
    elif kind is types.FunctionType:
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=False):
            try:
                yield f" (closure variable {name!r})", cell.cell_contents
            except ValueError:  # an empty cell
                continue
        yield from ((f" (default {i})", v) for i, v in enumerate(obj.__defaults__ or ()))
        yield from ((f" (default {k!r})", v) for k, v in (obj.__kwdefaults__ or {}).items())
    elif kind is functools.partial:
        yield ".func", obj.func
        yield from ((f".args[{i}]", v) for i, v in enumerate(obj.args))
        yield from ((f".keywords[{k!r}]", v) for k, v in obj.keywords.items())
    elif isinstance(obj, dict):
        yield from ((f"[{k!r}]", v) for k, v in list(obj.items()))
    elif isinstance(obj, _SEQUENCES):
        yield from ((f"[{i}]", v) for i, v in enumerate(list(obj)))
    else:
        yield from _attributes(obj)


def _attributes(obj: Any) -> Iterator[tuple[str, Any]]:
    """An object's own attributes, read without running its ``__getattr__`` or properties."""
    try:
        state = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        state = None
    if isinstance(state, dict):
        yield from ((f".{k}", v) for k, v in list(state.items()))
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            attr = f"_{cls.__name__.lstrip('_')}{name}" if name.startswith("__") and not name.endswith("__") else name
            descriptor = cls.__dict__.get(attr)
            if isinstance(descriptor, types.MemberDescriptorType):
                try:
                    yield f".{name}", descriptor.__get__(obj, cls)
                except AttributeError:  # an unset slot
                    continue
