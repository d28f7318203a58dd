"""Which calls a submodule path may make: the rule of NOTE [safe paths] in ``_paths.py``.

A call step ``name(...)`` is refused by its *name*, before anything in the path runs, when
``name`` is part of an API that can change a model: anything defined on ``torch.nn.Module``
and its containers, on every module class ``torch.nn`` and ``tensordict.nn`` export, on
``torch.Tensor``, on tensordict's ``TensorDictBase``, and on transformers'
``PreTrainedModel`` and ``GenerationMixin`` (with all their mixins) once transformers has
been imported; and any name ending in ``_``. `READ_ONLY` names stay callable. The
object a call step reaches is checked again when it is called: it must be a Python
function or method, neither named by the rule nor defined in torch, tensordict or
transformers (this catches aliases such as ``self.fn = self.train``).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Mapping
from typing import Any

import tensordict
import tensordict.nn as tdnn
import torch
from torch import nn

__all__ = ["READ_ONLY", "call_refusal", "callable_refusal"]

# nn.Module lookups that only read; the one exception to the name rule.
READ_ONLY = frozenset({"get_submodule", "get_parameter", "get_buffer"})

_ALLOWED_HINT = "paths may call only your own methods that return a submodule, and " + ", ".join(sorted(READ_ONLY))

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

_LIBRARIES = ("torch", "tensordict", "transformers")


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
    """Why a path may not call a method named ``name``; ``None`` when it may.

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


def callable_refusal(fn: Any) -> str | None:
    """Why the object a call step reached may not be called; ``None`` when it may."""
    func = fn.__func__ if inspect.ismethod(fn) else fn
    if not inspect.isfunction(func):
        kind = "class" if isinstance(fn, type) else type(fn).__name__
        return f"only Python functions and methods may be called, not a {kind}; {_ALLOWED_HINT}"
    name = func.__name__
    if name in READ_ONLY:
        return None
    why = call_refusal(name)
    if why is not None:
        return f"it is {func.__qualname__!r}: {why}"
    module = func.__module__ or ""
    if module.partition(".")[0] in _LIBRARIES:
        return f"{func.__qualname__!r} is defined in {module}; {_ALLOWED_HINT}"
    return None
