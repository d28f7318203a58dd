"""Calls while ``torch.compile`` traces them: a path through the core that Dynamo can follow."""

from __future__ import annotations

import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
from torch import nn
from torch.nn.modules import module as module_globals
from torch.nn.utils.stateless import _reparametrize_module

from ._in_place import InPlaceFrames, writes_in_place
from ._params import Key
from ._paths import resolve_path
from ._shadow import (
    GLOBAL_HOOK_DICTS,
    HOOK_DICTS,
    Shadow,
    private_buffer,
    raise_key_mismatch,
    raise_shape_mismatch,
    shadow_lock,
    shape_mismatch,
)
from ._taps import Captured, Tap

__all__ = ["run_traced", "trace_constant"]


# NOTE [compiled calls]
# Under ``torch.compile`` Dynamo runs the Python of a call once, symbolically, and the
# compiled graph then only computes: nothing of the shadow machinery runs per call, so
# no call can see another's state or touch the model. The eager path cannot be traced
# (the pool's lock, ``contextmanager``, ``RemovableHandle``, ``__dict__`` surgery), so
# while compiling ``run`` takes this path instead:
#
# - ``traced_plan`` is really called, once per trace (``assume_constant_result``): it
#   refreshes a shadow kept for tracing only (one per model, never lent to eager calls)
#   and resolves the tap paths on it. Dynamo sees the result as a constant and guards
#   the model's identity. Its plain parts (slots, keys, settings) are in the constant
#   itself, not read from the stored plan: each element read from an object gets a guard
#   that every call checks (half the guards of a call on a small MLP were those);
# - the call is ``torch.nn.utils.stateless._reparametrize_module`` on that shadow (the
#   context behind ``torch.func.functional_call``, whose slot writes Dynamo traces and
#   does not replay), buffers cloned as in NOTE [pure buffers];
# - taps go straight into the shadow's own hook dicts and out again (Dynamo cannot
#   trace ``register_forward_hook``'s handle).
#
# The graph is specialised to the model as it was when traced, so the traced code reads
# what could change it and Dynamo guards on it (``state_of``):
#
# - the submodules (iterating ``model.modules()``: a replaced or added submodule re-traces);
# - every plain-valued attribute of each (``training``, ``p``, ``eps``, ``stride``, ...:
#   ``model.eval()`` or ``dropout.p = 0`` re-traces), compared with its value in the plan;
# - the identity of every other attribute the shadow shares with the model (``id()``, which
#   Dynamo guards exactly): a tensor attribute, a function, an instance ``forward`` or a
#   config object assigned anew re-traces. In-place changes need no guard: the graph reads
#   a shared tensor as an input, and a shared object's attributes through the object;
# - the attribute names of each module: one added (an instance ``forward``) re-traces;
# - the keys and hooks (by id) of every hook dict of each module and of torch's global
#   module hooks: the shadow holds a copy, so a hook added, removed or replaced re-traces.
#   (torch does not guard its own modules' hooks: ``skip_nnmodule_hook_guards``.)


@dataclass(frozen=True)
class TracePlan:
    """The modules a traced call runs, computed for real once per trace (its plain parts travel in the constant)."""

    root: nn.Module
    targets: tuple[nn.Module, ...]  # the shadows of the tapped submodules, in tap order


Slots = tuple[tuple[Key, str, bool, torch.Size | None], ...]  # key, dotted name, is buffer, shape
Settings = tuple[tuple[int, str, Any], ...]  # module index in model.modules(), attribute, value
Identities = tuple[tuple[int, str, int], ...]  # module index, attribute, id() of its value
Hooks = tuple[tuple[int, str, tuple[tuple[Any, int], ...]], ...]  # module index (-1: global), hook dict, (key, id)s
Attributes = tuple[tuple[str, ...], ...]  # the attribute names of each module
State = tuple[Settings, Identities, Hooks, Attributes]


_Setting = (bool, int, float, str, type(None))


