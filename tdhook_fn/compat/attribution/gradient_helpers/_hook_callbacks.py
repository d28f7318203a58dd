"""tdhook's callbacks as the pure methods take them: ``output_grad_callbacks`` as gradient maps, ``cache_callback``
as a tap, and the activations ``init_attr_cache_in`` chooses among."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torch.utils.hooks import RemovableHandle

from tdhook_fn import Functional, Tap, capture
from tdhook_fn._functional import with_copied_inputs
from tdhook_fn.compat.hooks import HookFactory
from tdhook_fn.compat.hooks._caching import cacheable
from tdhook_fn.compat.modules._scope import HookTap

__all__ = ["CACHE_OUT", "CachedOutput", "OwnHook", "activations", "grad_output_hook", "hooked_since", "placed"]

_CACHE_IN = "_tdhook_fn_cache_in_"
CACHE_OUT = "_tdhook_fn_cache_out_"  # (the keys of `CachedOutput` captures, numbered)


def activations(f: Functional, hooks: Sequence[Tap], params: TensorDictBase, inputs: TensorDictBase,
                paths: Sequence[str]) -> TensorDict:
    """Activations at ``paths`` (keyed by path) for ``inputs`` with the batch flattened, no grad, read before the
    user's ``hooks`` change them (NOTE [the user's hooks after the method's])."""
    flat = with_copied_inputs(inputs.reshape(-1))  # (a forward may write its inputs in place)
    probe = f.with_taps(*(capture(path, key=f"{_CACHE_IN}{i}") for i, path in enumerate(paths)), *hooks)
    with torch.no_grad():
        out = probe(params, flat)
    result = TensorDict({}, batch_size=flat.batch_size)
    for i, path in enumerate(paths):
        result.set(path, out.get(f"{_CACHE_IN}{i}"))
    return result


@dataclass(frozen=True)
class OwnHook:
    """A backward hook tdhook's context registers on ``target``, the user's submodule at ``path``, on entry: as a
    tap that works on any module (``fast``) and as the torch hook itself (``real``), which torch orders among the
    user's hooks on the module (NOTE [a context's own hooks])."""

    target: nn.Module
    fast: Tap
    real: Tap


def grad_output_hook(path: str, callback: Callable[..., Any], submodule: nn.Module) -> OwnHook:
    """An ``output_grad_callbacks`` entry, the callback called as tdhook's ``set_grad_output`` hook calls it on
    ``submodule``: a gradient map (`tdhook_fn.map_grad`) at its output, or that backward pre-hook."""
    hook = HookFactory.make_setting_hook(None, callback=callback, direction="bwd_pre")

    def fn(grad: torch.Tensor) -> torch.Tensor:
        new = hook(submodule, (grad,))
        return grad if new is None else new[0]

    return OwnHook(submodule, Tap(path, "map_grad", fn, "output"),
                   HookTap(path, "custom", hook, direction="bwd_pre", target=submodule))


def hooked_since(later: Sequence[Tap]) -> set[int]:
    """The ids of the user's submodules the hooks recorded since the context was entered (``later``) are on."""
    return {id(tap.target) for tap in later if isinstance(tap, HookTap)}


def placed(own: Sequence[OwnHook], later: Sequence[Tap]) -> tuple[Tap, ...]:
    """The context's hooks ``own`` as taps: the torch hook on a module the user hooked since the context was entered
    (``later``, whose hooks torch then runs after it), the tap elsewhere (NOTE [a context's own hooks])."""
    hooked = hooked_since(later)
    return tuple(hook.real if id(hook.target) in hooked else hook.fast for hook in own)


@dataclass(frozen=True)
class CachedOutput(Tap):
    """A custom tap storing ``cache_callback``'s result for the user's submodule ``target`` under ``key``,
    the callback called as tdhook's caching hook calls it."""

    target: Any = field(default=None, compare=False, repr=False)

    def attach(self, module: nn.Module, captured: dict[str, Any]) -> RemovableHandle:
        callback: Callable[..., Any] | None = self.fn
        original, key, path = self.target, self.key, self.path
        assert callback is not None

        def hook(_shadow: nn.Module, args: Any, output: Any) -> None:
            value = callback(module=original, args=args, output=output, key=("_cache_out", path), direction="fwd")
            captured[key] = cacheable(value, "cache_callback")

        return module.register_forward_hook(hook)
