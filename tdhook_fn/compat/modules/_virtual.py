"""Virtual hooks: recorded off the model, attached to each call's private shadow."""

# NOTE [virtual hooks]
# A hook is only *recorded*: a `VirtualHooks` registry holds entries (target submodule,
# direction, hook, prepend). Every execution of the model goes through ``_scope.route``,
# which runs it on the core's private shadow (`tdhook_fn._shadow_run.run`) with the entries
# of the registries *active* at that moment turned into custom taps. A registry is active
# while its owner runs: ``HookedModule.forward`` and a ``HookedModuleRun`` add theirs to
# the thread's scope (NOTE [one scope]), so a call sees the hooks of the hooked modules it
# runs inside, outer ones included, and never another thread's. Entries name their target
# by identity, as torch hooks do, mapped to a path of the routed root at call time; hook
# functions receive the user's own submodule as ``module``, never the shadow.

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from tdhook_fn._paths import name_to_path
from tdhook_fn._taps import Captured, Tap
from tdhook_fn.compat.hooks import HookDirection, _check_hook_signature
from tdhook_fn.compat.hooks._registration import register_checked

__all__ = ["VirtualHook", "VirtualHookHandle", "VirtualHooks", "module_path", "taps_for"]

_ORDER = itertools.count()  # global registration order; next() is atomic under the GIL


@dataclass(frozen=True)
class VirtualHook:
    """One recorded hook: ``hook`` on ``target`` for ``direction``."""

    order: int
    target: nn.Module
    direction: HookDirection
    hook: Callable[..., Any]
    prepend: bool


class VirtualHookHandle:
    """Removes one virtual hook from its registry; removing twice is harmless."""

    def __init__(self, registry: VirtualHooks, order: int) -> None:
        self._registry = registry
        self._order = order

    def remove(self) -> None:
        self._registry.discard(self._order)

    def __enter__(self) -> VirtualHookHandle:  # as torch's RemovableHandle
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


class VirtualHooks:
    """A thread-safe registry of virtual hooks: recorded here, attached only to each call's private shadow."""

    def __init__(self) -> None:
        self.recorded: dict[int, VirtualHook] = {}  # by order; written under the lock
        self._lock = threading.Lock()

    def add(
        self, target: nn.Module, hook: Callable[..., Any], direction: HookDirection, prepend: bool = False
    ) -> VirtualHookHandle:
        """Record ``hook``; its signature is checked now, as torch registration would."""
        _check_hook_signature(hook, direction)
        entry = VirtualHook(next(_ORDER), target, direction, hook, prepend)
        with self._lock:
            self.recorded[entry.order] = entry
        return VirtualHookHandle(self, entry.order)

    def __getstate__(self) -> dict[str, Any]:  # copy.deepcopy and pickle: a lock cannot be copied
        return {"recorded": self.entries()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.recorded = {entry.order: entry for entry in state["recorded"]}
        self._lock = threading.Lock()

    def discard(self, order: int) -> None:
        with self._lock:
            self.recorded.pop(order, None)

    def entries(self) -> list[VirtualHook]:
        with self._lock:
            return list(self.recorded.values())


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
            return hook(original, *args)

        return register_checked(module, relay, self.direction, self.prepend)  # (checked when recorded)


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


def taps_for(root: nn.Module, hooks: Sequence[VirtualHook]) -> tuple[Tap, ...]:
    """``hooks`` as taps on ``root``; hooks on modules outside ``root`` are left out."""
    if not hooks:
        return ()
    paths = module_paths(root)
    return tuple(
        HookTap(paths[id(h.target)], "custom", h.hook, direction=h.direction, prepend=h.prepend, target=h.target)
        for h in hooks
        if id(h.target) in paths
    )

