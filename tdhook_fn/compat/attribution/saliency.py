"""``Saliency`` (``tdhook.attribution.saliency``): gradients, ``|gradients|``, input x gradient."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tensordict import NestedKey, TensorDict, TensorDictBase

from tdhook_fn.attribution import saliency

from .gradient_helpers import GradientAttribution
from .gradient_helpers.common import AttributionCall, UserFn, inherited

__all__ = ["Saliency"]


class Saliency(GradientAttribution):
    """Saliency maps (Simonyan et al. 2013) and gradient x input (Shrikumar et al. 2016).

    Computed by `tdhook_fn.attribution.saliency`. Takes the arguments of `GradientAttribution`, and:

    Args:
        absolute (bool): absolute value of the gradients. Default: ``False``.
        multiply_by_inputs (bool): multiply by the inputs (module outputs for
            ``input_modules``), after ``absolute``. Default: ``False``.
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
        absolute: bool = False,
        multiply_by_inputs: bool = False,
    ) -> None:
        super().__init__(**inherited(locals(), "absolute", "multiply_by_inputs"))
        self._absolute = absolute
        self._multiply_by_inputs = multiply_by_inputs

    def _attribute(self, call: AttributionCall, td: TensorDict) -> TensorDictBase:
        return saliency(
            call.f, call.params, call.inputs, abs=self._absolute, multiply_by_inputs=self._multiply_by_inputs,
            layers=call.layers, use_inputs=call.use_inputs, input_keys=call.input_keys, **call.options(),
        )
