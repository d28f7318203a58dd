"""Hooking contexts with the public API of ``tdhook.contexts`` (tdhook 0.1.3).

Entering a context changes nothing on the model (see `tdhook_fn.compat.modules`).
Differences from tdhook 0.1.3 are listed in ``docs/compat.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from types import TracebackType
from typing import Any, Literal, overload

from tensordict import NestedKey, TensorDict
from tensordict.nn import TensorDictModule, TensorDictModuleBase
from torch import nn

from tdhook_fn.compat._types import UnraveledKey
from tdhook_fn.compat.hooks import MultiHookHandle, RemovableHandleProtocol
from tdhook_fn.compat.hooks._registration import NO_HOOKS
from tdhook_fn.compat.modules import HookedModule, RoutedModule

__all__ = [
    "UNTOUCHING_PREPARES",
    "CompositeHookingContextFactory",
    "HookingContext",
    "HookingContextFactory",
    "HookingContextWithCache",
    "under",
]

InKeys = list[NestedKey] | dict[NestedKey, str]


def under(prefix: Any, keys: Sequence[Any]) -> list[Any]:
    """The flat nested keys ``prefix`` + ``key`` for each of ``keys`` (each a str or a tuple of str): the entries
    a factory writes or reads besides the module's (``("attr", key)``, ``("patched", key)``)."""
    head = (prefix,) if isinstance(prefix, str) else tuple(prefix)
    nested = []
    for key in keys:  # (a loop: a comprehension is one more call)
        nested.append((*head, *((key,) if isinstance(key, str) else key)))
    return nested


# NOTE [prepared attributes]
# What a ``_prepare_module`` changed on the context's TensorDictModule (names in
# ``__dict__``, ``_parameters``, ``_buffers``, ``_modules``; not ``training``) is diffed
# against a snapshot taken before it, and what ``_restore_module`` left is put back on exit
# (the behaviour: docs/compat.md). Prepare steps of compat's own that set nothing
# (`UNTOUCHING_PREPARES`, by function) skip the snapshots; an override is snapshotted.
UNTOUCHING_PREPARES: set[Callable[..., Any]] = set()

_SLOTS = ("_parameters", "_buffers", "_modules")
_SKIPPED = frozenset((*_SLOTS, "training"))
_State = dict[str, tuple[str, Any]]


def _attribute_state(module: nn.Module) -> _State:
    """Name -> (where it lives, value) for the attributes of ``module`` itself."""
    state = {}
    for name, value in vars(module).items():  # (loops, not comprehensions: no call per entry point)
        if name not in _SKIPPED:
            state[name] = ("__dict__", value)
    for slot in _SLOTS:
        for name, value in getattr(module, slot).items():
            state[name] = (slot, value)
    return state


def _same(a: tuple[str, Any] | None, b: tuple[str, Any] | None) -> bool:
    return a is b or (a is not None and b is not None and a[0] == b[0] and a[1] is b[1])


def _changes_since(module: nn.Module, before: _State) -> dict[str, tuple[str, Any] | None]:
    """The names whose state differs from ``before``, with their state before."""
    after = _attribute_state(module)
    if len(after) == len(before):  # the usual case, nothing changed: checked without a call per name
        for name, (slot, value) in after.items():
            old = before.get(name)
            if old is None or old[0] != slot or old[1] is not value:
                break
        else:
            return {}
    names = before.keys() | after.keys()
    return {name: before.get(name) for name in names if not _same(before.get(name), after.get(name))}


def _put_back(module: nn.Module, changes: dict[str, tuple[str, Any] | None]) -> None:
    """Give each name in ``changes`` its recorded state again, where it differs now."""
    now = _attribute_state(module)
    for name, old in changes.items():
        current = now.get(name)
        if _same(current, old):
            continue
        if current is not None:
            del (vars(module) if current[0] == "__dict__" else getattr(module, current[0]))[name]
            if current[0] == "_buffers":
                module._non_persistent_buffers_set.discard(name)
        if old is not None:
            (vars(module) if old[0] == "__dict__" else getattr(module, old[0]))[name] = old[1]


