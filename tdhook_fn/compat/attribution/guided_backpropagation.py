"""``GuidedBackpropagation`` (``tdhook.attribution.guided_backpropagation``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tensordict import NestedKey, TensorDict, TensorDictBase
from torch import nn

from tdhook_fn import Tap
from tdhook_fn._paths import name_to_path
from tdhook_fn.attribution import guided_backprop, saliency
from tdhook_fn.attribution._guided_backprop import guide_taps
from tdhook_fn.compat.hooks import HookFactory
from tdhook_fn.compat.modules._scope import HookTap

from .gradient_helpers import GradientAttribution
from .gradient_helpers._hook_callbacks import hooked_since
from .gradient_helpers.common import AttributionCall, UserFn, inherited

__all__ = ["GuidedBackpropagation"]


class GuidedBackpropagation(GradientAttribution):
    """Guided backpropagation (Springenberg et al. 2014), as tdhook applies it.

    Computed by `tdhook_fn.attribution.guided_backprop`. Takes the arguments of `GradientAttribution`, and:

    Args:
        multiply_by_inputs (bool): multiply by the inputs. Default: ``False``.
        classes_to_skip (tuple[type, ...]): module classes left alone. Default: none.
    """

    def __init__(
        self,
        use_inputs: bool = True,
        use_outputs: bool = True,
        input_modules: list[str] | None = None,
        target_modules: list[str] | None = None,
        init_attr_targets: UserFn | None = None,
        init_attr_inputs: UserFn | None = None,
        init_attr_cache_in: UserFn | None = None,
        init_attr_grads: UserFn | None = None,
        additional_init_keys: list[NestedKey] | None = None,
        output_grad_callbacks: dict[str, Callable[..., Any]] | None = None,
        attribution_key: Any = "attr",
        clean_intermediate_keys: bool = True,
        cache_callback: Callable[..., Any] | None = None,
        multiply_by_inputs: bool = False,
        classes_to_skip: tuple[type[nn.Module], ...] = (),
    ) -> None:
        super().__init__(**inherited(locals(), "multiply_by_inputs", "classes_to_skip"))
        self._classes_to_skip = tuple(classes_to_skip)
        self._multiply_by_inputs = multiply_by_inputs

    def _attribute(self, call: AttributionCall, td: TensorDict) -> TensorDictBase:
        options = {"multiply_by_inputs": self._multiply_by_inputs, "layers": call.layers,
                   "use_inputs": call.use_inputs, "input_keys": call.input_keys, **call.options()}
        if not call.hooks_on:  # tdhook's guides are its context's hooks: disabled, the gradients are plain
            return saliency(call.f, call.params, call.inputs, **options)
        hooked = hooked_since(call.hooks)
        if not hooked:
            return guided_backprop(call.f, call.params, call.inputs, classes_to_skip=self._classes_to_skip, **options)
        # on a module the user hooked since entry, tdhook's backward hook itself, which torch runs before the user's;
        # elsewhere the pure method's guides (NOTE [a context's own hooks])
        mapped: list[str] = []
        real: list[Tap] = []
        for name, submodule in call.f.model.named_modules():
            if name and not isinstance(submodule, self._classes_to_skip):
                if id(submodule) in hooked:
                    real.append(HookTap(name_to_path(name), "custom", _GUIDE, direction="bwd", target=submodule))
                else:
                    mapped.append(name_to_path(name))
        options["taps"] = (*guide_taps(mapped), *real, *options["taps"])
        return saliency(call.f, call.params, call.inputs, **options)


def _relu_of_grad_input(grad_input: tuple[Any, ...], **_: Any) -> tuple[Any, ...]:
    """tdhook's guide, on floating-point gradients only (docs/compat.md: a boolean input's)."""
    return tuple(grad if grad is None or not grad.is_floating_point() else nn.functional.relu(grad)
                 for grad in grad_input)


_GUIDE = HookFactory.make_setting_hook(None, callback=_relu_of_grad_input, direction="bwd")
