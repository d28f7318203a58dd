"""What the latent contexts share: the model at call time, sites, tdhook's value checks."""

# NOTE [latent contexts, pure]
# ``ActivationPatching`` and ``ActivationAddition`` run no hook of their own: a prepared
# module is one `MethodModule` that, on each call, takes the model as a pure function
# and calls `tdhook_fn.latent.cache`, `patch` or `activation_addition`, on the batch
# flattened to one dim (as tdhook's ``ModuleCallWithCache``). The hooked module's virtual
# hooks recorded before entry are in the function; those recorded since are the method's
# last taps, as tdhook registers its hooks on entry (NOTE [the user's hooks after the method's]).
#
# tdhook does this work with hooks, which ``disable_context_hooks`` removes for a while: its
# patching then runs the model plainly and its addition finds no vector. The prepared module
# does the same while it is off (NOTE [a context's own hooks]).
#
# tdhook caches a module's output with a hook that refuses anything but a tensor (a tuple
# output needs a ``cache_callback``, whose result must then be patched back as a tuple).
# The pure methods read a tuple at element 0 instead, so a patch function written for
# tdhook would see another value: `guarded_model` keeps tdhook's refusal, naming the
# module, rather than give a different number.

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from tdhook_fn import Functional, Tap, intervene
from tdhook_fn.compat.modules import FunctionModule, RoutedModule
from tdhook_fn.compat.modules._hooked import ContextWork
from tdhook_fn.latent import Site

__all__ = ["MethodModule", "guarded_model", "site_for"]


class MethodModule(ContextWork, FunctionModule):
    """A latent context's prepared module: ``td_fn`` while the context's hooks are on, ``off_fn`` while they are
    disabled (NOTE [latent contexts, pure]); ``td_fn`` reads ``entered`` (NOTE [a context's own hooks])."""

    def __init__(self, td_fn: Callable[[TensorDict], TensorDict], off_fn: Callable[[TensorDict], TensorDict],
                 in_keys: list[Any], out_keys: list[Any]) -> None:
        super().__init__(td_fn, in_keys, out_keys)
        self._off_fn = off_fn

    def forward(self, td: TensorDict) -> TensorDict:
        return self._td_fn(td) if self.on else self._off_fn(td)


def site_for(index: int, path: str, site: str = "output") -> Site:
    """A site at ``path`` with a private key (a module name could equal an out_key)."""
    return Site(path, site="input" if site == "input" else "output", key=f"_tdhook_fn_{site}_{index}")


def guarded_model(module: RoutedModule, caller: str, paths: Sequence[str],
                  entered: int) -> tuple[Functional, tuple[Tap, ...], TensorDictBase]:
    """The model as a pure function refusing a non-tensor output at ``paths`` (as tdhook's caching hook
    does), with the virtual hooks recorded before the mark ``entered``; those recorded since, as taps for the method
    to attach after its own (NOTE [the user's hooks after the method's]); and the model's own tensors, live, as a
    tdhook forward (gradients reach ``model.weight.grad``)."""

    def guard(path: str) -> Tap:
        def check(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                raise RuntimeError(
                    f"{caller}: the module {path!r} returned a {type(value).__name__}; {type(value).__name__} values "
                    "are not supported for caching (as in tdhook). Patch or steer a submodule returning a tensor, or "
                    f"use tdhook_fn.latent with Site({path!r}, element=0)"
                )
            return value

        return intervene(path, check)

    f, later = module.functional_and_hooks(entered)
    return f.with_taps(*(guard(path) for path in paths)), later, module.params()
