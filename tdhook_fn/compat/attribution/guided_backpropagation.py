"""``GuidedBackpropagation`` (``tdhook.attribution.guided_backpropagation``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tensordict import NestedKey, TensorDict, TensorDictBase
from torch import nn

from tdhook_fn.attribution import guided_backprop

from .gradient_helpers import GradientAttribution
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
        return guided_backprop(
            call.f, call.params, call.inputs, classes_to_skip=self._classes_to_skip,
            multiply_by_inputs=self._multiply_by_inputs, layers=call.layers, use_inputs=call.use_inputs,
            input_keys=call.input_keys, **call.options(),
        )
