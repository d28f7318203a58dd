"""Hook directions, signature checks, paths and registration (``tdhook.hooks``, part 1): on a module, as torch
registers, or recorded in a registry of virtual hooks (NOTE [virtual hooks])."""

# NOTE [virtual hooks]
# A hook is only *recorded*: a `VirtualHooks` registry holds entries (target submodule,
# direction, hook, prepend). Every execution of the model goes through ``_scope.route``,
# which runs it on the core's private shadow (`tdhook_fn._functional.run`) with the entries
# of the registries *active* at that moment turned into custom taps. A registry is active
# while its owner runs: ``HookedModule.forward`` and a ``HookedModuleRun`` add theirs to
# the thread's scope (NOTE [one scope]), so a call sees the hooks of the hooked modules it
# runs inside, outer ones included, and never another thread's. Entries name their target
# by identity, as torch hooks do, mapped to a path of the routed root at call time; hook
# functions receive the user's own submodule as ``module``, never the shadow.

from __future__ import annotations

import inspect
import itertools
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Protocol, TypeVar

from torch import nn
from torch.utils.hooks import RemovableHandle

from tdhook_fn._paths import path_to_name, resolve_path

HookDirection = Literal["fwd", "bwd", "fwd_pre", "bwd_pre", "fwd_kwargs", "fwd_pre_kwargs"]
T = TypeVar("T")

# tdhook annotates cache keys with ``tdhook._types.UnraveledKey``: a str or a tuple of str.
_UnraveledKey = str | tuple[str, ...]

# Positional parameters torch passes to a hook of each direction, in order.
DIRECTION_TO_PARAMS: dict[str, tuple[str, ...]] = {
    "fwd": ("module", "args", "output"),
    "bwd": ("module", "grad_input", "grad_output"),
    "fwd_pre": ("module", "args"),
    "bwd_pre": ("module", "grad_output"),
    "fwd_kwargs": ("module", "args", "kwargs", "output"),
    "fwd_pre_kwargs": ("module", "args", "kwargs"),
}

# The parameter whose value a hook of each direction replaces by returning something.
DIRECTION_TO_RETURN: dict[str, str] = {
    "fwd": "output",
    "bwd": "grad_input",
    "fwd_pre": "args",
    "bwd_pre": "grad_output",
    "fwd_kwargs": "output",
    "fwd_pre_kwargs": "args",
}

DIRECTION_TO_RETURN_INDEX: dict[str, int] = {
    direction: params.index(DIRECTION_TO_RETURN[direction])
    for direction, params in DIRECTION_TO_PARAMS.items()
}

# What a hook of each direction sees, in tdhook's vocabulary: what it replaces, ``args`` called ``input``.
DIRECTION_TO_TYPE: dict[str, str] = {
    direction: "input" if returned == "args" else returned for direction, returned in DIRECTION_TO_RETURN.items()
}


def _params_for(direction: str) -> tuple[str, ...]:
    """The hook parameters of ``direction``; ValueError for an unknown direction."""
    try:
        return DIRECTION_TO_PARAMS[direction]
    except (KeyError, TypeError):
        raise ValueError(f"Invalid direction: {direction!r}") from None


def _check_hook_signature(hook: Callable[..., Any], direction: HookDirection) -> None:
    """ValueError unless torch can call ``hook`` for ``direction``: tdhook's parameter count
    (defaults and ``**kwargs`` on top of the expected ones; with ``*args``, an upper bound)."""
    expected = _params_for(direction)
    params = inspect.signature(hook).parameters.values()
    optional = sum(p.default is not p.empty or p.kind is p.VAR_KEYWORD for p in params)
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        limit = len(expected) + 1 + optional
        if len(params) > limit:
            raise ValueError(
                f"Hook ({direction}) takes {len(params)} parameters, at most {limit} fit"
            )
        return
    if len(params) != len(expected) + optional:
        raise ValueError(f"Hook ({direction}) must take the parameters {expected}")


def merge_paths(*paths: str) -> str:
    """Join submodule paths (outermost first) with dots, dropping empty ones."""
    return ".".join(filter(None, paths))


def resolve_submodule_path(root: nn.Module, path: str) -> Any:
    """What ``path`` (tdhook's syntax; ``""``: ``root``) names from ``root``; `tdhook_fn.resolve_path`."""
    return resolve_path(root, path)


def submodule_path_to_name(path: str) -> str:
    """``path`` as a dotted name usable as a key (`tdhook_fn._paths.path_to_name`)."""
    return path_to_name(path)


def register_hook_to_module(
    module: nn.Module,
    hook: Callable[..., Any],
    direction: HookDirection,
    prepend: bool = False,
) -> RemovableHandle:
    """Register ``hook`` on ``module`` with torch's method for ``direction`` (``prepend``: before the others);
    torch's handle. ValueError: an unknown direction, or a hook signature that does not fit it."""
    _check_hook_signature(hook, direction)
    return register_checked(module, hook, direction, prepend)


