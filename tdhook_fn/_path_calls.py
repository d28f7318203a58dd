"""Which calls a submodule path may make: NOTE [path calls]."""

# NOTE [path calls]
# tdhook documents one call form, ``"fn(0)"``: a method of the user's model returning a
# submodule. A path's call ``name(...)`` is made only when all of these hold (an allow-list):
#
# 1. The name passes the name rule (`call_refusal`): it is one of `READ_ONLY`,
#    or it is neither defined on the model-changing APIs of torch, tensordict and (once
#    imported) transformers nor ends in ``_``. A user class overriding ``train`` calls
#    ``super().train()``, so the name is refused also where the class is the user's.
# 2. The receiver is an ``nn.Module``, and the name resolves through the receiver's
#    *class*: an attribute set on the instance (``self.fn = self.ckpt.unlink``,
#    ``self.switch = self.train``) is refused, and so is a submodule (its forward).
# 3. The class holds a function (plain, static or class method) under the name, and either
#    the name is in `READ_ONLY` (torch's or any override: they only read), or the
#    function is user code, not inherited from torch, tensordict, transformers or any
#    other installed library (NOTE [user code] in ``_code_origin.py``).
#
# The decision for 2-3 is cached per ``(class, name)`` with the class attribute it was made
# for, so a class patched afterwards is decided again.
#
# When each rule is checked. A receiver is known only by walking the path, and what a call
# returns only once it ran. So, before any call of a path runs:
#
# - the name rule, for every call of the path;
# - the first call in full (2, 3): its receiver is reached by attribute and item steps
#   only, which run no method a path names (only torch's lookups or the user's own
#   properties and ``__getitem__``: NOTE [path access] in ``_path_access.py``);
# - every later call by name: it must be in `READ_ONLY` or pass 2-3 on some module
#   class of the root's tree (``root.modules()``). ``"fn(0).checkpoint.unlink()"`` is thus
#   refused before ``fn(0)`` runs: no module class of the model defines ``unlink``.
#
# Then, as the path is walked, a call followed by another call must return an
# ``nn.Module``, and each later call is checked in full on the receiver actually reached
# before it runs. What can run before a refusal is therefore only calls that passed the
# full check (the user's own methods on the model's modules, and the read-only lookups):
# never a library's method, and never a method of an object that is not a module. A path
# may still reach a module that is not in the root's tree through a user method; a later
# call on it is allowed only if some class of the tree defines the name.

from __future__ import annotations

import difflib
import functools
import inspect
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import tensordict
import tensordict.nn as tdnn
import torch
from torch import nn

from ._code_origin import library_of
from ._path_access import type_name

__all__ = ["READ_ONLY", "CallRefused", "call_refusal", "checked_method", "later_call_refusal"]

# nn.Module lookups that only read; callable whoever defines them (rules 1 and 3).
READ_ONLY = frozenset({"get_submodule", "get_parameter", "get_buffer"})

_ALLOWED_HINT = "paths may call only your own methods (defined by your nn.Module classes) and " + ", ".join(
    sorted(READ_ONLY)
)

# Where a name is defined on a class of these, the first label listed names it in errors.
_CORE: tuple[tuple[str, type], ...] = (
    ("torch.nn.Module", nn.Module),
    ("torch.nn.Sequential", nn.Sequential),
    ("torch.nn.ModuleList", nn.ModuleList),
    ("torch.nn.ModuleDict", nn.ModuleDict),
    ("torch.nn.ParameterList", nn.ParameterList),
    ("torch.nn.ParameterDict", nn.ParameterDict),
    ("tensordict.nn.TensorDictModuleBase", tdnn.TensorDictModuleBase),
    ("tensordict.nn.TensorDictModule", tdnn.TensorDictModule),
    ("tensordict.nn.TensorDictSequential", tdnn.TensorDictSequential),
    ("tensordict.TensorDictBase", tensordict.TensorDictBase),
    ("tensordict.TensorDict", tensordict.TensorDict),
    ("torch.Tensor", torch.Tensor),
    ("torch.nn.Parameter", nn.Parameter),
)

# (module, class, label): read from sys.modules only, never imported here. No instance of
# these classes can exist before their module has been imported.
_TRANSFORMERS: tuple[tuple[str, str, str], ...] = (
    ("transformers.modeling_utils", "PreTrainedModel", "transformers.PreTrainedModel"),
    ("transformers.generation.utils", "GenerationMixin", "transformers.GenerationMixin"),
)


def _module_classes(namespace: Any, prefix: str) -> list[tuple[str, type]]:
    return [
        (f"{prefix}.{name}", value)
        for name, value in sorted(vars(namespace).items())
        if isinstance(value, type) and issubclass(value, nn.Module)
    ]


@functools.cache
def _core_owners() -> Mapping[str, str]:
    """``name -> label`` of every name torch's and tensordict's APIs define (computed once)."""
    owners: dict[str, str] = {}
    for label, cls in (*_CORE, *_module_classes(nn, "torch.nn"), *_module_classes(tdnn, "tensordict.nn")):
        for name in dir(cls):
            owners.setdefault(name, label)
    return owners


_owners_cache: tuple[tuple[object, ...], Mapping[str, str]] | None = None


def _owners() -> Mapping[str, str]:
    """`_core_owners` plus the transformers classes imported so far."""
    global _owners_cache
    found = tuple(getattr(sys.modules.get(module), cls, None) for module, cls, _ in _TRANSFORMERS)
    cached = _owners_cache
    if cached is not None and all(a is b for a, b in zip(cached[0], found, strict=True)):
        return cached[1]
    owners = dict(_core_owners())
    for (_, _, label), cls in zip(_TRANSFORMERS, found, strict=True):
        if isinstance(cls, type):
            for name in dir(cls):
                owners.setdefault(name, label)
    _owners_cache = (found, owners)  # one assignment: threads see the old or the new pair
    return owners


