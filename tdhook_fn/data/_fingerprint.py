"""Stable descriptions of a job's arguments, to tell whether an ``out_dir`` is this job's."""

# NOTE [job fingerprints]
# An ``out_dir`` written by one job must never be silently reused by another, so each
# argument of `attribute` is reduced to a JSON value that is the
# same in every process and every run of the same script, and differs when anything the
# numbers depend on does:
#
# - tensors, numpy arrays and what numpy reads through ``__array__``: the SHA-256 of their
#   dtype, shape and bytes;
# - functions: qualified name, bytecode, constants, defaults, closure (so ``label("y")``
#   and ``label("z")`` differ) and the values of the module globals their code names (so a
#   target reading ``CLASS`` changes with ``CLASS = 2``), followed into the functions they
#   call; partials and bound methods by their parts;
# - modules: the class and plain attributes of every submodule, the values of its tensors
#   (a module a target closes over computes with its own), and the hooks that run with it
#   (``_fingerprint_hooks``);
# - other objects: their class and attributes (``__dict__`` and ``__slots__``), or, with
#   neither, what pickle stores of them (``Decimal``, ``itemgetter``, ``torch.Generator``).
#   An object that cannot be described is an error naming its type: left out, a change to
#   it would return old rows.
#
# Named only, on purpose: modules, classes and builtins (a library's code and state are its
# version's; the code of a class's methods, a module's ``forward`` included, is not followed:
# a changed class needs a new ``out_dir``); the globals of functions of tdhook_fn, the
# standard library and installed packages (their module state is the library's: caches,
# registries); loggers and locks (machinery around the numbers; a logger's state is the
# whole process's); anything past ``_DEPTH`` levels or met again on its own path.
#
# A function's changing state is part of it too: a method appending to a global list is
# another job at each run; keep such state in a file or a module's attribute. Nothing here
# uses ``id`` or ``repr`` with an address, which change between runs.

from __future__ import annotations

import copyreg
import functools
import hashlib
import logging
import os
import sys
import threading
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from tensordict import TensorDictBase
from torch import nn

from .._rebind import filled
from ._digest import array_digest, tensor_digest
from ._fingerprint_hooks import global_hooks, module_hooks

__all__ = ["Json", "fingerprint"]

Json = Any
_DEPTH = 12  # Functional -> taps -> Tap -> fn -> closure -> ... : deep enough for closures over taps
_MACHINERY: tuple[type, ...] = (logging.Logger, logging.LoggerAdapter, logging.Handler, type(threading.Lock()),
                                type(threading.RLock()), threading.Condition, threading.Event, threading.Thread)
_INSTALLED = frozenset({"site-packages", "dist-packages"})
_NOT_ARRAYS = (TensorDictBase, nn.Module)  # described by their own rules, whatever numpy makes of them
_PLAIN = (torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format, slice, range)


def fingerprint(obj: object) -> Json:
    """A JSON value that describes ``obj`` the same way in every run (see the NOTE).

    Raises:
        TypeError: ``obj`` holds an object that can be described neither by its attributes
            nor by what pickle stores of it (a generator, a weak reference).
    """
    return _fp(obj, _DEPTH, set())


def _fp(obj: object, depth: int, seen: set[int]) -> Json:
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, (float, complex)):
        return {type(obj).__name__: repr(obj)}
    if isinstance(obj, (bytes, bytearray)):
        return {"bytes": hashlib.sha256(obj).hexdigest()}
    if isinstance(obj, torch.Tensor):
        return {"tensor": tensor_digest(obj)}
    if isinstance(obj, _PLAIN):
        return {type(obj).__name__: str(obj)}
    if isinstance(obj, os.PathLike):
        return {"path": str(os.fspath(obj))}
    if depth <= 0 or id(obj) in seen:
        return {"type": _name(type(obj))}
    seen = seen | {id(obj)}
    if isinstance(obj, np.ndarray) or (hasattr(type(obj), "__array__") and not isinstance(obj, _NOT_ARRAYS)):
        return _array(np.asarray(obj), depth, seen)
    if isinstance(obj, TensorDictBase):
        return {"tensordict": _leaves(obj, depth, seen)}
    if isinstance(obj, nn.Module):
        return _module(obj, depth, seen)
    if isinstance(obj, (list, tuple)):
        return {type(obj).__name__: [_fp(v, depth - 1, seen) for v in obj]}
    if isinstance(obj, (set, frozenset)):
        return {"set": sorted(str(_fp(v, depth - 1, seen)) for v in obj)}
    if isinstance(obj, Mapping):
        items = sorted(obj.items(), key=lambda kv: str(kv[0]))
        return {"mapping": [[str(k), _fp(v, depth - 1, seen)] for k, v in items]}
    if isinstance(obj, functools.partial):
        return {"partial": [_fp(obj.func, depth - 1, seen), _fp(obj.args, depth - 1, seen),
                            _fp(obj.keywords, depth - 1, seen)]}
    if isinstance(obj, types.MethodType):
        return {"method": [_fp(obj.__func__, depth - 1, seen), _fp(obj.__self__, depth - 1, seen)]}
    if isinstance(obj, types.FunctionType):
        return _function(obj, depth, seen)
    if isinstance(obj, types.CodeType):
        return {"code": _code(obj)}
    if isinstance(obj, (type, types.ModuleType, types.BuiltinFunctionType)):
        return {"name": _name(obj)}
    if isinstance(obj, _MACHINERY):
        return {"type": _name(type(obj))}
    attrs = _attributes(obj)
    if attrs is not None:
        return {"object": _name(type(obj)), "attrs": _fp(attrs, depth - 1, seen)}
    return {"object": _name(type(obj)), "pickled": _fp(_pickled(obj), depth - 1, seen)}