class HookingContext:
    """Prepares a module on entry and restores it on exit.

    Args:
        factory (HookingContextFactory): supplies the prepare/restore/spawn/hook steps.
        module (nn.Module): the model; an ``nn.Module`` is wrapped in a
            ``TensorDictModule(module, in_keys or ["input"], out_keys or ["output"])``.
        in_keys (list | None): the input keys of that wrapper.
        out_keys (list | None): the output keys of that wrapper.
        pre_factories (list | None): factories whose contexts are entered first, each
            preparing the module the next one receives.
    """

    def __init__(
        self,
        factory: HookingContextFactory,
        module: nn.Module,
        in_keys: InKeys | None = None,
        out_keys: list[NestedKey] | None = None,
        pre_factories: list[HookingContextFactory] | None = None,
    ) -> None:
        self._prepare = factory._prepare_module
        self._restore = factory._restore_module
        self._spawn = factory._spawn_hooked_module
        self._hook = factory._hook_module
        self._in_context = False
        self._handle: RemovableHandleProtocol | None = None
        self._hooked_module: HookedModule | None = None
        self._pre_factories = pre_factories or []
        self._stack: ExitStack | None = None
        self._working: RoutedModule | None = None
        self._prepared_changes: dict[str, tuple[str, Any] | None] = {}
        self._module: TensorDictModuleBase
        if isinstance(module, TensorDictModuleBase):
            self._module, self._extra_relative_path = module, ""
        else:
            self._module = TensorDictModule(module, in_keys or ["input"], out_keys or ["output"])
            self._extra_relative_path = "module"
        self._in_keys: list[NestedKey] = list(self._module.in_keys)
        self._out_keys: list[NestedKey] = list(self._module.out_keys)
        self._managed_by_context_manager = False

    def _enter(self, managed_by_context_manager: bool = True) -> HookedModule:
        if self._in_context:
            raise RuntimeError("Cannot enter context twice")
        self._in_context = True
        self._managed_by_context_manager = managed_by_context_manager
        try:
            pre: TensorDictModuleBase = self._module
            with ExitStack() as stack:
                for factory in self._pre_factories:
                    pre = stack.enter_context(factory.prepare(pre, self._in_keys, self._out_keys))
                self._stack = stack.pop_all()
            if isinstance(self._module, HookedModule):  # a context over another's hooked module: it runs the model
                working = self._module.routed_model()
            else:
                working = RoutedModule(self._module, self._extra_relative_path)
            if pre is not self._module:  # a pre-factory's hooked module routes the model itself
                working = working.running(pre)
            if getattr(self._prepare, "__func__", None) in UNTOUCHING_PREPARES:
                prepared = self._prepare(working, self._in_keys, self._out_keys, self._extra_relative_path)
            else:
                before = _attribute_state(self._module)
                try:
                    prepared = self._prepare(working, self._in_keys, self._out_keys, self._extra_relative_path)
                finally:
                    self._prepared_changes = _changes_since(self._module, before)
            self._working = working  # prepared: restore it, from here on
            self._hooked_module = self._spawn(prepared, self, self._extra_relative_path)
            self._handle = self._hook(self._hooked_module)
        except BaseException as e:
            try:
                if self._working is not None:
                    self._restore(self._working, self._in_keys, self._out_keys, self._extra_relative_path)
            finally:
                self._close(type(e), e, e.__traceback__)
            raise
        return self._hooked_module

    def _close(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        changes, self._prepared_changes = self._prepared_changes, {}
        self._in_context = False
        self._working = None
        self._hooked_module = None
        self._handle = None
        try:
            if changes:
                _put_back(self._module, changes)
        finally:
            if stack is not None:
                stack.__exit__(exc_type, exc_value, traceback)

    def __enter__(self) -> HookedModule:
        return self._enter(managed_by_context_manager=True)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self._in_context:
            raise RuntimeError("Cannot exit a context that was not entered")
        try:
            if self._handle is not None and self._handle is not NO_HOOKS:
                self._handle.remove()
            if self._working is not None:
                self._restore(self._working, self._in_keys, self._out_keys, self._extra_relative_path)
        finally:
            self._close(exc_type, exc_value, traceback)

    @contextmanager
    def disable_hooks(self) -> Iterator[None]:
        """Remove the hooks ``_hook_module`` registered, and register them again after."""
        if not self._in_context or self._hooked_module is None:
            raise RuntimeError("Cannot disable hooks outside of context")
        if self._handle is not None:
            self._handle.remove()
        try:
            yield
        finally:
            self._handle = self._hook(self._hooked_module)

    @contextmanager
    def disable(self) -> Iterator[Any]:
        """Yield the restored raw module (the user's model) with the context's hooks off."""
        if not self._in_context or self._working is None:
            raise RuntimeError("Cannot disable context outside of context")
        with self.disable_hooks():  # (the model, also where the prepared module is a method's, not the model's wrapper)
            yield self._restore(self._working.module, self._in_keys, self._out_keys, self._extra_relative_path)


class HookingContextWithCache(HookingContext):
    """A `HookingContext` owning ``cache`` (Default: a new TensorDict), cleared on entry unless
    ``clear_cache=False``."""

    def __init__(self, *args: Any, cache: TensorDict | None = None, clear_cache: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cache = TensorDict() if cache is None else cache
        self._clear_cache = clear_cache

    @property
    def cache(self) -> TensorDict:
        return self._cache

    def clear(self) -> None:
        self._cache.clear()

    def _enter(self, managed_by_context_manager: bool = True) -> HookedModule:
        if self._clear_cache:
            self.clear()
        return super()._enter(managed_by_context_manager=managed_by_context_manager)


class HookingContextFactory:
    """Makes hooking contexts; subclass it to build a method on the hooked module.

    ``_hooking_context_class`` and ``_hooked_module_class`` choose the classes made,
    ``_hooking_context_kwargs`` and ``_hooked_module_kwargs`` their extra arguments.
    """

    _hooked_module_class: type[HookedModule] = HookedModule
    _hooking_context_class: type[HookingContext] = HookingContext

    def __init__(self) -> None:
        self._hooking_context_kwargs: dict[str, Any] = {}
        self._hooked_module_kwargs: dict[str, Any] = {}

    @overload
    def prepare(
        self,
        module: nn.Module,
        in_keys: InKeys | None = None,
        out_keys: list[NestedKey] | None = None,
        *,
        return_context: Literal[True] = True,
    ) -> HookingContext: ...

    @overload
    def prepare(
        self,
        module: nn.Module,
        in_keys: InKeys | None = None,
        out_keys: list[NestedKey] | None = None,
        *,
        return_context: Literal[False],
    ) -> HookedModule: ...

    def prepare(
        self,
        module: nn.Module,
        in_keys: InKeys | None = None,
        out_keys: list[NestedKey] | None = None,
        *,
        return_context: bool = True,
    ) -> HookingContext | HookedModule:
        """A context over ``module``, or (``return_context=False``) its entered hooked module.

        Args:
            module (nn.Module): an ``nn.Module`` or a TensorDictModule.
            in_keys (list | dict | None): for an ``nn.Module``, its input keys (Default:
                ``["input"]``); for a TensorDictModule, a subset of its ``in_keys``.
            out_keys (list | None): likewise for outputs (Default: ``["output"]``).
            return_context (bool): return the context (to use with ``with``). When
                ``False`` the context is entered and its hooked module returned; call
                its ``restore()`` when done. Default: ``True``.

        Raises:
            ValueError: for a TensorDictModule, a key that is not a str or tuple of str,
                or is not among the module's keys.
        """
        if isinstance(module, TensorDictModuleBase):
            for name, keys, known in (("in_keys", in_keys, module.in_keys), ("out_keys", out_keys, module.out_keys)):
                for key in keys or ():
                    if not isinstance(key, UnraveledKey):
                        raise ValueError(f"{name} must be unraveled, got {type(key)}")
                    if key not in known:
                        raise ValueError(f"Key {key} not in module.{name}")
        context = self._hooking_context_class(self, module, in_keys, out_keys, **self._hooking_context_kwargs)
        if return_context:
            return context
        return context._enter(managed_by_context_manager=False)

    def _prepare_module(
        self, module: RoutedModule, in_keys: list[NestedKey], out_keys: list[NestedKey], extra_relative_path: str
    ) -> TensorDictModuleBase:
        """The module the hooked module runs. Default: ``module`` (a RoutedModule) itself."""
        return module

    def _restore_module(
        self, module: RoutedModule, in_keys: list[NestedKey], out_keys: list[NestedKey], extra_relative_path: str
    ) -> Any:
        """Undo `_prepare_module` on exit; ``module`` is the one it received. Default: return it."""
        return module

    def _spawn_hooked_module(
        self, prep_module: TensorDictModuleBase, hooking_context: HookingContext, extra_relative_path: str
    ) -> HookedModule:
        """Wrap the prepared module in ``_hooked_module_class``."""
        base = self._hooked_module_kwargs.get("relative_path", "td_module")
        path = ".".join(filter(None, (base, extra_relative_path)))  # (`merge_paths`, inline: a call on every entry)
        kwargs = {**self._hooked_module_kwargs, "relative_path": path}
        return self._hooked_module_class(prep_module, hooking_context=hooking_context, **kwargs)

    def _hook_module(self, module: HookedModule) -> RemovableHandleProtocol:
        """Register the context's own hooks on ``module``; their handle. Default: none (an empty handle)."""
        return NO_HOOKS


UNTOUCHING_PREPARES.add(HookingContextFactory._prepare_module)


class CompositeHookingContextFactory(HookingContextFactory):
    """Chains factories: prepares in order, restores in reverse, hooks with all of them.

    Raises:
        ValueError: a factory overrides ``_spawn_hooked_module``,
            ``_hooking_context_class`` or ``_hooked_module_class`` and the composite
            does not.
    """

    _OVERRIDABLE = ("_spawn_hooked_module", "_hooking_context_class", "_hooked_module_class")

    def __init__(self, *contexts: HookingContextFactory) -> None:
        super().__init__()
        self._contexts = contexts
        free = [attr for attr in self._OVERRIDABLE if not self._overrides(type(self), attr)]
        for context in contexts:
            for attr in free:
                if self._overrides(type(context), attr):
                    raise ValueError(
                        f"Cannot compose factories that override {attr}, consider subclassing this factory "
                        f"to override {attr}"
                    )

    @staticmethod
    def _overrides(cls: type, attr: str) -> bool:
        return bool(getattr(cls, attr) != getattr(HookingContextFactory, attr))

    def _prepare_module(
        self, module: RoutedModule, in_keys: list[NestedKey], out_keys: list[NestedKey], extra_relative_path: str
    ) -> TensorDictModuleBase:
        prepared: TensorDictModuleBase = module
        for context in self._contexts:
            prepared = context._prepare_module(module, in_keys, out_keys, extra_relative_path)
            module = module.running(prepared)  # each factory receives a RoutedModule running the previous one's
        return prepared

    def _restore_module(
        self, module: RoutedModule, in_keys: list[NestedKey], out_keys: list[NestedKey], extra_relative_path: str
    ) -> Any:
        for context in reversed(self._contexts):
            module = context._restore_module(module, in_keys, out_keys, extra_relative_path)
        return module

    def _hook_module(self, module: HookedModule) -> MultiHookHandle:
        return MultiHookHandle([context._hook_module(module) for context in self._contexts])
