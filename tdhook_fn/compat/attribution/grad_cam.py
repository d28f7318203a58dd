"""``GradCAM`` and ``DimsConfig`` (``tdhook.attribution.grad_cam``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tensordict import NestedKey, TensorDict, TensorDictBase

from tdhook_fn import attribution
from tdhook_fn.attribution import grad_cam

from .gradient_helpers import GradientAttribution
from .gradient_helpers.common import AttributionCall, UserFn, inherited

__all__ = ["DimsConfig", "GradCAM"]


@dataclass
class DimsConfig:
    """tdhook's dims of Grad-CAM, counted on the activation *with* its batch dim (dim 0).

    Attributes:
        weight_pooling_dims (tuple[int, ...] | None): the gradient is averaged over these
            dims to give the weights; ``None`` uses the gradient itself.
        feature_sum_dims (tuple[int, ...] | None): ``weights * activation`` is summed over
            these dims; ``None`` sums nothing.
    """

    weight_pooling_dims: tuple[int, ...] | None = None
    feature_sum_dims: tuple[int, ...] | None = None

    def per_sample(self, batch_dims: int = 1) -> attribution.DimsConfig:
        """The same dims for one sample (`tdhook_fn.attribution.DimsConfig`): positive dims shift down by
        ``batch_dims``; ``ValueError`` for a batch dim (pooling or summing over it mixes samples).

        Examples:
            >>> DimsConfig((2, 3), (1,)).per_sample()
            DimsConfig(weight_pooling_dims=(1, 2), feature_sum_dims=(0,))
            >>> DimsConfig((3,)).per_sample(batch_dims=2)  # an input TensorDict of batch [N, M]
            DimsConfig(weight_pooling_dims=(1,), feature_sum_dims=None)
        """
        return attribution.DimsConfig(_shift(self.weight_pooling_dims, batch_dims),
                                      _shift(self.feature_sum_dims, batch_dims))


def _shift(dims: int | Sequence[int] | None, batch_dims: int) -> tuple[int, ...] | None:
    if dims is None:
        return None
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if not dims:
        raise ValueError(
            "GradCAM: dims () reduce every dim in tdhook (torch's dim=()), the batch dims too, which mixes samples: "
            "name the dims, or give None (weights: the gradient itself; sums: none)")
    batch = [d for d in dims if 0 <= d < batch_dims]
    if batch:
        raise ValueError(
            f"GradCAM: dims {batch} of {dims} are batch dims (the input has {batch_dims}); pooling or summing over "
            "them mixes samples (count dims of the activation with its batch dims first, as tdhook does)"
        )
    return tuple(d - batch_dims if d > 0 else d for d in dims)


class GradCAM(GradientAttribution):
    """Grad-CAM (Selvaraju et al. 2016) of the modules in ``modules_to_attribute``.

    Computed by `tdhook_fn.attribution.grad_cam`, under ``(attribution_key, path)``. As in
    tdhook, ``use_inputs``, ``use_outputs``, ``target_modules``, ``init_attr_inputs`` and
    ``cache_callback`` are ignored; the other arguments are those of `GradientAttribution`.

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
        additional_init_keys: list[NestedKey] | None = None,
        output_grad_callbacks: dict[str, Callable[..., Any]] | None = None,
        attribution_key: Any = "attr",
        clean_intermediate_keys: bool = True,
        cache_callback: Callable[..., Any] | None = None,
        absolute: bool = False,
    ) -> None:
        super().__init__(**{
            **inherited(locals(), "modules_to_attribute", "absolute"), "use_inputs": False, "use_outputs": True,
            "input_modules": list(modules_to_attribute or {}), "target_modules": None, "init_attr_inputs": None,
            "cache_callback": None,
        })
        self._absolute = absolute
        self._dims = dict(modules_to_attribute or {})
        for dims in self._dims.values():
            dims.per_sample()  # dim 0 is a batch dim whatever the input: refused here already

    def _attribute(self, call: AttributionCall, td: TensorDict) -> TensorDictBase:
        return grad_cam(
            call.f, call.params, call.inputs,
            layers={path: self._dims[path].per_sample(td.batch_dims) for path in call.layers},
            absolute=self._absolute, **call.options(),
        )
