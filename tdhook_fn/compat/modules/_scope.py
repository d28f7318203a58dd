"""The one scope of compat: with which hooks and which tensors a routed call runs (NOTE [one scope])."""

# NOTE [one scope]
# Every effect compat has on a call of the user's model is a *tap keyed by module identity*
# (a tdhook hook recorded in a `VirtualHooks` registry: NOTE [virtual hooks]; adapters too)
# or a *replacement keyed by tensor identity* (``fn(value) -> tensor`` giving one of the
# model's parameters or buffers another value for the call without writing it: Pruning's
# masks, TaskVectors' weights). Both are held in one context variable, a frozen `Scope`: the
# registries active now (the hooked modules and runs being called), the registry new hooks
# are recorded into (a ``HookedModuleRun``'s own), and the replacements, outermost first.
# Context variables are per thread and asyncio task, so a call sees the scope of the calls
# it runs inside, never another thread's. At call time the targets are found by identity in
# whatever root is routed (the user's model, or a TensorDictModule around it): hooks become
# the call's taps, replacements the core's ``overrides`` (`route`), or entries of a detached
# params TensorDict (`replaced_params`). Replacements of one tensor compose in the order they
# were *made* (`made`: when their context was prepared or their block entered, as tdhook
# writes weights in that order), each receiving the value the previous one gave (a composite
# of two Prunings masks twice; vectors applied over a pruned module replace the pruned
# weights; a Pruning prepared inside an applied block masks the applied ones). The order of
# calls is not it: a hooked module prepared over another's runs it, so enters its own after.

from __future__ import annotations

import dataclasses
import operator
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn
from torch.utils.hooks import RemovableHandle

from tdhook_fn._functional import run
from tdhook_fn._paths import name_to_path
from tdhook_fn._probe import measuring
from tdhook_fn._taps import Captured, Tap
from tdhook_fn._types import Replace
from tdhook_fn.compat.hooks import HookDirection
from tdhook_fn.compat.hooks._registration import VirtualHook, VirtualHooks, order_mark, register_checked

__all__ = [
    "SCOPE", "HookTap", "Made", "Replacement", "Scope", "active_hooks", "entered", "made", "module_path",
    "module_paths", "replaced_params", "replacing", "route", "taps_for", "unseen",
]

Replacement = tuple[torch.Tensor, Replace]  # (the model's tensor, the function giving its value in a call)
Made = tuple[torch.Tensor, Replace, int]  # a replacement and its place in the order they were made (`made`)
_MADE_AT = operator.itemgetter(2)


def made(replacements: Iterable[Replacement]) -> tuple[Made, ...]:
    """``replacements`` made now: they apply after those made before (NOTE [one scope])."""
    mark = order_mark()
    return tuple((tensor, fn, mark) for tensor, fn in replacements)


@dataclass(frozen=True)
class Scope:
    """What routed calls in this thread run with now (NOTE [one scope]): the active registries, the one
    hooks registered through a hooked module go to (a ``HookedModuleRun``'s; ``None``: the hooked
    module's own), and the replacements, outermost first."""

    hooks: tuple[VirtualHooks, ...] = ()
    recording: VirtualHooks | None = None
    replacements: tuple[Made, ...] = ()


SCOPE: ContextVar[Scope] = ContextVar("tdhook_fn_compat_scope", default=Scope())  # noqa: B039 (frozen)


@contextmanager
def entered(
    *,
    hooks: VirtualHooks | None = None,
    recording: VirtualHooks | None = None,
    replacements: Iterable[Made] = (),
) -> Iterator[Scope]:
    """Extend this thread's scope until exit: one more active registry, a recording
    registry, more replacements (those already in the scope are not added twice)."""
    scope = SCOPE.get()
    changes: dict[str, Any] = {}
    if hooks is not None and hooks not in scope.hooks:  # (by identity: a registry defines no __eq__)
        changes["hooks"] = (*scope.hooks, hooks)
    if recording is not None:
        changes["recording"] = recording
    more = unseen(scope.replacements, replacements) if replacements else ()
    if more:
        changes["replacements"] = (*scope.replacements, *more)
    if not changes:
        yield scope
        return
    token = SCOPE.set(dataclasses.replace(scope, **changes))
    try:
        yield SCOPE.get()
    finally:
        SCOPE.reset(token)


def replacing(*replacements: Replacement) -> AbstractContextManager[Scope]:
    """Give each model ``tensor`` (by identity) the value ``fn(value)`` in every routed call of this thread
    until exit, ``value`` being the tensor, live, or what the replacements made before gave it."""
    return entered(replacements=made(replacements))


def unseen(present: Sequence[Made], more: Iterable[Made]) -> tuple[Made, ...]:
    """The replacements of ``more`` not in ``present`` (by identity of tensor and function)."""
    seen = {(id(t), id(fn)) for t, fn, _ in present}
    return tuple(entry for entry in more if (id(entry[0]), id(entry[1])) not in seen)


def active_hooks(scope: Scope | None = None) -> list[VirtualHook]:
    """The hooks of every active registry, in registration order."""
    registries = (scope or SCOPE.get()).hooks
    if len(registries) == 1:
        return registries[0].entries()
    return sorted((entry for registry in registries for entry in registry.entries()), key=lambda e: e.order)


# NOTE [replaced keys]
# A routed call needs the key of each replaced tensor in its root. Walking every parameter
# and buffer costs ~1.4 ms a call on a 226-module model; so the keys are found once per
# root and set of replaced tensors and kept (the root held weakly), and each call only
# checks that every key still holds its tensor, by identity (a tensor moved or swapped
# out walks again). A set with a tensor the root does not hold is walked at every call:
# that the tensor is still absent cannot be checked without a walk.
_FOUND: weakref.WeakKeyDictionary[nn.Module, dict[frozenset[int], dict[int, tuple[str, ...]]]] = (
    weakref.WeakKeyDictionary())
