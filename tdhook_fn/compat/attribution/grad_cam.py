"""``GradCAM`` and ``DimsConfig`` (``tdhook.attribution.grad_cam``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tensordict import TensorDict, TensorDictBase

from tdhook_fn import attribution
from tdhook_fn.attribution import grad_cam

from .gradient_helpers import GradientAttribution
from .gradient_helpers._calls import AttributionCall, UserFn

__all__ = ["DimsConfig", "GradCAM"]


@dataclass
class DimsConfig:
    """tdhook's dims of Grad-CAM, counted on the activation *with* its batch dim (dim 0).

    Attributes:
        weight_pooling_dims (tuple[int, ...] | None): the gradient is averaged over these
            dims to give the weights; ``None`` uses the gradient itself.
        feature_sum_dims (tuple[int, ...] | None): ``weights * activation`` is summed over
            these dims; ``None`` sums nothing.

    For a conv activation ``[N, C, H, W]``, ``DimsConfig((2, 3), (1,))`` is classic Grad-CAM.
    """

    weight_pooling_dims: tuple[int, ...] | None = None
    feature_sum_dims: tuple[int, ...] | None = None

    def per_sample(self) -> attribution.DimsConfig:
        """The same dims for one sample (:class:`tdhook_fn.attribution.DimsConfig`).

        Positive dims shift down by one and negative ones are kept. Raises ``ValueError``
        for dim 0: in tdhook it is the (flattened) batch dim, and pooling or summing over it
        mixes samples.

        >>> DimsConfig((2, 3), (1,)).per_sample()
        DimsConfig(weight_pooling_dims=(1, 2), feature_sum_dims=(0,))
        """
        return attribution.DimsConfig(_shift(self.weight_pooling_dims), _shift(self.feature_sum_dims))


def _shift(dims: int | Sequence[int] | None) -> tuple[int, ...] | None:
    if dims is None:
        return None
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if 0 in dims:
        raise ValueError(
            f"GradCAM: dim 0 in {dims} is the batch dim; pooling or summing over it mixes samples "
            "(count dims of the activation with its batch dim first, as tdhook does)"
        )
    return tuple(d - 1 if d > 0 else d for d in dims)


class GradCAM(GradientAttribution):
    """Grad-CAM (Selvaraju et al. 2016) of the modules in ``modules_to_attribute``.

    Results go under ``(attribution_key, path)``; computed by
    :func:`tdhook_fn.attribution.grad_cam`. As in tdhook, inputs are not attributed,
    the outputs are the targets, and ``use_inputs``, ``use_outputs``, ``target_modules``,
    ``init_attr_inputs`` and ``cache_callback`` are accepted and ignored. The other
    arguments are those of
    :class:`~tdhook_fn.compat.attribution.gradient_helpers.GradientAttribution`.

    Args:
        modules_to_attribute (dict[str, DimsConfig] | None): path -> dims.
        absolute (bool): pool ``|grad|``. Default: ``False``.

    Raises:
        ValueError: a dims config names dim 0 (the batch dim).
    """

    def __init__(
        self,
        modules_to_attribute: dict[str, DimsConfig] | None,
        use_inputs: bool = True,
        use_outputs: bool = True,
        input_modules: list[str] | None = None,
        target_modules: list[str] | None = None,
        init_attr_targets: UserFn | None = None,
        init_attr_inputs: UserFn | None = None,
        init_attr_cache_in: UserFn | None = None,
        init_attr_grads: UserFn | None = None,
        additional_init_keys: list[Any] | None = None,
        output_grad_callbacks: dict[str, Callable[..., Any]] | None = None,
        attribution_key: Any = "attr",
        clean_intermediate_keys: bool = True,
        cache_callback: Callable[..., Any] | None = None,
        absolute: bool = False,
    ) -> None:
        super().__init__(
            use_inputs=False,
            use_outputs=True,
            input_modules=list(modules_to_attribute or {}),
            target_modules=None,
            init_attr_targets=init_attr_targets,
            init_attr_inputs=None,
            init_attr_cache_in=init_attr_cache_in,
            init_attr_grads=init_attr_grads,
            additional_init_keys=additional_init_keys,
            attribution_key=attribution_key,
            clean_intermediate_keys=clean_intermediate_keys,
            output_grad_callbacks=output_grad_callbacks,
        )
        self._absolute = absolute
        self._modules_to_attribute = modules_to_attribute
        self._dims = {path: dims.per_sample() for path, dims in (modules_to_attribute or {}).items()}

    def _attribute(self, call: AttributionCall, td: TensorDict) -> TensorDictBase:
        return grad_cam(
            call.f, call.params, call.inputs, layers={path: self._dims[path] for path in call.layers},
            absolute=self._absolute, **call.options(),
        )
