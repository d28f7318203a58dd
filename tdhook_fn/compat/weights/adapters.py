"""Adapters with the public API of ``tdhook.weights.adapters`` from tdhook 0.1.3.

ROME-style edits and sparse autoencoders replace an activation by ``adapter(activation)``
(``in_key == out_key``); transcoders replace the activation at ``out_key`` by the adapter
applied to the one cached at ``in_key``.

**Adapters as splices.**
tdhook registers a setting hook per adapter and direction on the model. Here
``_hook_module`` registers nothing on the model: it turns each of those hooks into an
`AdapterCall` (the same callback as a
module holding the adapter) and gives them to the prepared module. Every call of the
hooked module then runs the model live (with its own parameters) with each of them spliced
in where its hook would act, as a plain forward of the adapter. So a loss on the adapted
output back-propagates into the adapters' own ``nn.Parameter`` objects (train them with
any ``torch.optim`` optimizer, as with tdhook) and into the model's, and buffers update as
in tdhook (BatchNorm in training mode, in the model and in the adapters). The adapters
run before the hooks registered on the hooked module.
For an adapter reading another module, the activation there is stored in the context's
``cache`` by an ordinary (virtual) ``get`` hook, under tdhook's key
``"{in_key}_{output|input}"`` and through ``cache_callback``, and read from there, as
tdhook does.

Differences from tdhook 0.1.3:

- ``directions`` other than ``"fwd"`` and ``"fwd_pre"`` raise ``NotImplementedError``.
- With ``relative=False`` the keys start at the hooked module and must end on a submodule
  of the model (``ValueError`` otherwise, when the context is entered).
- The cache ``get`` hooks run after the adapters spliced into the same module: if an
  adapter reads module ``X`` and an adapter listed *later* replaces ``X``'s output,
  tdhook caches the original value and this caches the replaced one.
- For ``fwd_pre``, a module called with one positional argument that is itself a tuple
  is taken as called with that tuple's items.
- Calling the raw model runs it without adapters; a TensorDictModule whose ``in_keys``
  map to keyword arguments is refused (``ValueError``) when the hooked module is called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase, TensorDictModuleWrapper
from torch import nn

from tdhook_fn import Functional, PathError
from tdhook_fn._taps import Side, Tap
from tdhook_fn._types import Keys
from tdhook_fn.compat.contexts import HookingContextFactory, HookingContextWithCache
from tdhook_fn.compat.hooks import HookDirection, MultiHookHandle, RemovableHandleProtocol, resolve_submodule_path
from tdhook_fn.compat.modules import HookedModule, RoutedModule
from tdhook_fn.compat.modules._virtual import module_path

from ._adapter_call import AdapterCall, ArgsRecorder, recording_args

__all__ = ["Adapters", "HookedModuleWithAdapters"]

Splice = tuple[AdapterCall, str, Side]  # (the hook as a module, its path in the model, the site)
_SITES: dict[str, Side] = {"fwd": "output", "fwd_pre": "input"}


class HookedModuleWithAdapters(HookedModule):
    """A hooked module holding the adapters as ``self.adapters`` (an ``nn.ModuleDict``).

    Args:
        *args (Any): passed on to `HookedModule`.
        **kwargs (Any): passed on to `HookedModule`.
        adapters (dict[str, nn.Module]): the adapter modules by name.
    """

    def __init__(self, *args: Any, adapters: dict[str, nn.Module], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.adapters = nn.ModuleDict(adapters)


class _AdaptedModule(TensorDictModuleWrapper):
    """The prepared module: runs the routed model with the splices given by ``attach``."""

    def __init__(self, routed: RoutedModule) -> None:
        super().__init__(routed)
        self._splices: tuple[Splice, ...] = ()

    @property
    def routed(self) -> RoutedModule:
        return cast(RoutedModule, self.td_module)

    def attach(self, splices: tuple[Splice, ...]) -> RemovableHandleProtocol:
        """Use ``splices`` from now on; the handle's ``remove()`` stops using them."""
        self._splices = splices
        return _Detach(self, splices)

    def forward(self, tensordict: TensorDictBase, *args: Any, **kwargs: Any) -> Any:
        splices, routed = self._splices, self.routed
        if not splices:
            return routed(tensordict, *args, **kwargs)
        hooked = routed.functional()  # the model with the hooks active now as taps
        # each adapter a plain forward of its own, spliced in before the hooks
        splice_taps = [Tap(path, "intervene", call, site) for call, path, site in splices]
        recorders = [ArgsRecorder(path, "custom", spec=call.spec) for call, path, _ in splices if call.spec.needs_args]
        adapted = Functional(hooked.model, hooked.in_keys, hooked.out_keys, (*recorders, *splice_taps, *hooked.taps),
                             hooked.keywords)
        with recording_args():
            outputs = adapted.call_live(tensordict, overrides=routed.overrides())
        for out_key in hooked.out_keys:
            tensordict.set(out_key, outputs.get(out_key))
        return tensordict