def register_checked(module: nn.Module, hook: Callable[..., Any], direction: HookDirection,
                     prepend: bool) -> RemovableHandle:
    """`register_hook_to_module` for a hook whose signature was checked already."""
    if direction in ("fwd", "fwd_kwargs"):
        return module.register_forward_hook(hook, prepend=prepend, with_kwargs=direction == "fwd_kwargs")
    if direction in ("fwd_pre", "fwd_pre_kwargs"):
        return module.register_forward_pre_hook(hook, prepend=prepend, with_kwargs=direction == "fwd_pre_kwargs")
    if direction == "bwd":
        return module.register_full_backward_hook(hook, prepend=prepend)
    return module.register_full_backward_pre_hook(hook, prepend=prepend)


class RemovableHandleProtocol(Protocol):
    """Anything with a ``remove()`` method, such as torch's ``RemovableHandle``."""

    def remove(self) -> object: ...


class MultiHookHandle:
    """Several hook handles (``handles``) removed together; also a context manager and addable."""

    def __init__(self, handles: list[RemovableHandleProtocol] | None = None) -> None:
        self._handles: list[RemovableHandleProtocol] = handles or []

    def remove(self) -> None:
        """Remove every grouped hook."""
        for handle in self._handles:
            handle.remove()

    def __enter__(self) -> MultiHookHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.remove()

    def __add__(self, other: Any) -> MultiHookHandle:
        if not isinstance(other, MultiHookHandle):
            raise TypeError(f"MultiHookHandle cannot be added to {type(other).__name__}")
        return MultiHookHandle(self._handles + other._handles)


NO_HOOKS = MultiHookHandle()  # a context that registers nothing: one shared empty handle, never removed


def all_or_none(registering: Iterable[RemovableHandleProtocol],
                handles: list[RemovableHandleProtocol] | None = None) -> MultiHookHandle:
    """One handle for ``handles`` and those ``registering`` yields as it registers hooks; if registering
    one fails, every hook already registered is removed before the error goes on."""
    handles = [] if handles is None else handles
    try:
        for handle in registering:
            handles.append(handle)
    except BaseException:
        MultiHookHandle(handles).remove()
        raise
    return MultiHookHandle(handles)


class MultiHookManager:
    """Registers a hook on every submodule whose name ``pattern`` matches (``re.match``; ``None``: none)
    that is one of ``classes_to_hook`` and none of ``classes_to_skip``."""

    def __init__(
        self,
        pattern: str | None = None,
        classes_to_hook: tuple[type[nn.Module], ...] = (nn.Module,),
        classes_to_skip: tuple[type[nn.Module], ...] = (),
    ) -> None:
        # "a^" can never match: nothing comes before the start of a string.
        self._pattern: str = r"a^" if pattern is None else pattern
        self._reg_exp: re.Pattern[str] = re.compile(self._pattern)
        self._classes_to_hook = classes_to_hook
        self._classes_to_skip = classes_to_skip

    @property
    def pattern(self) -> str:
        return self._pattern

    @pattern.setter
    def pattern(self, pattern: str) -> None:
        self._reg_exp = re.compile(pattern)
        self._pattern = pattern

    def _selects(self, name: str, submodule: nn.Module) -> bool:
        return (
            name != ""
            and isinstance(submodule, self._classes_to_hook)
            and not isinstance(submodule, self._classes_to_skip)
            and self._reg_exp.match(name) is not None
        )

    def register_hook(
        self,
        module: nn.Module,
        hook_factory: Callable[[str], Callable[..., Any]],
        *,
        direction: HookDirection = "fwd",
        prepend: bool = False,
        relative_path: str | None = None,
    ) -> MultiHookHandle:
        """Register ``hook_factory(name)`` on every selected submodule below ``relative_path`` (names
        relative to it; never the root); one handle removing them all. ValueError: ``relative_path``
        does not resolve, or a hook does not fit ``direction``."""
        root: nn.Module = resolve_submodule_path(module, relative_path) if relative_path else module
        # (tdhook leaves the hooks registered before a failure in place: the model stays half hooked)
        return all_or_none(register_hook_to_module(submodule, hook_factory(name), direction, prepend)
                           for name, submodule in root.named_modules() if self._selects(name, submodule))


_ORDER = itertools.count()  # global registration order; next() is atomic under the GIL


# A place in the registration order: every hook recorded from now on comes after it (the counter's own method, no
# Python frame: each context entry takes one).
order_mark: Callable[[], int] = _ORDER.__next__


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


class VirtualHooks(dict[int, VirtualHook]):
    """A thread-safe registry of virtual hooks, by their place in the registration order: recorded here, attached
    only to each call's private shadow. Every hooked module has one; it is a dict, so making one runs no Python
    code, and compares by identity, as a registry (two empty ones are not the same). Writing and listing the
    entries hold one lock, shared by all registries: they are rare and short."""

    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__  # type: ignore[assignment]

    def add(
        self, target: nn.Module, hook: Callable[..., Any], direction: HookDirection, prepend: bool = False
    ) -> VirtualHookHandle:
        """Record ``hook``; its signature is checked now, as torch registration would."""
        _check_hook_signature(hook, direction)
        entry = VirtualHook(next(_ORDER), target, direction, hook, prepend)
        with _REGISTRIES_LOCK:
            self[entry.order] = entry
        return VirtualHookHandle(self, entry.order)

    def discard(self, order: int) -> None:
        with _REGISTRIES_LOCK:
            self.pop(order, None)

    def entries(self) -> list[VirtualHook]:
        with _REGISTRIES_LOCK:
            return list(self.values())


_REGISTRIES_LOCK = threading.Lock()