def _array(a: np.ndarray, depth: int, seen: set[int]) -> Json:
    if a.dtype.hasobject:  # its bytes are pointers: describe the items
        return {"array": str(a.shape), "items": _fp(a.tolist(), depth - 1, seen)}
    return {"array": array_digest(a)}


def _leaves(td: TensorDictBase, depth: int, seen: set[int]) -> Json:
    """Every leaf by key: tensors by their digest, non-tensor data (strings, objects) by value."""
    leaves = [[str(k), tensor_digest(cast(torch.Tensor, v))] for k, v in td.items(True, True)]
    leaves += [[str(k), _fp(v.tolist(), depth - 1, seen)] for k, v in td.non_tensor_items(True)]
    return sorted(leaves, key=lambda kv: cast(str, kv[0]))


def _module(module: nn.Module, depth: int, seen: set[int]) -> Json:
    """Every submodule's class, plain attributes (``negative_slope``, ``eps``, ``training``) and hooks, and
    the tensors' values (the state dict's, and the buffers it leaves out as non-persistent)."""
    parts = []
    for name, sub in module.named_modules(remove_duplicate=False):
        attrs = {k: v for k, v in vars(sub).items() if not k.startswith("_")}
        inner = seen | {id(sub)}
        parts.append([name, _name(type(sub)), _fp(attrs, depth - 1, inner), module_hooks(sub, _fp, depth - 1, inner)])
    tensors: dict[str, Any] = dict(module.state_dict(keep_vars=True))
    for key, buffer in module.named_buffers(remove_duplicate=False):
        tensors.setdefault(key, buffer)
    state = [[k, tensor_digest(v) if isinstance(v, torch.Tensor) else _fp(v, depth - 1, seen)]
             for k, v in tensors.items()]
    return {"module": parts, "state": state, "global hooks": global_hooks(_fp, depth - 1, seen)}


def _function(fn: types.FunctionType, depth: int, seen: set[int]) -> Json:
    cells = [c.cell_contents if filled(c) else None for c in fn.__closure__ or ()]
    return {
        "function": _name(fn),
        "code": _code(fn.__code__),
        "defaults": _fp(fn.__defaults__, depth - 1, seen),
        "kwdefaults": _fp(fn.__kwdefaults__, depth - 1, seen),
        "closure": [_fp(c, depth - 1, seen) for c in cells],
        "globals": _globals(fn, depth, seen),
    }


def _globals(fn: types.FunctionType, depth: int, seen: set[int]) -> Json:
    """The values of the module globals ``fn``'s code (and the code nested in it) names, for code of the user's."""
    if _library(fn):
        return []
    space = fn.__globals__
    return [[name, _fp(space[name], depth - 1, seen)] for name in sorted(_names(fn.__code__)) if name in space]


def _names(code: types.CodeType) -> set[str]:
    """Every name the code loads by name: globals, and attributes (a global of that name is read too, harmlessly)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # lambdas, nested functions, generator expressions
            names |= _names(const)
    return names


def _library(fn: types.FunctionType) -> bool:
    """Code of tdhook_fn, the standard library or an installed package: its globals are the library's state."""
    top = (fn.__module__ or "").partition(".")[0]
    return (top == "tdhook_fn" or top in sys.stdlib_module_names
            or not _INSTALLED.isdisjoint(Path(fn.__code__.co_filename).parts))


def _code(code: types.CodeType) -> str:
    h = hashlib.sha256(code.co_code)
    h.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            h.update(_code(const).encode())
        elif isinstance(const, frozenset):  # its repr's order changes with the hash seed
            h.update(repr(sorted(map(repr, const))).encode())
        else:
            h.update(repr(const).encode())
    return h.hexdigest()


def _attributes(obj: object) -> dict[str, object] | None:
    """``obj.__dict__`` and its set slots (an unset slot is left out); None when its class has neither."""
    own = getattr(obj, "__dict__", None)
    slots = [(cls, name) for cls in type(obj).__mro__ for name in _slot_names(cls)]
    if not isinstance(own, dict) and not slots:
        return None
    attrs: dict[str, object] = dict(own) if isinstance(own, dict) else {}
    for cls, name in slots:
        try:  # through the slot's descriptor: a class's own __getattr__ is not asked
            attrs[name] = cls.__dict__[name].__get__(obj, cls)
        except AttributeError:
            continue
    return attrs


def _slot_names(cls: type) -> list[str]:
    """The slots ``cls`` itself declares, as stored (``__x`` in class ``C`` is ``_C__x``)."""
    declared = cls.__dict__.get("__slots__", ())
    names = [declared] if isinstance(declared, str) else list(declared)
    return [f"_{cls.__name__.lstrip('_')}{n}" if n.startswith("__") and not n.endswith("__") else n
            for n in names if n not in ("__dict__", "__weakref__")]


def _pickled(obj: object) -> Json:
    """What pickle stores of an object without attributes: its constructor, arguments and state."""
    reducer = copyreg.dispatch_table.get(type(obj))
    try:
        reduced = reducer(obj) if reducer is not None else obj.__reduce_ex__(4)
    except Exception as e:
        raise TypeError(
            f"cannot describe a {_name(type(obj))} object: it has no __dict__ or __slots__ and pickle cannot store "
            f"it ({e}), so a change to it would go unseen. Pass what it holds instead (tensors, numbers, "
            f"containers), or give its class a __reduce__") from e
    return reduced[:3] if isinstance(reduced, tuple) else reduced  # a string: the name of a global


def _name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '') or ''}.{getattr(obj, '__qualname__', getattr(obj, '__name__', ''))}"
