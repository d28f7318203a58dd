"""``Adapters`` with the public API of ``tdhook.weights.adapters`` (tdhook 0.1.3).

Differences from tdhook 0.1.3 are listed in ``docs/compat.md``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

from tensordict import TensorDict
from torch import nn

from tdhook_fn.compat.contexts import HookingContextFactory, HookingContextWithCache
from tdhook_fn.compat.hooks import (
    DIRECTION_TO_RETURN,
    CacheProxy,
    HookDirection,
    MultiHookHandle,
    RemovableHandleProtocol,
)
from tdhook_fn.compat.hooks._registration import all_or_none
from tdhook_fn.compat.modules import HookedModule

__all__ = ["Adapters", "HookedModuleWithAdapters"]

_DIRECTIONS = ("fwd", "fwd_pre")


class HookedModuleWithAdapters(HookedModule):
    """A `HookedModule` (``*args``, ``**kwargs``) holding the ``adapters`` (name -> module) as an ``nn.ModuleDict``."""

    def __init__(self, *args: Any, adapters: dict[str, nn.Module], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.adapters = nn.ModuleDict(adapters)


def _adapter_callback(adapter: nn.Module, proxy: CacheProxy | None) -> Callable[..., Any]:
    """tdhook's setting-hook callback: ``adapter(value, **the hook arguments its signature names)``."""
    accepted = frozenset(inspect.signature(adapter).parameters)

    def callback(**kwargs: Any) -> Any:
        # an adapter of its own module takes that module's value; one fed from another module's (a transcoder)
        # takes the cached value, and may still name this module's (``output=``, ``args=``) as a keyword
        adapter_input = kwargs.pop(DIRECTION_TO_RETURN[kwargs["direction"]]) if proxy is None else proxy.resolve()
        return adapter(adapter_input, **{k: v for k, v in kwargs.items() if k in accepted})

    return callback


class Adapters(HookingContextFactory):
    """ROME, sparse autoencoders and transcoders, as tdhook's ``Adapters``.

    Args:
        adapters (dict[str, tuple[nn.Module, str, str]]): ``name -> (adapter, in_key,
            out_key)``: the output (``fwd``) or the positional inputs (``fwd_pre``) of the
            module at ``out_key`` are replaced by ``adapter(x, **kwargs)``, where ``x`` is
            that value when ``in_key == out_key``, else the value cached at ``in_key`` (``kwargs``: the
            hook arguments its signature names, as in tdhook).
        cache_callback (Callable | None): transforms what is cached at ``in_key`` (a
            ``get`` hook callback). Default: the raw value.
        relative (bool): keys start at the model; else at the hooked module. Default: ``True``.
        directions (list[str] | None): ``"fwd"`` and/or ``"fwd_pre"``. Default: ``["fwd"]``.
        cache (TensorDict | None): the context's cache, receiving the values at the
            ``in_key`` of adapters reading another module. Default: a new TensorDict.
        clear_cache (bool): clear the cache when the context is entered. Default: ``True``.

    Raises:
        NotImplementedError: another direction is asked for.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> class SAE(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.enc, self.dec = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)
        ...     def forward(self, x, **kwargs):
        ...         return self.dec(torch.relu(self.enc(x)))
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> with Adapters({"sae": (SAE(), "[0]", "[0]")}).prepare(net) as hooked:
        ...     hooked(TensorDict(input=torch.randn(5, 3), batch_size=[5]))["output"].sum().backward()
        ...     hooked.adapters["sae"].enc.weight.grad is not None
        True
    """

    _hooked_module_class = HookedModuleWithAdapters
    _hooking_context_class = HookingContextWithCache

    def __init__(
        self,
        adapters: dict[str, tuple[nn.Module, str, str]],
        cache_callback: Callable[..., Any] | None = None,
        relative: bool = True,
        directions: list[HookDirection] | None = None,
        cache: TensorDict | None = None,
        clear_cache: bool = True,
    ) -> None:
        super().__init__()
        directions = directions or ["fwd"]
        unsupported = [d for d in directions if d not in _DIRECTIONS]
        if unsupported:
            raise NotImplementedError(f"Adapters: directions {unsupported} are not supported, only 'fwd' and 'fwd_pre'")
        self._hooked_module_kwargs["adapters"] = {name: spec[0] for name, spec in adapters.items()}
        self._hooking_context_kwargs["clear_cache"] = clear_cache
        self._hooking_context_kwargs["cache"] = cache
        self._adapters = adapters
        self._cache_callback = cache_callback
        self._relative = relative
        self._directions: list[HookDirection] = list(directions)

    def _hook_module(self, module: HookedModule) -> MultiHookHandle:
        """Register each adapter and direction as a setting hook, in tdhook's order."""
        context = module.hooking_context
        if not isinstance(context, HookingContextWithCache):
            raise TypeError("Adapters hooks modules in a HookingContextWithCache")
        cache = context.cache

        def registering() -> Iterator[RemovableHandleProtocol]:
            for direction in self._directions:
                for adapter, in_key, out_key in self._adapters.values():
                    proxy = None
                    if in_key != out_key:
                        handle, proxy = module.get(cache=cache, module_key=in_key, callback=self._cache_callback,
                                                   direction=direction, relative=self._relative)
                        yield handle
                    yield module.set(out_key, None, callback=_adapter_callback(adapter, proxy), direction=direction,
                                     relative=self._relative)

        return all_or_none(registering())
