"""The hooks that run with a module, as part of its fingerprint (NOTE [job fingerprints]).

A forward hook or pre-hook changes what a model computes without touching its parameters,
and so does torch's global module hooks and accelerate's ``_hf_hook`` (its ``pre_forward``
and ``post_forward`` wrap the module's forward). Each hook is described as the function
it is; a hook object by its attributes and its class's hook methods. Hook dictionaries
are read in order, without their keys: those are handle ids, another number in each run.

accelerate's hooks record where tensors live as they run (``input_device``) and key their
tied weights by memory address (``tied_params_map``): those attributes say nothing about
what is computed and would make every run another job, so they are left out.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.modules import module as torch_module

__all__ = ["global_hooks", "module_hooks"]

Json = Any
Describe = Callable[[object, int, set[int]], Json]

# Each hook dictionary with the flag dictionaries, keyed like it, that say how its hooks are called.
_TABLES = (
    ("_forward_pre_hooks", ("_forward_pre_hooks_with_kwargs",)),
    ("_forward_hooks", ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")),
    ("_backward_pre_hooks", ()),
    ("_backward_hooks", ()),
)
_HOOK_PARTS = ("__call__", "pre_forward", "post_forward", "no_grad")
_ACCELERATE_RUNTIME = frozenset({"input_device", "tied_params_map", "tied_pointers_to_remove"})


def module_hooks(module: nn.Module, describe: Describe, depth: int, seen: set[int]) -> Json:
    """The hooks ``module`` itself holds: its hook dictionaries and accelerate's ``_hf_hook``."""
    state = vars(module)
    described = _tables(state.get, describe, depth, seen)
    if state.get("_backward_hooks"):  # old-style or full: how they are called
        described.append(["full backward", state.get("_is_full_backward_hook")])
    if state.get("_hf_hook") is not None:
        described.append(["_hf_hook", _hook(state["_hf_hook"], describe, depth, seen)])
    return described


def global_hooks(describe: Describe, depth: int, seen: set[int]) -> Json:
    """torch's global module hooks (``register_module_forward_hook`` ...), which run with every module."""
    table = vars(torch_module)
    described = _tables(lambda name: table.get(f"_global{name}"), describe, depth, seen)
    if table.get("_global_backward_hooks"):
        described.append(["full backward", table.get("_global_is_full_backward_hook")])
    return described


def _tables(get: Callable[[str], Any], describe: Describe, depth: int, seen: set[int]) -> list[Json]:
    described = []
    for name, flag_names in _TABLES:
        hooks = get(name) or {}
        flags = [get(flag) or {} for flag in flag_names]
        if hooks:
            described.append([name, [[_hook(hook, describe, depth, seen), *(key in f for f in flags)]
                                     for key, hook in hooks.items()]])
    return described


def _hook(hook: object, describe: Describe, depth: int, seen: set[int]) -> Json:
    """A function as a function; an object by its attributes and its class's hook methods (their code)."""
    if isinstance(hook, (types.FunctionType, types.MethodType, functools.partial)):
        return describe(hook, depth, seen)
    parts = [[name, describe(part, depth - 1, seen)] for name in _HOOK_PARTS
             if (part := _class_attribute(type(hook), name)) is not None]
    if not isinstance(getattr(hook, "__dict__", None), dict):
        return {"object": describe(hook, depth, seen), "class": parts}
    attrs = dict(vars(hook))
    if any(cls.__module__.startswith("accelerate.") for cls in type(hook).__mro__):
        attrs = {k: v for k, v in attrs.items() if k not in _ACCELERATE_RUNTIME}
    inner = attrs.pop("hooks", None) if isinstance(attrs.get("hooks"), (list, tuple)) else None  # a SequentialHook
    return {"hook": describe(type(hook), depth, seen), "class": parts, "attrs": describe(attrs, depth - 1, seen),
            "hooks": [_hook(h, describe, depth - 1, seen) for h in inner or ()]}


def _class_attribute(cls: type, name: str) -> object:
    """``name`` as the class (not ``object``) defines it, without binding it; None if it does not."""
    for base in cls.__mro__[:-1]:
        if name in vars(base):
            return vars(base)[name]
    return None
