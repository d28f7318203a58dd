"""What a method works out about a model once, served again while the model is unchanged."""

# NOTE [plans per model]
# A walk over a chain (NOTE [chains]) asks the same questions of the model at every
# call: is it a hook-free chain, which rule sits where, how each module runs, are its
# modes fit for an attribution. The answers (a *plan*) depend on the model's structure
# and attributes only, not on the params or the inputs, and asking them again cost about
# a third of a call on small models. So a plan is kept per model (held weakly: a plan
# never keeps its model alive) and per key (the method, and its rules where they are a
# value), together with a `Snapshot` of everything it may depend on; each call checks
# the snapshot first (a few C-level comparisons per module) and builds a new plan where
# anything changed:
#
# - per module: its class; its attribute names, in order; each attribute's value by
#   identity (the values are held, so no identity is reused); the contents of its
#   parameter and buffer slots (names, and whether each holds a tensor, a Parameter or
#   None: the params given to a call are checked against the slots' shapes at each call)
#   and of its children (by identity); hooks, a module's or torch's global ones, make
#   no snapshot at all (a hooked model takes the general path anyway);
# - a model holding anything but numbers, strings, ``None``, tuples of them, dtypes and
#   devices as attributes (a tensor, a list, a function, an object) gets no snapshot
#   either: its plan is built at every call, as if there were no cache. So only values
#   that cannot refer to the model are held, and no mutable one is trusted.
#
# A ``.data`` assignment changes a parameter's shape without touching its module, which
# is why shapes are checked per call, never planned. The cache is bounded per model.

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from operator import is_, itemgetter
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.modules import module as module_globals

from ._shadow_node import GLOBAL_HOOK_DICTS, HOOK_DICTS

__all__ = ["Snapshot", "plan_for"]

_T = TypeVar("_T")
_SLOTS = ("_parameters", "_buffers", "_modules")
# the hooks a call runs; the others (``..._with_kwargs``, ``..._always_called``) only mark entries of these
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_MARKS = tuple(name for name in HOOK_DICTS if name not in _HOOKS)
_SCALARS = (bool, int, float, complex, str, type(None), torch.dtype, torch.device)
_PLANS_PER_MODEL = 16
_plans: weakref.WeakKeyDictionary[nn.Module, dict[Hashable, tuple[Snapshot | None, Any]]] = (
    weakref.WeakKeyDictionary())
_lock = threading.Lock()


def _held(value: Any) -> bool:
    """Whether ``value`` may be held and compared by identity: it cannot refer to the model, nor change."""
    return isinstance(value, _SCALARS) or (type(value) in (tuple, torch.Size) and all(_held(v) for v in value))


def _global_hooks() -> bool:
    return any(map(bool, map(vars(module_globals).get, GLOBAL_HOOK_DICTS)))


def _contents(dicts: Any) -> tuple[Any, ...]:
    """What a plan sees of a module's slots: parameter and buffer names and kinds, children, and any hook."""
    params, buffers, children, *hooks = dicts
    return (*params, None, *map(type, params.values()), None, *buffers, None, *map(type, buffers.values()),
            None, *children, None, *map(id, children.values()), any(hooks))


# One module's state when the snapshot was taken: (weak reference, class, attribute names, a picker of the held
# values and the values, a picker of the slots and their contents). A plain tuple: `Snapshot.holds` unpacks it.
_Module = tuple[Callable[[], Any], type, tuple[str, ...], Callable[[Any], Any], tuple[Any, ...],
                Callable[[Any], Any], tuple[Any, ...]]


def _module(module: nn.Module, values: list[Any], positions: list[int], dict_positions: list[int]) -> _Module:
    state = module.__dict__
    pick_dicts = itemgetter(*dict_positions)
    # (-1 twice: a tuple even for no held value, the two sentinels appended to the values)
    return (weakref.ref(module), type(module), tuple(state), itemgetter(*positions, -1, -1), (*values, None, None),
            pick_dicts, _contents(pick_dicts(tuple(state.values()))))


class Snapshot:
    """What a plan of a model may depend on (NOTE [plans per model]); `holds` says whether it still does."""

    __slots__ = ("modules",)

    def __init__(self, modules: list[_Module]):
        self.modules = modules

    @staticmethod
    def of(model: nn.Module) -> Snapshot | None:
        """The model's snapshot; ``None`` where it holds what a snapshot cannot follow, or hooks."""
        if _global_hooks():
            return None
        taken = []
        for module in model.modules():
            state = module.__dict__
            if any(child is model for child in state.get("_modules", {}).values()):
                return None  # (a module graph with a cycle: its plan would keep the model alive)
            if any(state.get(name) for name in HOOK_DICTS) or "forward" in state:
                return None
            names = list(state)
            if any(name not in state for name in (*_SLOTS, *HOOK_DICTS)):
                return None  # (not a module as nn.Module builds it)
            dict_positions = [names.index(name) for name in (*_SLOTS, *_HOOKS)]
            skipped = {names.index(name) for name in _MARKS}
            positions, values = [], []
            for i, (name, value) in enumerate(state.items()):
                if i in dict_positions or i in skipped or name in _IGNORED:
                    continue
                if not _held(value):
                    return None
                positions.append(i)
                values.append(value)
            taken.append(_module(module, values, positions, dict_positions))
        return Snapshot(taken)

    def holds(self) -> bool:
        """Whether the model is as it was when the snapshot was taken (as far as a plan can see)."""
        if _global_hooks():
            return False
        for ref, cls, keys, pick_held, held, pick_dicts, contents in self.modules:
            module = ref()
            if module is None or type(module) is not cls:
                return False
            state = module.__dict__
            values = (*state.values(), None)
            if tuple(state) != keys or not all(map(is_, pick_held(values), held)):
                return False
            if _contents(pick_dicts(values)) != contents:
                return False
        return True


# what no forward reads: state-dict hooks and the names of non-persistent buffers
_IGNORED = frozenset({"_non_persistent_buffers_set", "_state_dict_hooks", "_state_dict_pre_hooks",
                      "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"})


def plan_for(model: nn.Module, key: Hashable, build: Callable[[], _T]) -> _T:
    """``build()``'s plan for ``model`` and ``key``, built once and served while the model is unchanged.

    ``key`` says what else the plan depends on (the method, its rules), by value. A
    model without a snapshot (NOTE [plans per model]) gets a new plan at every call.
    """
    plans = _plans.get(model)
    entry = None if plans is None else plans.get(key)
    if entry is not None and entry[0] is not None and entry[0].holds():
        return entry[1]  # type: ignore[no-any-return]
    snapshot = Snapshot.of(model)  # (before building: a plan never sees a later state than its snapshot)
    plan = build()
    if snapshot is not None:
        with _lock:
            plans = _plans.setdefault(model, {})
            if len(plans) >= _PLANS_PER_MODEL and key not in plans:
                plans.clear()
            plans[key] = (snapshot, plan)
    return plan
