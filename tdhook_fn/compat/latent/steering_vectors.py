"""``SteeringVectors`` and ``ActivationAddition`` (``tdhook.latent.steering_vectors``, tdhook 0.1.3).

Differences from tdhook 0.1.3 are listed in ``docs/compat.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tensordict import NestedKey, TensorDict
from tensordict.nn import TensorDictModuleBase

from tdhook_fn import resolve_path
from tdhook_fn.compat.contexts import HookingContextFactory, under
from tdhook_fn.compat.hooks import MultiHookHandle
from tdhook_fn.compat.hooks._registration import all_or_none
from tdhook_fn.compat.modules import HookedModule, RoutedModule
from tdhook_fn.compat.modules._hooked import switch_on
from tdhook_fn.compat.modules._wrappers import check_td
from tdhook_fn.latent import activation_addition

from ._calls import MethodModule, guarded_model, site_for

__all__ = ["ActivationAddition", "SteeringVectors"]


class SteeringVectors(HookingContextFactory):
    """Steering: the outputs of some modules replaced by ``steer_fn`` of them.

    Args:
        modules_to_steer (list[str]): module paths (relative to the model).
        steer_fn (Callable): ``steer_fn(module_key=, output=)`` returning the new output
            (``None`` keeps it); it must have the output's type.
    """

    def __init__(self, modules_to_steer: list[str], steer_fn: Callable[..., Any]) -> None:
        super().__init__()
        self._modules_to_steer = list(modules_to_steer)
        self._steer_fn = steer_fn

    def _hook_module(self, module: HookedModule) -> MultiHookHandle:
        steer_fn = self._steer_fn

        def steering(path: str) -> Callable[..., Any]:
            def callback(**kwargs: Any) -> Any:
                return steer_fn(module_key=path, output=kwargs["output"])

            return callback

        return all_or_none(module.set(module_key=path, value=None, callback=steering(path), direction="fwd")
                           for path in self._modules_to_steer)


class ActivationAddition(HookingContextFactory):
    """Steering vectors from pairs of examples, by `tdhook_fn.latent.activation_addition`.

    The hooked module reads ``(positive_key, key)`` and ``(negative_key, key)`` for its
    ``in_keys`` and returns ``TensorDict({steer_key: {module_key: vector}})``.

    Args:
        modules_to_steer (list[str]): module paths (relative to the model).
        positive_key (str | tuple[str, ...]): inputs of the positive examples.
            Default: ``"positive"``.
        negative_key (str | tuple[str, ...]): inputs of the negative examples.
            Default: ``"negative"``.
        steer_key (str | tuple[str, ...]): where the vectors go. Default: ``"steer"``.
        clean_intermediate_keys (bool): accepted; no intermediate entry is written.
        cache_callback (None): not supported (``NotImplementedError``).
    """

    def __init__(
        self,
        modules_to_steer: list[str],
        positive_key: Any = "positive",
        negative_key: Any = "negative",
        steer_key: Any = "steer",
        clean_intermediate_keys: bool = True,
        cache_callback: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__()
        if cache_callback is not None:
            raise NotImplementedError(
                "ActivationAddition: cache_callback is not supported; the vectors are "
                "tdhook_fn.latent.activation_addition of the module outputs (select within them with "
                "tdhook_fn.latent.Site(path, index=...))"
            )
        self._modules_to_steer = list(modules_to_steer)
        self._positive_key = positive_key
        self._negative_key = negative_key
        self._steer_key = steer_key
        self._hooked_module_kwargs["relative_path"] = "td_module.module[0]._td_module"

    def _prepare_module(
        self, module: RoutedModule, in_keys: list[NestedKey], out_keys: list[NestedKey], extra_relative_path: str
    ) -> TensorDictModuleBase:
        """A module computing the steering vectors of ``module``'s model on each call."""
        model = module.model
        for path in self._modules_to_steer:
            resolve_path(model, path)  # fail on entry
        sites = [site_for(i, path) for i, path in enumerate(self._modules_to_steer)]
        in_keys = list(in_keys)
        module_in = [*under(self._positive_key, in_keys), *under(self._negative_key, in_keys)]
        module_out = under(self._steer_key, self._modules_to_steer)

        def vectors(td: TensorDict) -> TensorDict:
            td = check_td("ActivationAddition", td, module_in)
            f, later, params = guarded_model(module, "ActivationAddition", self._modules_to_steer, prepared.entered)
            positive = td.get(self._positive_key).select(*in_keys).reshape(-1)
            negative = td.get(self._negative_key).select(*in_keys).reshape(-1)
            steer = activation_addition(f, params, positive, negative, sites, taps=later)
            result = TensorDict({}, batch_size=[], device=td.device)
            for site, key in zip(sites, module_out, strict=True):
                result.set(key, steer.get(site.key))
            return result

        nothing = lambda td: TensorDict({}, batch_size=[], device=td.device)  # (hooks disabled: tdhook finds none)
        prepared = MethodModule(vectors, nothing, module_in, module_out)  # (its calls read prepared.entered)
        return prepared

    _hook_module = staticmethod(switch_on)  # NOTE [a context's own hooks]