def call_refusal(name: str) -> str | None:
    """Why a path may not call a method named ``name`` (rule 1 of NOTE [path calls]); ``None`` when it may.

    Examples:
        >>> call_refusal("fn") is None, call_refusal("get_submodule") is None
        (True, True)
        >>> call_refusal("train").split(",")[0], call_refusal("zero_").split(";")[0]
        ('it is a torch.nn.Module method', "names ending in '_' are in-place operations by convention")
    """
    if name in READ_ONLY:
        return None
    if name.endswith("_"):
        return f"names ending in '_' are in-place operations by convention; {_ALLOWED_HINT}"
    owner = _owners().get(name)
    if owner is None:
        return None
    return (
        f"it is a {owner} method, and that API can change the model "
        f"(refused by name, also where a class overrides it); {_ALLOWED_HINT}"
    )


class CallRefused(Exception):
    """A call a path may not make; the message says why (wrapped in a ``PathError`` by ``_paths``)."""


_MISSING = object()


def _class_attribute(cls: type, name: str) -> tuple[type, Any] | None:
    """``(defining class, raw attribute)`` of ``name`` along ``cls``'s MRO, without running descriptors."""
    for klass in cls.__mro__:
        namespace = vars(klass)
        if name in namespace:
            return klass, namespace[name]
    return None


def _describe(value: Any) -> str:
    if isinstance(value, type):
        return "a class"
    func = value.__func__ if inspect.ismethod(value) else value
    if inspect.isfunction(func):
        return f"{func.__qualname__!r}, defined in {func.__module__}"
    return f"a {type_name(value)}"


def _decide(cls: type, name: str, found: tuple[type, Any] | None) -> str | None:
    """Rules 2-3 of NOTE [path calls] for an instance of ``cls``; ``None`` when the call is allowed."""
    if found is None:
        methods = [n for n in dir(cls) if not n.startswith("_")]
        close = difflib.get_close_matches(name, methods, n=3)
        hint = f" (nearest: {close})" if close else ""
        return f"{cls.__name__} has no method {name!r}{hint}; {_ALLOWED_HINT}"
    owner, raw = found
    func = raw.__func__ if isinstance(raw, staticmethod | classmethod) else raw
    if not inspect.isfunction(func):
        return f"{owner.__qualname__}.{name} is {_describe(raw)}, not a method; {_ALLOWED_HINT}"
    if name in READ_ONLY:
        return None
    library = library_of(func)
    if library is not None:
        return (
            f"{func.__qualname__!r} is library code (defined in {library}), not a method your own "
            f"module class defines; {_ALLOWED_HINT}"
        )
    return None


# class -> name -> (the raw class attribute decided for, refusal or None); NOTE [path calls]
_DECISIONS: weakref.WeakKeyDictionary[type, dict[str, tuple[object, str | None]]] = weakref.WeakKeyDictionary()
_DECISIONS_LOCK = threading.Lock()


def _class_refusal(cls: type, name: str) -> tuple[Any, str | None]:
    """``(raw class attribute, refusal)`` of rules 2-3 for an instance of ``cls``, cached."""
    found = _class_attribute(cls, name)
    raw = _MISSING if found is None else found[1]
    with _DECISIONS_LOCK:
        cached = _DECISIONS.get(cls, {}).get(name)
    if cached is not None and cached[0] is raw:
        return raw, cached[1]
    why = _decide(cls, name, found)
    with _DECISIONS_LOCK:
        _DECISIONS.setdefault(cls, {})[name] = (raw, why)
    return raw, why


def checked_method(receiver: Any, name: str) -> Callable[..., Any]:
    """``receiver.name`` as its class defines it, if a path may call it (rules 2-3 of NOTE [path calls]).

    The name rule (`call_refusal`) is checked separately, for the whole path first.

    Raises:
        CallRefused: the receiver is not an ``nn.Module``, the name is set on the
            instance or missing, or the class's attribute is not a function the user wrote
            (nor one of `READ_ONLY`).
    """
    if not isinstance(receiver, nn.Module):
        raise CallRefused(f"its receiver is a {type_name(receiver)}, not an nn.Module; {_ALLOWED_HINT}")
    own = vars(receiver)
    if name in own:
        raise CallRefused(
            f"{name!r} is set on this {type(receiver).__name__} object ({_describe(own[name])}), "
            f"not a method its class defines; {_ALLOWED_HINT}"
        )
    for kind, children in (("submodule", receiver._modules), ("parameter", receiver._parameters),
                           ("buffer", receiver._buffers)):
        if name in children:
            raise CallRefused(f"{name!r} is a {kind}, not a method; {_ALLOWED_HINT}")
    raw, why = _class_refusal(type(receiver), name)
    if why is not None:
        raise CallRefused(why)
    bound: Callable[..., Any] = raw.__get__(receiver, type(receiver))
    return bound


def later_call_refusal(root: Any, name: str) -> str | None:
    """Why a call whose receiver comes from an earlier call may not be made, checked before
    anything runs (NOTE [path calls]); ``None`` when some module class of ``root`` allows it."""
    if name in READ_ONLY:
        return None
    classes = {type(m) for m in root.modules()} if isinstance(root, nn.Module) else set()
    if any(_class_refusal(cls, name)[1] is None for cls in classes):
        return None
    return (
        f"no module class of this model defines {name!r} as its own method, and this call's receiver "
        f"is known only once an earlier call has run, so it is refused before any call runs; {_ALLOWED_HINT}"
    )