def _is_plain(value: Any) -> bool:
    """Exactly a Python scalar (a numpy float is a float subclass, which Dynamo reads as a tensor) and equal to
    itself (not NaN: a NaN setting would never compare equal to its own value)."""
    return type(value) in _Setting and value == value


def _is_setting(value: Any) -> bool:
    """A plain value a forward may branch on (``p``, ``eps``, ``stride``, ``training``); others are guarded by id."""
    if type(value) in (tuple, list):
        return all(_is_plain(v) for v in value)
    return _is_plain(value)


# the shadow's own slots, and what only state_dict and load_state_dict read
_UNGUARDED = frozenset({*HOOK_DICTS, "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
                        "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                        "_load_state_dict_post_hooks"})


def _hook_ids(hooks: dict[Any, Any]) -> tuple[tuple[Any, int], ...]:
    """Each hook's key and id: a hook replaced under its key is another (the shadow's copy keeps the old one alive)."""
    return tuple((key, id(hook)) for key, hook in hooks.items())


def state_of(model: nn.Module) -> State:
    """What a traced call of ``model`` depends on beyond the params, for the guards of NOTE [compiled calls]."""
    settings: list[tuple[int, str, Any]] = []
    identities: list[tuple[int, str, int]] = []
    hooks: list[tuple[int, str, tuple[Any, ...]]] = [(-1, name, _hook_ids(getattr(module_globals, name)))
                                                      for name in GLOBAL_HOOK_DICTS]
    attributes: list[tuple[str, ...]] = []
    for i, module in enumerate(model.modules()):
        attributes.append(tuple(vars(module)))
        for name, value in vars(module).items():
            if name in _UNGUARDED:
                continue
            if _is_setting(value):
                settings.append((i, name, tuple(value) if isinstance(value, list) else value))
            else:
                identities.append((i, name, id(value)))
        hooks += [(i, name, _hook_ids(getattr(module, name))) for name in HOOK_DICTS]
    return tuple(settings), tuple(identities), tuple(hooks), tuple(attributes)


_this = sys.modules[__name__]
_traced: weakref.WeakKeyDictionary[nn.Module, Shadow] = weakref.WeakKeyDictionary()


_F = TypeVar("_F", bound=Callable[..., Any])


def trace_constant(fn: _F) -> _F:
    """``torch.compiler.assume_constant_result``, typed: Dynamo calls ``fn`` for real and keeps the result."""
    mark: Any = torch.compiler.assume_constant_result  # untyped in torch
    return cast(_F, mark(fn))


@trace_constant
def traced_plan(model: nn.Module, paths: tuple[str, ...]
                ) -> tuple[str, Slots, tuple[Key, ...], State]:
    """Store the plan for ``model`` and ``paths`` as a global of this module; return its name, slots, keys, state.

    The plain parts come back in the constant itself: read from the stored plan, every
    element would get a guard of its own (on top of those on the model's attributes and
    on the params), which each call would check.

    A global, read with ``getattr`` on the module, because Dynamo wraps modules reached
    from a constant badly, and snapshots a dict of plans when first read (NOTE [compiled calls]).
    """
    with shadow_lock:
        shadow = _traced.get(model)
        if shadow is None or not shadow.is_current():
            shadow = _traced[model] = Shadow(model)
        shadow.unload()  # (what the last plan's refresh filled)
        shadow.refresh()
        shadow.refuse_held()
    targets = tuple(shadow.module_for(resolve_path(model, path), path) for path in paths)
    names = {id(node.own[kind]): node.path for node in shadow.nodes for kind in ("_parameters", "_buffers")}
    slots = tuple(
        (key, f"{names[id(own)]}.{name}".lstrip("."), buffer, shape)
        for buffer, group in ((False, shadow.param_slots), (True, shadow.buffer_slots))
        for own, name, key, shape in group
    )
    name = f"_plan_{id(model)}_{len(paths)}_{abs(hash(paths))}"  # a global per model and tap paths
    if not hasattr(_this, name):
        weakref.finalize(model, _this.__dict__.pop, name, None)
    setattr(_this, name, TracePlan(shadow.root, targets))
    return name, slots, tuple(shadow.keys), state_of(model)


def _changed(attribute: str) -> None:
    raise RuntimeError(f"tdhook_fn: attribute {attribute!r} of the model changed while it was being compiled")


def _put(saved: list[tuple[nn.Module, str, Any]], module: nn.Module, kind: str, hook_id: int, hook: Any,
         after_own: bool = False) -> None:
    """``hook`` into ``module``'s hook dict ``kind`` under ``hook_id``, last (``after_own``: right after the model's own
    hooks), in a new dict, not an item written into the shadow's own one (Dynamo cannot trace that); each replaced
    dict appended to ``saved``, to be put back."""
    entries: list[tuple[str, Any]] = [(kind, hook)]
    if kind == "_forward_pre_hooks":  # (a tap's pre-hook takes the keyword arguments too)
        entries.append(("_forward_pre_hooks_with_kwargs", True))
    for name, value in entries:
        table = getattr(module, name)
        # (the model's own: the dict first replaced, else the one there)
        own = next((t for m, n, t in saved if m is module and n == name), table) if after_own else table
        items = [*own.items(), (hook_id, value), *((k, v) for k, v in table.items() if k not in own)]
        saved.append((module, name, table))
        setattr(module, name, OrderedDict(items))


def run_traced(model: nn.Module, values: dict[Key, Any], taps: Sequence[Tap],
               invoke: Callable[[nn.Module], Any]) -> tuple[Any, Captured]:
    """`tdhook_fn._functional.run` while Dynamo traces it (NOTE [compiled calls])."""
    name, slots, keys, (settings, identities, hooks, attributes) = traced_plan(model, tuple(tap.path for tap in taps))
    plan: TracePlan = getattr(_this, name)  # only its modules are read from it
    if len(values) != len(keys) or not set(keys).issuperset(values):
        raise_key_mismatch(set(keys), set(values))
    modules = list(model.modules())  # read in traced code, so Dynamo guards on them
    for index, attribute, value in settings:
        now = getattr(modules[index], attribute)
        if (tuple(now) if isinstance(now, list) else now) != value:
            _changed(attribute)
    for index, attribute, ident in identities:
        if id(vars(modules[index])[attribute]) != ident:
            _changed(attribute)
    for module, names in zip(modules, attributes, strict=True):
        if tuple([name for name in vars(module)]) != names:  # (iterated: Dynamo guards the keys; tuple() it does not)
            _changed(next(iter(set(vars(module)) ^ set(names)), "?"))
    for index, attribute, hook_ids in hooks:  # (through vars: Dynamo skips guards on a module's own hook attributes)
        table = vars(module_globals if index < 0 else modules[index])[attribute]
        if tuple([(key, id(hook)) for key, hook in table.items()]) != hook_ids:
            _changed(attribute)
    tensors: dict[str, Any] = {}
    wrong: list[str] = []
    copies: dict[Key, Any] = {}
    for key, name, buffer, shape in slots:
        value = values[key]
        wrong += shape_mismatch(key, value, shape)
        tensors[name] = private_buffer(copies, key, value) if buffer else value
    if wrong:
        raise_shape_mismatch(wrong)
    captured: Captured = {}
    saved: list[tuple[nn.Module, str, Any]] = []
    frames = InPlaceFrames()
    hook_id = 0  # (RemovableHandle ids are >= 0: the keys below clash with none of the model's own hooks)
    for tap, module in zip(taps, plan.targets, strict=True):
        for kind, hook in tap.hooks(captured, module, frames):
            hook_id -= 1
            _put(saved, module, kind, hook_id, hook)
    for module in plan.root.modules() if frames.watching else ():  # NOTE [compiled containers that write their input]
        if writes_in_place(module):
            hook_id -= 1
            _put(saved, module, "_forward_pre_hooks", hook_id, frames.observe, after_own=True)
    try:
        with _reparametrize_module(plan.root, tensors, tie_weights=False, strict=False):
            output = invoke(plan.root)
    finally:
        for module, kind, table in reversed(saved):
            setattr(module, kind, table)
    return output, captured
