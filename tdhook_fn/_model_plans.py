"""What a method works out about a model once, served again while the model is unchanged."""

# NOTE [plans per model]
# A walk over a chain (NOTE [chains]) asks the same questions of the model at every
# call: is it a hook-free chain, which rule sits where, how each module runs, are its
# modes fit for an attribution. The answers (a *plan*) depend on the model's structure
# and attributes only, not on the params or the inputs, and asking them again cost about
# a third of a call on small models. So a plan is kept per model (held weakly: a plan
# never keeps its model alive) and per key (the method, and its rules where they are a
# value), together with a `Snapshot` of everything it may depend on; each call checks
# the snapshot first (C-level comparisons over the whole model) and builds a new plan
# where anything changed:
#
# - per module: its class; its attribute names; each attribute's value by identity (the
#   values are held, so no identity is reused), except the hook containers (a forward's
#   and a state dict's), which must be empty; the contents of its
#   parameter, buffer and child slots (names in order, and each value by identity: the
#   params given to a call are checked against the slots' shapes at each call); hooks, a
#   module's or torch's global ones, make no snapshot at all (a hooked model takes the
#   general path anyway), and a hook registered later fails the check;
# - a model holding anything but numbers, strings, ``None``, tuples of them, dtypes and
#   devices as attributes (a tensor, a list, a function, an object), besides the
#   module's own slot and hook containers, or with a state-dict hook (a function that may
#   refer to the model), gets no snapshot either: its plan is built at
#   every call, as if there were no cache. So the values held cannot refer to the model,
#   and no mutable one is trusted by identity alone. The containers and the submodules
#   are held (a module taken out of the model keeps its parameters alive until the next
#   call rebuilds the plan, or the model goes).
#
# A ``.data`` assignment changes a parameter's shape without touching its module, which
# is why shapes are checked per call, never planned. The cache is bounded per model.

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from itertools import chain
from operator import call, is_, itemgetter
from typing import Any, TypeVar, cast

import torch
from torch import nn
from torch.nn.modules import module as module_globals

from ._shadow_node import GLOBAL_HOOK_DICTS, HOOK_DICTS

__all__ = ["Snapshot", "global_hooks", "hooked", "plan_for"]

# NOTE [one flat check]
# `Snapshot.holds` runs at every call, inside a call whose tensors have just pushed the
# model's objects out of the caches; what it costs is mostly the objects it touches. So
# it reads each module's attribute dict once and the slot dicts it holds, with C-level
# maps, and never looks into a value (identity only). Why it misses no change a plan sees:
# - the modules are the snapshot's (the model by a weak reference, the submodules held);
#   their types are compared first (a model gone reads NoneType);
# - each module's attributes are counted, and every name it had is read again (a missing
#   one raises): an attribute added, removed, or one removed and another added is seen
#   (the order of a module's attributes changes nothing);
# - the values of all its attributes but the hook containers are compared by identity,
#   the slots among them: so the slot dicts held are the module's own, and
#   their sizes, names in order and values by identity say that each slot is as it was
#   (sizes per dict: an entry moved from one module's slot to another's keeps the flat
#   names and values); the children being the same, so is the model's list of modules;
# - the hook containers, those a call runs and the state dict's, are read from the
#   module's attributes at each call and must be empty (a container replaced by a full
#   one counts too), torch's global ones from its module.

_T = TypeVar("_T")
_SLOTS = ("_parameters", "_buffers", "_modules")
# a module's own containers, allowed in a snapshot's model though mutable: the slots are checked by content, the
# hook containers read empty, the names of non-persistent buffers (which no forward reads) held by identity only
_CONTAINERS = frozenset({*_SLOTS, *HOOK_DICTS, "_non_persistent_buffers_set", "_state_dict_hooks",
                         "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"})
# what no forward reads, but where a function (a state-dict hook) may refer to the model: held by the snapshot's
# submodules, it would keep the model alive through the cache, so a model with any gets no snapshot
_UNREAD_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                 "_load_state_dict_post_hooks")
_SCALARS = (bool, int, float, complex, str, type(None), torch.dtype, torch.device)
_PLANS_PER_MODEL = 16
_plans: weakref.WeakKeyDictionary[nn.Module, dict[Hashable, tuple[Snapshot | None, Any]]] = (
    weakref.WeakKeyDictionary())
_lock = threading.Lock()
_torch_globals = vars(module_globals)
_slots_of = itemgetter(*_SLOTS)
# every hook container, read at each call: all empty in a snapshot's model (a mark is set with its hook)
_EMPTY = (*HOOK_DICTS, *_UNREAD_HOOKS)
_empties_of = itemgetter(*_EMPTY)
_DICTS = (dict, OrderedDict)