_FOUND_LOCK = threading.Lock()


def _held_at(root: nn.Module, key: tuple[str, ...]) -> Any:
    """What ``root`` holds at ``key`` (a parameter or a buffer), or ``None``."""
    module = root
    for part in key[:-1]:
        child = module._modules.get(part)
        if child is None:
            return None
        module = child
    return module._parameters.get(key[-1], module._buffers.get(key[-1]))


def _keys(root: nn.Module, tensors: Sequence[torch.Tensor]) -> dict[int, tuple[str, ...]]:
    """The key in ``root`` of each of ``tensors`` it holds, by id (NOTE [replaced keys])."""
    wanted = frozenset(map(id, tensors))
    found = _FOUND.get(root, {}).get(wanted)
    if found is not None and all(_held_at(root, found[id(t)]) is t for t in tensors):
        return found
    found = {}
    for name, tensor in (*root.named_parameters(), *root.named_buffers()):
        if id(tensor) in wanted and id(tensor) not in found:
            found[id(tensor)] = tuple(name.split("."))
    if len(found) == len(wanted):
        with _FOUND_LOCK:
            kept = _FOUND.setdefault(root, {})
            if len(kept) >= 16:  # (a few sets per model: the contexts entered on it)
                kept.clear()
            kept[wanted] = found
    return found


def _values(root: nn.Module, replacements: Sequence[Made], start: Callable[[torch.Tensor], torch.Tensor],
            ) -> dict[tuple[str, ...], torch.Tensor]:
    """The replaced tensors of ``root`` (those it holds), by key, each from ``start(tensor)`` through its
    replacements in the order they were made."""
    keys = _keys(root, [tensor for tensor, _, _ in replacements])
    values: dict[tuple[str, ...], torch.Tensor] = {}
    for tensor, fn, _ in sorted(replacements, key=_MADE_AT):  # (a stable sort, keyed in C: on every call)
        key = keys.get(id(tensor))
        if key is not None:
            values[key] = fn(values[key] if key in values else start(tensor))
    return values


def replaced_params(root: nn.Module, params: TensorDictBase, replacements: Sequence[Made], *,
                    detach: bool) -> TensorDictBase:
    """``params`` of ``root`` (from `tdhook_fn.params`) with ``replacements`` set in it (``detach``: from
    detached tensors, detached)."""
    start: Callable[[torch.Tensor], torch.Tensor] = (lambda t: t.detach()) if detach else (lambda t: t)
    for key, value in _values(root, replacements, start).items():
        params.set(key, value.detach() if detach else value)
    return params


def route(root: nn.Module, invoke: Callable[[nn.Module], Any]) -> Any:
    """``invoke(shadow)`` on a private shadow of ``root`` (never changed), live, with the scope's
    hooks and replacements."""
    scope = SCOPE.get()
    chosen = scope.replacements
    overrides = _values(root, chosen, lambda tensor: tensor) if chosen else None
    output, _ = run(root, None, taps_for(root, active_hooks(scope))[0], invoke, overrides=overrides or None)
    return output


@dataclass(frozen=True)
class HookTap(Tap):
    """A custom tap registering a tdhook-style hook (``direction``, ``prepend``) on the call's shadow
    submodule, which receives the user's submodule ``target`` as its ``module``."""

    direction: HookDirection = "fwd"
    prepend: bool = False
    target: Any = field(default=None, compare=False, repr=False)

    def attach(self, module: nn.Module, captured: Captured) -> RemovableHandle:
        hook, original = self.fn, self.target
        assert hook is not None

        def relay(_shadow: nn.Module, *args: Any) -> Any:
            if measuring():  # NOTE [hooks and shape probes]
                return None
            return hook(original, *args)

        return register_checked(module, relay, self.direction, self.prepend)  # (checked when recorded)


# NOTE [hooks and shape probes]
# Before its first call on a model (and inputs of a new shape), a method measures what it
# needs on a probe forward: the activations of its layers, on meta tensors
# (`tdhook_fn._probe.on_meta`), or the widest activation of one sample, to size its chunks.
# tdhook runs no such forward, so a user's hook is not called in one (`measuring`): a hook
# that counts its calls, caches or reads values sees only the forwards tdhook's would. A
# hook that changes an activation's shape is the exception: the real forward contradicts the
# probe, and the method probes again with the hooks running (NOTE [taps in probes]).


def module_paths(root: nn.Module) -> dict[int, str]:
    """``id(submodule) -> path`` from ``root``, each submodule at its first name."""
    paths: dict[int, str] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        if id(module) not in paths:
            paths[id(module)] = name_to_path(name)
    return paths


def module_path(root: nn.Module, target: nn.Module) -> str | None:
    """The path of ``target`` from ``root``, or ``None`` when it is not inside it."""
    return module_paths(root).get(id(target))


def taps_for(root: nn.Module, hooks: Sequence[VirtualHook],
             since: int = sys.maxsize) -> tuple[tuple[Tap, ...], tuple[Tap, ...]]:
    """``hooks`` as taps on ``root``: those recorded before the mark ``since`` (`order_mark`; default: all), and
    those after; hooks on modules outside ``root`` are left out."""
    if not hooks:
        return (), ()
    paths = module_paths(root)
    before: list[Tap] = []
    after: list[Tap] = []
    for h in hooks:
        if id(h.target) in paths:
            tap = HookTap(paths[id(h.target)], "custom", h.hook, direction=h.direction, prepend=h.prepend,
                          target=h.target)
            (before if h.order < since else after).append(tap)
    return tuple(before), tuple(after)
