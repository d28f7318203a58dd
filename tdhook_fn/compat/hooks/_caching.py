"""References to caches and the hook factory (``tdhook.hooks``, part 2)."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any, Generic, NoReturn

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from ._registration import DIRECTION_TO_RETURN_INDEX, HookDirection, T, _params_for, _UnraveledKey


class MutableWeakRef(Generic[T]):
    """A weak reference to ``referee`` whose target can be replaced."""

    def __init__(self, referee: T) -> None:
        self._ref: weakref.ref[T] = weakref.ref(referee)

    def resolve(self) -> T | None:
        """The target, or ``None`` once collected."""
        return self._ref()

    def set(self, referee: T) -> None:
        self._ref = weakref.ref(referee)


class TensorDictRef:
    """A strong, replaceable reference to a TensorDict (``None`` until `set`)."""

    def __init__(self, td: TensorDict | None) -> None:
        self._td = td

    def resolve(self) -> TensorDict | None:
        return self._td

    def set(self, td: TensorDict) -> None:
        self._td = td


# What a caching hook or a CacheProxy may write to / read from.
_Cache = TensorDict | MutableWeakRef[TensorDict] | TensorDictRef


def _by_name(params: tuple[str, ...], args: tuple[Any, ...]) -> dict[str, Any]:
    """Hook arguments keyed by their parameter names, as callbacks receive them."""
    return dict(zip(params, args, strict=False))


def cacheable(value: Any, callback: str = "callback") -> Any:
    """``value``, if a cache can hold it (a tensor or a TensorDict); else tdhook's RuntimeError."""
    if not isinstance(value, (torch.Tensor, TensorDictBase)):
        raise RuntimeError(f"{type(value).__name__} values are not supported for caching, use a `{callback}` to "
                           "return a tensor or a tensordict")
    return value


def same_type(new: Any, original: Any) -> Any:
    """``new``, which must have ``original``'s exact type (torch accepts many replacements silently)."""
    if type(new) is not type(original):
        raise RuntimeError(f"Callback returned a value of type {type(new).__name__} but the original value was of "
                           f"type {type(original).__name__}")
    return new


def _resolve_cache(cache: _Cache) -> TensorDict:
    """The TensorDict behind ``cache``; ValueError when a reference has nothing behind it."""
    target = cache.resolve() if isinstance(cache, (MutableWeakRef, TensorDictRef)) else cache
    if target is None:
        raise ValueError("Dead reference to cache")
    return target


class CacheProxy:
    """Stands for ``cache[key]`` (``cache`` a TensorDict or a reference to one, held weakly), read by `resolve`."""

    def __init__(self, key: _UnraveledKey, cache: _Cache) -> None:
        self._key = key
        self._cache: weakref.ref[_Cache] = weakref.ref(cache)

    def resolve(self) -> Any:
        """``cache.get(key)`` now; ValueError when the cache (or what a reference points to) is gone."""
        cache = self._cache()
        if cache is None:
            raise ValueError("Dead reference to cache")
        return _resolve_cache(cache).get(self._key)


class EarlyStoppingException(Exception):
    """Raised by a stopping hook to end a forward pass early; ``key`` names what triggered it."""

    def __init__(self, key: str) -> None:
        self._key = key
        super().__init__(f"Early stopping triggered for key {key}")


class HookFactory:
    """Builds hooks that cache, replace, read or stop at a module's values."""

    @staticmethod
    def _check_callback_signature(
        callback: Callable[..., Any] | None, expected_param_names: set[str]
    ) -> None:
        """ValueError unless ``callback`` (``None`` passes) takes ``expected_param_names`` by keyword."""
        if callback is None:
            return
        params = inspect.signature(callback).parameters.values()
        if any(p.kind is p.POSITIONAL_ONLY for p in params):
            raise ValueError("Callback cannot take positional-only parameters: all go by name")
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return
        missing = expected_param_names - {p.name for p in params}
        if missing:
            raise ValueError(f"Callback missing required parameters: {missing}")

    @staticmethod
    def make_caching_hook(
        key: _UnraveledKey,
        cache: _Cache,
        *,
        callback: Callable[..., Any] | None = None,
        direction: HookDirection = "fwd",
    ) -> Callable[..., Any]:
        """A hook storing its last argument, or ``callback(**hook arguments, key, direction)``, in ``cache[key]``.

        ValueError: an unknown direction or unfit callback. The hook raises RuntimeError for a
        value that is no tensor or TensorDict, ValueError when the cache reference is dead.
        """
        params = _params_for(direction)
        HookFactory._check_callback_signature(callback, set(params))
        # fwd_pre_kwargs hooks get (module, args, kwargs): store args, not the kwargs dict.
        value_index = -2 if direction == "fwd_pre_kwargs" else -1

        def hook(*args: Any) -> None:
            if callback is None:
                value = args[value_index]
            else:
                value = callback(**_by_name(params, args), key=key, direction=direction)
            # a copy, as tdhook_fn.capture keeps: a later in-place write would change a reference (docs/compat.md)
            _resolve_cache(cache)[key] = cacheable(value).clone()

        return hook

    @staticmethod
    def make_setting_hook(
        value: Any, *, callback: Callable[..., Any] | None = None, direction: HookDirection = "fwd"
    ) -> Callable[..., Any]:
        """A hook replacing what torch lets a ``direction`` hook replace by ``value`` (a `CacheProxy`
        read when it runs), or by ``callback(**hook arguments, value, direction)`` (``None`` keeps it).

        ValueError: an unknown direction or unfit callback. The hook raises RuntimeError when
        the replacement's type is not the original's.
        """
        params = _params_for(direction)
        slot = DIRECTION_TO_RETURN_INDEX[direction]
        HookFactory._check_callback_signature(callback, set(params))

        def hook(*args: Any) -> Any:
            new = value.resolve() if isinstance(value, CacheProxy) else value
            if callback is not None:
                new = callback(**_by_name(params, args), value=new, direction=direction)
            return new if new is None else same_type(new, args[slot])

        return hook

    @staticmethod
    def make_reading_hook(
        *, callback: Callable[..., Any], direction: HookDirection = "fwd"
    ) -> Callable[..., Any]:
        """A hook calling ``callback(**hook arguments, direction)``, changing nothing; ValueError as above."""
        params = _params_for(direction)
        HookFactory._check_callback_signature(callback, set(params))

        def hook(*args: Any) -> None:
            callback(**_by_name(params, args), direction=direction)

        return hook

    @staticmethod
    def make_stopping_hook(key: str) -> Callable[..., Any]:
        """A forward hook raising `EarlyStoppingException` ``(key)``."""

        def hook(module: nn.Module, args: Any, output: Any) -> NoReturn:
            raise EarlyStoppingException(key)

        return hook
