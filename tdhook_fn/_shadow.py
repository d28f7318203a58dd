"""Private structural copies of a model, so that calls never touch the model itself.

# NOTE [shadow modules]
``torch.func.functional_call`` swaps tensors on the module it is given while it runs: two
threads calling one model with different parameters see each other's tensors, and an
exception at the wrong time leaves the model changed. Instead every call runs on a
*shadow*: an instance of each submodule's class whose ``__dict__`` is refreshed from the
original's before each call, except for its own ``_parameters``, ``_buffers``, ``_modules``
and hook dictionaries. The caller's tensors are put in the shadow's slots for the duration
of the call and removed afterwards. Shadows are pooled per model; one shadow serves one
call at a time, so hooks registered on it by taps are invisible to every other call.
A change to the model's structure (a submodule or parameter replaced or added) is seen
at the next call, which then builds a new shadow; mode flags and other attributes
(``training``, ``dropout.p``) are read from the model on every call.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ._params import Key

__all__ = ["Shadow", "shadow_of"]

# Hook dictionaries a forward consults; the shadow gets its own copies.
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)
_POOL_SIZE = 16


class _Node:
    """One original module, its shadow and the shadow's own state."""

    __slots__ = ("children", "original", "own", "shadow", "tensor_ids")

    def __init__(self, original: dict[str, Any], shadow: nn.Module, own: dict[str, Any]):
        self.original = original  # the original's __dict__: no reference to the module itself
        self.shadow = shadow
        self.own = own
        self.children = dict(original["_modules"])
        self.tensor_ids = _tensor_ids(original)

    def is_current(self) -> bool:
        original = self.original
        return original["_modules"] == self.children and _tensor_ids(original) == self.tensor_ids

    def refresh(self) -> None:
        state = self.shadow.__dict__
        state.clear()
        state.update(self.original)
        own = self.own
        for name in _HOOK_DICTS:  # the model's own hooks still run, on a private copy
            theirs, ours = self.original.get(name), own[name]
            if theirs or ours:
                ours.clear()
                ours.update(theirs or {})
        state.update(own)


def _tensor_ids(state: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    return tuple((n, id(t)) for d in (state["_parameters"], state["_buffers"]) for n, t in d.items())


class Shadow:
    """A private copy of a model's module tree with empty tensor slots.

    Use :func:`shadow_of` to borrow one.
    """

    def __init__(self, model: nn.Module):
        self.nodes: list[_Node] = []
        self.by_id: dict[int, nn.Module] = {}  # id(original submodule) -> shadow
        self.root = self._copy(model)
        self.slots: list[tuple[dict[str, Any], str, Key]] = []
        self.own_slots: list[tuple[dict[str, Any], dict[str, Any], str]] = []
        self.keys: set[Key] = set()
        canonical: dict[int, Key] = {}
        for prefix, module in model.named_modules(remove_duplicate=False):
            shadow = self.by_id[id(module)]
            for kind in ("_parameters", "_buffers"):
                for name, tensor in module.__dict__[kind].items():
                    if tensor is None:
                        continue
                    key = canonical.setdefault(id(tensor), tuple(f"{prefix}.{name}".lstrip(".").split(".")))
                    self.keys.add(key)
                    self.slots.append((shadow.__dict__[kind], name, key))
                    self.own_slots.append((shadow.__dict__[kind], module.__dict__[kind], name))

    def _copy(self, module: nn.Module) -> nn.Module:
        if id(module) in self.by_id:  # a submodule used twice keeps one shadow
            return self.by_id[id(module)]
        shadow = type(module).__new__(type(module))
        self.by_id[id(module)] = shadow
        state = module.__dict__
        own: dict[str, Any] = {
            "_parameters": {n: None for n in state["_parameters"]},
            "_buffers": {n: None for n in state["_buffers"]},
            "_modules": {n: None if m is None else self._copy(m) for n, m in state["_modules"].items()},
        }
        own.update((name, OrderedDict()) for name in _HOOK_DICTS)
        shadow.__dict__.update(state)
        shadow.__dict__.update(own)
        self.nodes.append(_Node(state, shadow, own))
        return shadow

    def is_current(self) -> bool:
        return all(node.is_current() for node in self.nodes)

    def refresh(self) -> None:
        for node in self.nodes:
            node.refresh()

    def load(self, values: dict[Key, torch.Tensor]) -> None:
        """Put ``values`` in the slots; the keys must be exactly the model's."""
        if len(values) != len(self.keys) or not self.keys.issuperset(values):
            _raise_key_mismatch(self.keys, set(values))
        for slots, name, key in self.slots:
            slots[name] = values[key]

    def load_own(self) -> None:
        """Put the model's own tensors in the slots (live: gradients and in-place updates reach it)."""
        for slots, theirs, name in self.own_slots:
            slots[name] = theirs[name]

    def unload(self) -> None:
        for slots, name, _ in self.slots:
            slots[name] = None

    def module_for(self, original: Any, path: str) -> nn.Module:
        shadow = self.by_id.get(id(original))
        if shadow is None:
            raise ValueError(
                f"path {path!r} resolves to a {type(original).__name__}, not to a submodule of "
                "the model that its forward calls"
            )
        return shadow


def _raise_key_mismatch(expected: set[Key], given: set[Key]) -> None:
    def names(keys: set[Key]) -> list[str]:
        return sorted(".".join(k) for k in keys)

    missing, extra = names(expected - given), names(given - expected)
    raise ValueError(f"params do not match the model: missing {missing}, unexpected {extra}")


_pools: weakref.WeakKeyDictionary[nn.Module, list[Shadow]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


@contextmanager
def shadow_of(model: nn.Module) -> Iterator[Shadow]:
    """Borrow a refreshed shadow of ``model`` for one call; it is cleared on return."""
    with _lock:
        pool = _pools.get(model)
        if pool is None:
            pool = _pools[model] = []
        shadow = pool.pop() if pool else None
    if shadow is None or not shadow.is_current():
        shadow = Shadow(model)
    shadow.refresh()
    try:
        yield shadow
    finally:
        shadow.unload()
        with _lock:
            if len(pool) < _POOL_SIZE:
                pool.append(shadow)
