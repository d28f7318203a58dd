"""What the latent contexts share: the model at call time, sites, tdhook's value checks."""

# NOTE [latent contexts, pure]
# ``ActivationPatching`` and ``ActivationAddition`` run no hook of their own: a prepared
# module is one `FunctionModule` that, on each call, takes the model as a pure function
# (with the hooked module's active virtual hooks) and calls `tdhook_fn.latent.cache`,
# `patch` or `activation_addition`, on the batch flattened to one dim (as tdhook's
# ``ModuleCallWithCache``).
#
# tdhook caches a module's output with a hook that refuses anything but a tensor (a tuple
# output needs a ``cache_callback``, whose result must then be patched back as a tuple).
# The pure methods read a tuple at element 0 instead, so a patch function written for
# tdhook would see another value: `guarded_model` keeps tdhook's refusal, naming the
# module, rather than give a different number.

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

from tdhook_fn import Functional, Tap, intervene
from tdhook_fn.compat.modules import RoutedModule
from tdhook_fn.latent import Site

__all__ = ["guarded_model", "site_for"]


def site_for(index: int, path: str, site: str = "output") -> Site:
    """A site at ``path`` with a private key (a module name could equal an out_key)."""
    return Site(path, site="input" if site == "input" else "output", key=f"_tdhook_fn_{site}_{index}")


def guarded_model(module: RoutedModule, caller: str, paths: Sequence[str]) -> tuple[Functional, TensorDictBase]:
    """The model as a pure function refusing a non-tensor output at ``paths`` (as tdhook's caching hook
    does), and its own tensors, live, as a tdhook forward (gradients reach ``model.weight.grad``)."""

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

    return module.functional().with_taps(*(guard(path) for path in paths)), module.params()
