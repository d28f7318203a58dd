"""tdhook's hook API on a hooked module (`set`, `get`, `stop` and their variants): hooks on its submodules by key,
recorded in its registry of virtual hooks, never registered on the model (NOTE [virtual hooks])."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, cast

from tensordict.nn import TensorDictModuleBase
from torch import nn

from tdhook_fn import PathError
from tdhook_fn.compat.hooks import (
    DIRECTION_TO_TYPE,
    CacheProxy,
    HookDirection,
    HookFactory,
    RemovableHandleProtocol,
    _check_hook_signature,
    resolve_submodule_path,
)
from tdhook_fn.compat.hooks._registration import NO_HOOKS, VirtualHooks

from ._run import directed
from ._scope import SCOPE, module_path

__all__ = ["SubmoduleHooks"]


class SubmoduleHooks:
    """The hook API of `HookedModule`, whose ``__init__`` sets the attributes below.

    Keys with ``relative=True`` start at the user's model: the one the context was prepared
    with (at its ``extra_relative_path``), else the module the hooked module's
    ``relative_path`` names.
    """

    td_module: TensorDictModuleBase
    _hooking_context: Any
    _relative_path: str
    _virtual_hooks: VirtualHooks

    def _hooked(self) -> nn.Module:
        return cast(nn.Module, self)  # (a HookedModule)

    def _context_model(self) -> nn.Module | None:
        """The module the context was prepared with, if it has one."""
        module = getattr(self._hooking_context, "_module", None)
        return module if isinstance(module, nn.Module) else None

    def _model(self) -> nn.Module:
        """The module tree hooks may target: the context's module, else ``td_module``."""
        module = self._context_model()
        return self.td_module if module is None else module

    def _key_root(self) -> Any:
        """Where keys with ``relative=True`` start."""
        module = self._context_model()
        if module is None:
            return resolve_submodule_path(self._hooked(), self._relative_path)
        return resolve_submodule_path(module, self._hooking_context._extra_relative_path)

    def register_submodule_hook(
        self,
        key: str,
        hook: Callable[..., Any],
        direction: HookDirection,
        prepend: bool = False,
        relative: bool = True,
    ) -> RemovableHandleProtocol:
        """Record ``hook`` on the submodule at ``key`` (relative to the model, or to self); PathError (a
        ValueError): ``key`` does not resolve, is refused or names no module of the model; ValueError: an unfit hook."""
        root = self._key_root() if relative else self._hooked()
        submodule = resolve_submodule_path(root, key)
        if isinstance(submodule, nn.ModuleList):
            warnings.warn(f"You are hooking a ModuleList ({key}), which will never be executed.", stacklevel=2)
        if not isinstance(submodule, nn.Module):
            raise PathError(f"{key!r} resolves to a {type(submodule).__name__}, not to a module")
        if module_path(self._model(), submodule) is None:
            if isinstance(submodule, nn.ModuleList):  # e.g. a slice: never executed anyway
                _check_hook_signature(hook, direction)
                return NO_HOOKS  # nothing to remove: tdhook hooks such modules anyway
            raise PathError(
                f"{key!r} resolves to a {type(submodule).__name__} outside the hooked model; "
                "only the model's own submodules can be hooked"
            )
        registry = SCOPE.get().recording or self._virtual_hooks  # a HookedModuleRun records into its own
        return registry.add(submodule, hook, direction, prepend)

    def set(
        self,
        module_key: str,
        value: Any,
        callback: Callable[..., Any] | None = None,
        direction: HookDirection = "fwd",
        prepend: bool = False,
        relative: bool = True,
    ) -> RemovableHandleProtocol:
        """Replace the value at ``module_key`` by ``value`` (or ``callback``'s result)."""
        hook = HookFactory.make_setting_hook(value, callback=callback, direction=direction)
        return self.register_submodule_hook(module_key, hook, direction, prepend, relative)

    def get(
        self,
        cache: Any,
        module_key: str,
        cache_key: Any = None,
        callback: Callable[..., Any] | None = None,
        direction: HookDirection = "fwd",
        prepend: bool = False,
        relative: bool = True,
    ) -> tuple[RemovableHandleProtocol, CacheProxy]:
        """Store the value at ``module_key`` in ``cache[cache_key]``.

        ``cache_key`` defaults to ``"{module_key}_{type}"`` (``output``, ``input``,
        ``grad_input``, ``grad_output``).
        """
        cache_key = cache_key or f"{module_key}_{DIRECTION_TO_TYPE[direction]}"
        proxy = CacheProxy(cache_key, cache)
        hook = HookFactory.make_caching_hook(cache_key, cache, callback=callback, direction=direction)
        return self.register_submodule_hook(module_key, hook, direction, prepend, relative), proxy

    set_input, get_input = directed("set", "fwd_pre"), directed("get", "fwd_pre")
    set_grad, get_grad = directed("set", "bwd"), directed("get", "bwd")
    set_grad_output, get_grad_output = directed("set", "bwd_pre"), directed("get", "bwd_pre")

    def stop(self, key: str) -> RemovableHandleProtocol:
        """Raise EarlyStoppingException when the module at ``key`` has run."""
        return self.register_submodule_hook(key, HookFactory.make_stopping_hook(key), "fwd")