class _Detach:
    """Removes one ``attach`` of an `_AdaptedModule` (once; later ones stay)."""

    def __init__(self, module: _AdaptedModule, splices: tuple[Splice, ...]) -> None:
        self._module = module
        self._splices = splices

    def remove(self) -> None:
        if self._module._splices is self._splices:
            self._module._splices = ()


class Adapters(HookingContextFactory):
    """ROME, sparse autoencoders and transcoders, as tdhook's ``Adapters``.

    Args:
        adapters (dict[str, tuple[nn.Module, str, str]]): ``name -> (adapter, in_key,
            out_key)``: the output (``fwd``) or the positional inputs (``fwd_pre``) of the
            module at ``out_key`` are replaced by ``adapter(x, **kwargs)``, where ``x`` is
            that value when ``in_key == out_key``, else the value cached at ``in_key``;
            ``kwargs`` as tdhook (see `tdhook_fn.compat.weights._adapter_call`; a
            ``fwd`` adapter receives ``args=``).
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
        unsupported = [d for d in directions if d not in _SITES]
        if unsupported:
            raise NotImplementedError(f"Adapters: directions {unsupported} are not supported, only 'fwd' and 'fwd_pre'")
        self._hooked_module_kwargs["adapters"] = {name: spec[0] for name, spec in adapters.items()}
        self._hooking_context_kwargs["clear_cache"] = clear_cache
        self._hooking_context_kwargs["cache"] = cache
        self._adapters = adapters
        self._cache_callback = cache_callback
        self._relative = relative
        self._directions: list[HookDirection] = list(directions)

    def _prepare_module(
        self, module: TensorDictModuleBase, in_keys: Keys, out_keys: Keys, extra_relative_path: str
    ) -> TensorDictModuleBase:
        """Wrap the routed model so that the adapters given by ``_hook_module`` reach its calls."""
        if not isinstance(module, RoutedModule):
            raise TypeError(f"Adapters prepares a RoutedModule, got {type(module).__name__}")
        return _AdaptedModule(module)

    def _hook_module(self, module: HookedModule) -> MultiHookHandle:
        """Register each adapter and direction, in tdhook's order."""
        prepared = module.td_module
        while not isinstance(prepared, _AdaptedModule) and isinstance(prepared, TensorDictModuleWrapper):
            prepared = prepared.td_module  # a later factory's wrapper (Pruning's, in a composite)
        context = module.hooking_context
        if not isinstance(prepared, _AdaptedModule) or not isinstance(context, HookingContextWithCache):
            raise TypeError("Adapters hooks modules it prepared itself, in a HookingContextWithCache")
        model = prepared.routed.model
        root = model if self._relative else module
        handles: list[RemovableHandleProtocol] = []
        splices: list[Splice] = []
        try:
            for direction in self._directions:
                for name, (adapter, in_key, out_key) in self._adapters.items():
                    proxy = None
                    if in_key != out_key:
                        handle, proxy = module.get(
                            cache=context.cache,
                            module_key=in_key,
                            callback=self._cache_callback,
                            direction=direction,
                            relative=self._relative,
                        )
                        handles.append(handle)
                    target = resolve_submodule_path(root, out_key)
                    path = module_path(model, target) if isinstance(target, nn.Module) else None
                    if path is None:
                        raise PathError(f"Adapters: adapter {name!r}: {out_key!r} names no submodule of the model")
                    splices.append((AdapterCall(adapter, direction, target, proxy), path, _SITES[direction]))
            handles.append(prepared.attach(tuple(splices)))
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        return MultiHookHandle(handles)
