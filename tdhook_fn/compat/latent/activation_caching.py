"""``ActivationCaching`` with the public API of ``tdhook.latent.activation_caching`` (tdhook 0.1.3).

Differences from tdhook 0.1.3 are listed in ``docs/compat.md``.
"""

# NOTE [caching is hooks]
# `tdhook_fn.latent.cache` cannot express tdhook's caching (the last run of a module run
# several times, ``callback`` with the module and its ``args``, backward directions, the
# model's batch dims), so the caching hooks are tdhook's own, registered as virtual hooks of
# the hooked module: they fill the cache as a side effect of its calls.

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from tensordict import TensorDict
from torch import nn

from tdhook_fn.compat.contexts import HookingContextFactory, HookingContextWithCache
from tdhook_fn.compat.hooks import HookDirection, HookFactory, MultiHookHandle, MultiHookManager
from tdhook_fn.compat.modules import HookedModule

from ._key_pattern import KeyPatternHooks, register_all

__all__ = ["ActivationCaching"]


class ActivationCaching(KeyPatternHooks, HookingContextFactory):
    """Caching the activations of the modules whose name matches a pattern.

    Args:
        key_pattern (str): a regular expression matched (``re.match``, so a prefix) against
            module names.
        relative (bool): names relative to the model (``"linear2"``); ``False``: to the
            hooked module (``"td_module.module.linear2"``). Default: ``True``.
        cache (TensorDict | None): where values go. Default: a new TensorDict, the
            context's ``cache``.
        callback (Callable | None): ``(module, ..., key, direction) -> value`` with the
            hook arguments of the direction (``args``, ``output``, ``grad_input``, ...);
            its result is cached instead of the direction's value.
        directions (list[str] | None): among ``"fwd"``, ``"bwd"``, ``"fwd_pre"``,
            ``"bwd_pre"``, ``"fwd_kwargs"``, ``"fwd_pre_kwargs"``. Default: ``["fwd"]``.
        use_nested_keys (bool): key by ``(direction, name)``; forced by several
            directions. Default: ``False``.
        clear_cache (bool): empty the cache on entering the context. Default: ``True``.

    Raises:
        RuntimeError: (on calling) a value is neither a tensor nor a TensorDict (tuples:
            the ``bwd``, ``bwd_pre`` and ``fwd_pre`` directions and tuple outputs need a
            ``callback``), as in tdhook.
    """

    _hooking_context_class = HookingContextWithCache

    def __init__(
        self,
        key_pattern: str,
        relative: bool = True,
        cache: TensorDict | None = None,
        callback: Callable[..., Any] | None = None,
        directions: list[HookDirection] | None = None,
        use_nested_keys: bool = False,
        clear_cache: bool = True,
    ) -> None:
        super().__init__()
        self._hooking_context_kwargs["cache"] = cache
        self._hooking_context_kwargs["clear_cache"] = clear_cache
        self._key_pattern = key_pattern
        self._relative = relative
        self._hook_manager = MultiHookManager(key_pattern)  # holds the compiled pattern
        self._callback = callback
        self._directions: list[HookDirection] = list(directions or ["fwd"])
        self._use_nested_keys = use_nested_keys or len(self._directions) > 1

    def _hook_module(self, module: HookedModule) -> MultiHookHandle:
        context = module.hooking_context
        if not isinstance(context, HookingContextWithCache):  # a composite's context class, not this factory's own
            raise TypeError(
                f"ActivationCaching: the context is a {type(context).__name__}, which has no cache for the "
                "activations; a CompositeHookingContextFactory with ActivationCaching needs a context class with "
                "one: set its _hooking_context_class to HookingContextWithCache (tdhook_fn.compat.contexts) or a "
                "subclass of it")
        cache = context.cache
        containers = (nn.ModuleList, nn.ModuleDict)
        selected = [(name, submodule) for name, submodule in self._selected(module)
                    if not isinstance(submodule, containers)]

        def hooks() -> Iterator[tuple[nn.Module, Callable[..., Any], HookDirection]]:
            for direction in self._directions:
                for name, submodule in selected:
                    key = (direction, name) if self._use_nested_keys else name
                    yield submodule, HookFactory.make_caching_hook(key, cache, direction=direction,
                                                                   callback=self._callback), direction

        return register_all(module, hooks())
