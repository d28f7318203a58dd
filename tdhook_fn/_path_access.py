"""Which attribute and item steps a submodule path may take: NOTE [path access]."""

# NOTE [path access]
# An attribute step on an ``nn.Module`` is ``getattr``: torch's lookup reads the module's
# own dictionaries, a property of the user's class is user code, and the properties of
# library module classes only read (``device``, ``dtype``). On any other object it reads
# the instance's own ``__dict__`` and nothing else (tdhook's paths walk plain objects too):
# no property, descriptor or ``__getattr__`` runs, since an arbitrary object's may run any
# code. So ``"checkpoint.parent"`` (a ``Path``: slots, no ``__dict__``) and ``"weight.data"``
# (a property of tensors) are refused. An item step indexes an ``nn.Module`` (torch's containers, or the user's own
# ``__getitem__``) or a plain ``list``, ``tuple``, ``dict`` or ``OrderedDict`` (exactly these
# types, whose indexing runs no Python code; a ``defaultdict`` would insert a missing key);
# anything else, tensors included, is refused.

from __future__ import annotations

import difflib
from collections import OrderedDict
from typing import Any

from torch import nn

__all__ = ["AccessRefused", "nearest", "read_attribute", "read_item", "type_name"]

_CONTAINERS = (list, tuple, dict, OrderedDict)  # exact types: their indexing runs no Python code


class AccessRefused(Exception):
    """A step a path may not take, or one that finds nothing; the message says why."""


def type_name(obj: Any) -> str:
    """``obj``'s class for messages: ``list``, ``pathlib.PosixPath``."""
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _children(obj: Any) -> list[str]:
    if isinstance(obj, nn.Module):
        return [*obj._modules, *obj._parameters, *obj._buffers]
    return [n for n in dir(obj) if not n.startswith("_")]


def nearest(obj: Any, wanted: Any) -> str:
    """``"<class> has no <wanted> (nearest: [...])"``, or the names available when none is close."""
    names = _children(obj)
    close = difflib.get_close_matches(str(wanted), names, n=3)
    hint = f"nearest: {close}" if close else f"available: {names[:20]}"
    return f"{type(obj).__name__} has no {wanted!r} ({hint})"


def read_attribute(obj: Any, name: str) -> Any:
    """``getattr(obj, name)`` where NOTE [path access] allows it.

    Raises:
        AccessRefused: ``obj`` has no attribute ``name``, or it is not an ``nn.Module`` and
            ``name`` is not in its own ``__dict__``.
    """
    if not isinstance(obj, nn.Module):
        own = getattr(obj, "__dict__", None)
        if type(own) is dict and name in own:
            return own[name]
        raise AccessRefused(
            f"{name!r} is not in the own attributes (__dict__) of a {type_name(obj)}, and paths read only "
            "those of objects that are not nn.Module (a property or __getattr__ may run any code)"
        )
    try:
        return getattr(obj, name)
    except AttributeError:
        raise AccessRefused(nearest(obj, name)) from None


def read_item(obj: Any, key: Any) -> Any:
    """``obj[key]`` where NOTE [path access] allows it.

    Raises:
        AccessRefused: ``obj`` is neither an ``nn.Module`` nor a plain container, or has
            no item ``key``.
    """
    if not (isinstance(obj, nn.Module) or type(obj) in _CONTAINERS):
        raise AccessRefused(
            f"indexing a {type_name(obj)} with {key!r} is not allowed in a path: paths index "
            "nn.Module objects and plain lists, tuples and dicts only"
        )
    try:
        return obj[key]
    except (IndexError, KeyError, TypeError) as e:
        raise AccessRefused(f"{nearest(obj, key)}; {type(e).__name__}: {e}") from None
