"""HookedModuleRun: one run of a hooked module with hooks of its own."""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any, cast

import torch
from tensordict import TensorDict

from tdhook_fn.compat.hooks import (
    DIRECTION_TO_TYPE,
    CacheProxy,
    EarlyStoppingException,
    HookDirection,
    RemovableHandleProtocol,
)
from tdhook_fn.compat.hooks._registration import VirtualHooks

from ._scope import entered

__all__ = ["HookedModuleRun", "directed"]

_SUFFIX = {"fwd_pre": "_input", "bwd": "_grad", "bwd_pre": "_grad_output"}


def directed(method: str, direction: HookDirection, enables_grad: bool = False) -> Callable[..., Any]:
    """tdhook's ``{method}_input``, ``_grad`` and ``_grad_output`` variants: ``method`` in ``direction``
    (``enables_grad``: a run's ``*_grad``, which checks the run is in context and turns its autograd on)."""
    name = method + _SUFFIX[direction]

    def variant(self: Any, *args: Any, **kwargs: Any) -> Any:
        if enables_grad:
            self._ensure_in_context(name)
            self._grad_enabled = True
        return getattr(self, method)(*args, **{**kwargs, "direction": direction})

    variant.__name__ = variant.__qualname__ = name
    return variant


class HookedModuleRun:
    """A context manager that runs a hooked module once, when it exits.

    Hooks registered through the run apply to that run only (a registry of its own, active in
    the thread that exits the run) and are removed afterwards. An `EarlyStoppingException` ends
    the run quietly.

    Args:
        module (HookedModule): the module to run.
        data (TensorDict): its input.
        cache (TensorDict | None): where `save` stores. Default: the run cache.
        run_name (str | None): prefix of `save`'s keys. Default: ``"run"``.
        run_sep (str | None): separator after it. Default: ``"."``.
        run_cache (TensorDict | None): where `get` stores. Default: a new one.
        grad_enabled (bool): run with autograd on. Default: ``False``; the ``*_grad``
            methods turn it on.
        run_callback (Callable | None): ``run_callback(module, data)`` performs the run.
            Default: ``module(data)``.
    """

    def __init__(
        self,
        module: Any,  # a HookedModule (``_hooked`` imports this module)
        data: TensorDict,
        cache: TensorDict | None = None,
        run_name: str | None = None,
        run_sep: str | None = None,
        run_cache: TensorDict | None = None,
        grad_enabled: bool = False,
        run_callback: Callable[..., Any] | None = None,
    ) -> None:
        self._module = module
        self._data = data
        self._name = run_name or "run"
        self._sep = run_sep or "."
        self._cache = TensorDict() if run_cache is None else run_cache
        self._grad_enabled = grad_enabled
        self._run_callback = run_callback or (lambda module, data: module(data))
        self._save_cache = self._cache if cache is None else cache
        self._handles: list[RemovableHandleProtocol] = []
        self._in_context = False
        self._hooks = VirtualHooks()

    @property
    def cache(self) -> TensorDict:  # the run cache, where `get` stores
        return self._cache

    @cache.setter
    def cache(self, cache: TensorDict) -> None:
        self._cache = cache

    def __enter__(self) -> HookedModuleRun:
        self._in_context = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # As tdhook: the run happens on exit, also when the body raised.
        try:
            with entered(hooks=self._hooks), torch.set_grad_enabled(self._grad_enabled):
                self._run_callback(self._module, self._data)
        except EarlyStoppingException:
            pass
        finally:
            for handle in self._handles:
                handle.remove()
            self._in_context = False

    def _ensure_in_context(self, method: str) -> None:
        if not self._in_context:
            raise RuntimeError(f"Not in context, method {method} must be called in context or directly on the module")

    def _record(self, register: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with entered(recording=self._hooks):
            return register(*args, **kwargs)

    def set(
        self,
        key: str,
        value: Any,
        *,
        callback: Callable[..., Any] | None = None,
        direction: HookDirection = "fwd",
        prepend: bool = False,
        relative: bool = True,
    ) -> None:
        """Replace the value at ``key`` during the run (see `HookedModule.set`)."""
        self._ensure_in_context("set")
        self._handles.append(self._record(self._module.set, key, value, callback=callback, direction=direction,
                                          prepend=prepend, relative=relative))

    def get(
        self,
        key: str,
        *,
        cache_key: str | None = None,
        callback: Callable[..., Any] | None = None,
        direction: HookDirection = "fwd",
        prepend: bool = False,
        relative: bool = True,
    ) -> CacheProxy:
        """Store the value at ``key`` in the run cache; read it from the proxy after the run."""
        self._ensure_in_context("get")
        return self._cache_into(self._cache, key, cache_key, callback, direction, prepend, relative)

    def save(
        self,
        key: str,
        *,
        cache_key: str | None = None,
        callback: Callable[..., Any] | None = None,
        direction: HookDirection = "fwd",
        prepend: bool = False,
        relative: bool = True,
    ) -> CacheProxy:
        """Like `get`, into the outer cache, under ``"{run_name}{run_sep}{key}_{type}"``."""
        self._ensure_in_context("save")
        cache_key = cache_key or f"{self._name}{self._sep}{key}_{DIRECTION_TO_TYPE[direction]}"
        return self._cache_into(self._save_cache, key, cache_key, callback, direction, prepend, relative)

    def _cache_into(
        self,
        cache: TensorDict,
        key: str,
        cache_key: str | None,
        callback: Callable[..., Any] | None,
        direction: HookDirection,
        prepend: bool,
        relative: bool,
    ) -> CacheProxy:
        handle, proxy = self._record(self._module.get, cache, key, cache_key, callback=callback, direction=direction,
                                     prepend=prepend, relative=relative)
        self._handles.append(handle)
        return cast(CacheProxy, proxy)

    set_grad, get_grad, save_grad = (directed(name, "bwd", enables_grad=True) for name in ("set", "get", "save"))
    set_input, get_input, save_input = (directed(name, "fwd_pre") for name in ("set", "get", "save"))
    set_grad_output, get_grad_output, save_grad_output = (directed(name, "bwd_pre") for name in ("set", "get", "save"))

    def stop(self, key: str) -> None:
        """End the run when the module at ``key`` has run."""
        self._ensure_in_context("stop")
        self._handles.append(self._record(self._module.stop, key))
