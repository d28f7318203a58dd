"""Stable descriptions of a job's arguments, to tell whether an ``out_dir`` is this job's.

# NOTE [job fingerprints]
An ``out_dir`` written by one job must never be silently reused by another, so each
argument of :func:`~tdhook_fn.data.attribute` is reduced to a JSON value that is the
same in every process and every run of the same script, and differs when the argument
does: tensors by the SHA-256 of their bytes (plus dtype and shape), functions by their
qualified name, bytecode, constants, defaults and closure (so ``label("y")`` and
``label("z")`` differ), partials and bound methods by their parts, modules by the class and
plain attributes of every submodule and the values of their tensors (a module a target
closes over computes with its own), other objects by their class and attributes. Nothing here uses ``id`` or
``repr`` with an address, which change between runs.
"""

from __future__ import annotations

import functools
import hashlib
import types
from collections.abc import Mapping
from typing import Any, cast

import torch
from tensordict import TensorDictBase
from torch import nn

from .._rebind import filled

__all__ = ["fingerprint", "tensor_digest"]

Json = Any
_DEPTH = 12  # Functional -> taps -> Tap -> fn -> closure -> ... : deep enough for closures over taps


def tensor_digest(t: torch.Tensor) -> str:
    """The SHA-256 of a tensor's dtype, shape and bytes."""
    data = t.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous()
    h = hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode())
    if data.numel():
        h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fingerprint(obj: object) -> Json:
    """A JSON value that describes ``obj`` the same way in every run (see the NOTE)."""
    return _fp(obj, _DEPTH, set())


def _fp(obj: object, depth: int, seen: set[int]) -> Json:
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return {"float": repr(obj)}
    if isinstance(obj, torch.Tensor):
        return {"tensor": tensor_digest(obj)}
    if isinstance(obj, (torch.dtype, torch.device, torch.Size, slice, range)):
        return {type(obj).__name__: str(obj)}
    if depth <= 0 or id(obj) in seen:
        return {"type": _name(type(obj))}
    seen = seen | {id(obj)}
    if isinstance(obj, TensorDictBase):
        leaves = sorted(obj.items(True, True), key=lambda kv: str(kv[0]))
        return {"tensordict": [[str(k), tensor_digest(cast(torch.Tensor, v))] for k, v in leaves]}
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
    if isinstance(obj, (type, types.ModuleType, types.BuiltinFunctionType)):
        return {"name": _name(obj)}
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        return {"object": _name(type(obj)), "attrs": _fp(attrs, depth - 1, seen)}
    return {"type": _name(type(obj))}


def _module(module: nn.Module, depth: int, seen: set[int]) -> Json:
    """Every submodule's class and plain attributes (``negative_slope``, ``eps``, ``training``), and the
    tensors' values: a module closed over by a target or a baseline computes with its own."""
    parts = []
    for name, sub in module.named_modules(remove_duplicate=False):
        attrs = {k: v for k, v in vars(sub).items() if not k.startswith("_")}
        parts.append([name, _name(type(sub)), _fp(attrs, depth - 1, seen | {id(sub)})])
    state = [[k, tensor_digest(v)] for k, v in module.state_dict(keep_vars=True).items()]
    return {"module": parts, "state": state}


def _function(fn: types.FunctionType, depth: int, seen: set[int]) -> Json:
    cells = [c.cell_contents if filled(c) else None for c in fn.__closure__ or ()]
    return {
        "function": _name(fn),
        "code": _code(fn.__code__),
        "defaults": _fp(fn.__defaults__, depth - 1, seen),
        "kwdefaults": _fp(fn.__kwdefaults__, depth - 1, seen),
        "closure": [_fp(c, depth - 1, seen) for c in cells],
    }


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


def _name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '') or ''}.{getattr(obj, '__qualname__', getattr(obj, '__name__', ''))}"