def _held(value: Any) -> bool:
    """Whether ``value`` may be held and compared by identity: it cannot refer to the model, nor change."""
    return isinstance(value, _SCALARS) or (type(value) in (tuple, torch.Size) and all(_held(v) for v in value))


def global_hooks() -> bool:
    """Whether any global module hook (``torch.nn.modules.module.register_module_*_hook``) is registered."""
    return any(map(_torch_globals.get, GLOBAL_HOOK_DICTS))  # (an empty dict is false)


def hooked(module: nn.Module) -> bool:
    """Whether ``module`` holds hooks of its own (any of torch's hook dicts on it not empty)."""
    state = vars(module)
    return any(state.get(name) for name in HOOK_DICTS)


def _flat(dicts: Iterable[dict[Any, Any]]) -> Iterator[Any]:
    return chain.from_iterable(map(dict.values, dicts))


class Snapshot:
    """What a plan of a model may depend on (NOTE [plans per model]); `holds` says whether it still does.

    The check runs at every call, so it is a few flat C-level comparisons over the whole
    model, no Python loop per module (NOTE [one flat check]).
    """

    __slots__ = ("children", "getters", "keys", "lengths", "model", "sizes", "slots", "types", "values")

    def __init__(self, modules: list[nn.Module]):
        states = list(map(vars, modules))
        self.model = weakref.ref(modules[0])
        self.children = tuple(modules[1:])  # (held: none refers to the model, see `of`)
        self.lengths = list(map(len, states))
        # every name but the hook containers' (read by `_empties_of`), so that no name can go unnoticed
        self.getters = tuple(itemgetter(*(name for name in state if name not in _EMPTY)) for state in states)
        self.slots = tuple(chain.from_iterable(map(_slots_of, states)))
        self.sizes = tuple(map(len, self.slots))
        self.keys = tuple(chain.from_iterable(self.slots))
        self.types = tuple(map(type, modules))
        self.values = (*chain.from_iterable(map(call, self.getters, states)), *_flat(self.slots))

    @staticmethod
    def of(model: nn.Module) -> Snapshot | None:
        """The model's snapshot; ``None`` where it holds what a snapshot cannot follow, or hooks."""
        if global_hooks():
            return None
        modules = list(model.modules())
        for module in modules:
            state = vars(module)
            if any(name not in state for name in (*_SLOTS, *_EMPTY)) or "forward" in state:
                return None  # (not a module as nn.Module builds it, or an instance forward)
            if not all(type(state[name]) in _DICTS for name in _SLOTS):
                return None  # (a slot replaced by a mapping of another kind: its contents are not followed)
            # hooks (a state-dict hook may refer to the model: held, it would keep the model alive); or a cycle,
            # whose plan would keep the model alive
            if any(_empties_of(state)) or any(child is model for child in state["_modules"].values()):
                return None
            if not all(name in _CONTAINERS or _held(value) for name, value in state.items()):
                return None
        return Snapshot(modules)

    def holds(self) -> bool:
        """Whether the model is as it was when the snapshot was taken (as far as a plan can see)."""
        if global_hooks():
            return False
        modules = (self.model(), *self.children)
        if tuple(map(type, modules)) != self.types:  # (the model gone reads NoneType)
            return False
        states = list(map(vars, modules))
        if list(map(len, states)) != self.lengths:
            return False
        try:  # (the names: as many as then, each of then still there, by the getters)
            # a hook; or a state-dict hook added since (held, it could keep the model alive)
            if any(chain.from_iterable(map(_empties_of, states))):
                return False
            values = chain(chain.from_iterable(map(call, self.getters, states)), _flat(self.slots))
            return (tuple(map(len, self.slots)) == self.sizes and tuple(chain.from_iterable(self.slots)) == self.keys
                    and all(map(is_, values, self.values)))
        except KeyError:
            return False



def plan_for(model: nn.Module, key: Hashable, build: Callable[[], _T]) -> _T:
    """``build()``'s plan for ``model`` and ``key``, built once and served while the model is unchanged.

    ``key`` says what else the plan depends on (the method, its rules), by value. A
    model without a snapshot (NOTE [plans per model]) gets a new plan at every call.
    """
    plans = _plans.get(model)
    entry = None if plans is None else plans.get(key)
    if entry is not None and entry[0] is not None and entry[0].holds():
        return cast("_T", entry[1])
    snapshot = Snapshot.of(model)  # (before building: a plan never sees a later state than its snapshot)
    plan = build()
    with _lock:
        if snapshot is None:  # (the stale entry goes: it holds submodules, and through them what was added since)
            if plans is not None:
                plans.pop(key, None)
            return plan
        plans = _plans.setdefault(model, {})
        if len(plans) >= _PLANS_PER_MODEL and key not in plans:
            plans.clear()
        plans[key] = (snapshot, plan)
    return plan
