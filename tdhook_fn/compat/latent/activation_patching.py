"""``ActivationPatching`` with the public API of ``tdhook.latent.activation_patching`` (tdhook 0.1.3).

NOTE [latent contexts, pure] in ``_calls``; differences from tdhook 0.1.3 are listed in ``docs/compat.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase

from tdhook_fn import Tap, resolve_path
from tdhook_fn.compat.contexts import HookingContextFactory, under
from tdhook_fn.compat.hooks import HookFactory
from tdhook_fn.compat.hooks._caching import cacheable, same_type
from tdhook_fn.compat.modules import RoutedModule
from tdhook_fn.compat.modules._hooked import switch_on
from tdhook_fn.compat.modules._wrappers import check_td
from tdhook_fn.latent import Site, cache, patch

from ._calls import MethodModule, guarded_model, site_for

__all__ = ["ActivationPatching"]


class ActivationPatching(HookingContextFactory):
    """Activation patching: outputs of a run with some activations taken from another.

    Args:
        modules_to_patch (list[str]): module paths (relative to the model) to patch.
        patch_key (str | tuple[str, ...]): the sub-TensorDict holding the inputs of the
            patched run; its outputs go there too. Default: ``"patched"``.
        clean_intermediate_keys (bool): drop the ``"_cache"`` entry of clean activations
            from the result. Default: ``True``.
        patch_fn (Callable | None): ``patch_fn(module_key=, output=, output_to_patch=)``
            returning the patched output (``None``: the clean value). Default: the clean
            value.
        cache_callback (Callable | None): ``(module, args, output, key, direction) -> value``
            giving the value cached (and patched in) instead of the output.

    Raises:
        RuntimeError: (on calling) a patched module returns something other than a tensor.
        ValueError: (on calling) a patched module runs more than once per forward.
    """

    def __init__(
        self,
        modules_to_patch: list[str],
        patch_key: Any = "patched",
        clean_intermediate_keys: bool = True,
        patch_fn: Callable[..., Any] | None = None,
        cache_callback: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__()
        self._modules_to_patch = list(modules_to_patch)
        self._patch_key = patch_key
        self._clean_intermediate_keys = clean_intermediate_keys
        self._patch_fn = patch_fn
        self._cache_callback = cache_callback
        self._hooked_module_kwargs["relative_path"] = "td_module.module[0]._td_module"

    def _prepare_module(
        self, module: RoutedModule, in_keys: list[NestedKey], out_keys: list[NestedKey], extra_relative_path: str
    ) -> TensorDictModuleBase:
        """A module computing the clean and the patched run of ``module``'s model on each call."""
        model = module.model
        submodules = {path: resolve_path(model, path) for path in self._modules_to_patch}  # fail on entry
        HookFactory._check_callback_signature(self._cache_callback, {"module", "args", "output"})  # (None passes)
        sites = [site_for(i, path) for i, path in enumerate(self._modules_to_patch)]
        inputs_at = [site_for(i, path, "input") for i, path in enumerate(self._modules_to_patch)]
        in_keys, out_keys = list(in_keys), list(out_keys)
        module_in = [*in_keys, *under(self._patch_key, in_keys)]

        def patching(td: TensorDict) -> TensorDict:
            td = check_td("ActivationPatching", td, module_in)
            f, later, params = guarded_model(module, "ActivationPatching", self._modules_to_patch, prepared.entered)
            batch = td.batch_size
            clean = td.select(*in_keys).reshape(-1)
            corrupted = td.get(self._patch_key).select(*in_keys).reshape(-1)
            with_inputs = self._cache_callback is not None
            acts = cache(f, params, clean, [*sites, *inputs_at] if with_inputs else sites, outputs=True, taps=later)
            sources = TensorDict({}, batch_size=clean.batch_size)
            for site, at, path in zip(sites, inputs_at, self._modules_to_patch, strict=True):
                value = acts.get(site.key)
                if with_inputs:
                    value = self._cached(submodules[path], path, acts.get(at.key), value)
                sources.set(site.key, value)
            patched = self._patched_run(f, later, params, corrupted, sites, sources)
            td.update(acts.select(*out_keys).reshape(batch))
            self._put(td, patched.select(*out_keys).reshape(batch))
            if not self._clean_intermediate_keys:
                td.set("_cache", TensorDict(
                    {path: sources.get(site.key) for site, path in zip(sites, self._modules_to_patch, strict=True)},
                    batch_size=clean.batch_size,
                ).reshape(batch))
            return td

        def plainly(td: TensorDict) -> TensorDict:  # (with the context's hooks disabled, as tdhook's)
            td = check_td("ActivationPatching", td, module_in)
            f, params = module.functional(), module.params()
            batch = td.batch_size
            td.update(f(params, td.select(*in_keys).reshape(-1)).select(*out_keys).reshape(batch))
            corrupted = td.get(self._patch_key).select(*in_keys).reshape(-1)
            self._put(td, f(params, corrupted).select(*out_keys).reshape(batch))
            return td

        module_out = [*out_keys, *under(self._patch_key, out_keys)]
        prepared = MethodModule(patching, plainly, module_in, module_out)  # (its calls read prepared.entered)
        return prepared

    _hook_module = staticmethod(switch_on)  # NOTE [a context's own hooks]

    def _cached(self, submodule: Any, path: str, first_input: Any, output: torch.Tensor) -> Any:
        assert self._cache_callback is not None
        value = self._cache_callback(module=submodule, args=(first_input,), output=output, key=path, direction="fwd")
        return cacheable(value, "cache_callback")

    def _patched_run(
        self, f: Any, later: tuple[Tap, ...], params: TensorDictBase, corrupted: TensorDictBase, sites: list[Site],
        sources: TensorDictBase,
    ) -> TensorDictBase:
        if self._patch_fn is None:
            return patch(f, params, corrupted, sites, sources, taps=later)
        patch_fn = self._patch_fn

        def combine(path: str, source: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
            def new(output: torch.Tensor) -> torch.Tensor:
                value = patch_fn(module_key=path, output=output, output_to_patch=source)
                value = source if value is None else value
                if value is source:  # the model may write its activation in place: never the cached tensor
                    value = source.clone()
                return cast(torch.Tensor, same_type(value, output))

            return new

        editors = [site.editor(combine(path, sources.get(site.key)))
                   for site, path in zip(sites, self._modules_to_patch, strict=True)]
        result: TensorDictBase = f.with_taps(*editors, *later)(params, corrupted)
        return result

    def _put(self, td: TensorDictBase, outputs: TensorDictBase) -> None:
        previous = td.get(self._patch_key, None)
        if isinstance(previous, TensorDictBase):
            previous.update(outputs)
        else:
            td.set(self._patch_key, outputs)
