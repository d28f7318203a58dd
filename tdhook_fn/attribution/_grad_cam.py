"""Grad-CAM (Selvaraju et al. 2017) with tdhook's ``DimsConfig``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tensordict import TensorDict, TensorDictBase

from .._taps import Tap
from .._targets import Target
from .._types import GradFn
from ._engine import Cotangents, grad_taps, gradients
from ._inputs import accepts_tensors

__all__ = ["DimsConfig", "grad_cam"]


@dataclass(frozen=True)
class DimsConfig:
    """Which dims of one sample's activation Grad-CAM pools and sums.

    Attributes:
        weight_pooling_dims (tuple[int, ...] | None): the gradient is averaged over these
            dims (kept as size 1) to give the weights; ``None`` uses the gradient itself.
        feature_sum_dims (tuple[int, ...] | None): ``weights * activation`` is summed over
            these dims; ``None`` keeps them all.

    An empty tuple is refused (torch reduces ``dim=()`` over every dim, the batch's too).

    Dims count within one sample (``0`` is the channel dim of a ``[C, H, W]`` activation),
    so one config serves batched calls and per-sample calls under ``vmap``; negative dims count
    from the end. For a conv layer, ``DimsConfig((1, 2), (0,))`` is captum's ``LayerGradCam``.
    """

    weight_pooling_dims: tuple[int, ...] | None = None
    feature_sum_dims: tuple[int, ...] | None = None


def _shift(dims: tuple[int, ...], offset: int) -> tuple[int, ...]:
    return tuple(d + offset if d >= 0 else d for d in dims)


def _check_dims(layers: object) -> None:
    if not isinstance(layers, Mapping):
        raise TypeError(
            f"grad_cam: layers must map each submodule path to a DimsConfig, got {type(layers).__name__}; e.g. "
            "layers={'features[3]': DimsConfig(weight_pooling_dims=(1, 2), feature_sum_dims=(0,))}"
        )
    for path, dims in layers.items():
        if not isinstance(path, str) or not isinstance(dims, DimsConfig):
            raise TypeError(f"grad_cam: layers[{path!r}] must be a DimsConfig for a path (str), got {dims!r}")
        for field in ("weight_pooling_dims", "feature_sum_dims"):
            if getattr(dims, field) == ():  # torch's mean and sum over dim=() reduce every dim, the batch's too
                raise ValueError(
                    f"grad_cam: layers[{path!r}].{field} is (), which torch reads as every dim, the batch dims too "
                    "(it would mix samples): name the dims of one sample, or give None (weights: the gradient "
                    "itself; sums: none)")


def _check_rank(path: str, dims: DimsConfig, shape: tuple[int, ...]) -> None:
    rank = len(shape)
    for field in ("weight_pooling_dims", "feature_sum_dims"):
        for d in getattr(dims, field) or ():
            if isinstance(d, bool) or not isinstance(d, int) or not -rank <= d < rank:
                tdhook = f"{d + 1}" if isinstance(d, int) and d >= 0 else f"{d}"
                raise ValueError(
                    f"grad_cam: layers[{path!r}].{field} names dim {d!r} (dim {tdhook} counting the batch dim first, "
                    f"as tdhook does), but one sample's activation there has {rank} dims (shape {list(shape)}; "
                    f"{rank + 1} with the batch dim). tdhook_fn.attribution.DimsConfig counts within one sample, 0 "
                    "being its first dim (the channels of [C, H, W]): subtract 1 from tdhook-style dims, or use "
                    "tdhook_fn.compat.attribution.grad_cam.DimsConfig"
                )


@accepts_tensors
def grad_cam(
    f: Callable[[TensorDictBase, TensorDictBase], TensorDictBase],
    params: TensorDictBase,
    inputs: TensorDictBase,
    *,
    target: Target,
    layers: Mapping[str, DimsConfig],
    absolute: bool = False,
    per_target: bool = False,
    target_layers: Sequence[str] = (),
    grad_fns: Mapping[str, GradFn] | None = None,
    taps: Sequence[Tap] = (),
    cotangents: Cotangents | None = None,
    layer_calls: Mapping[str, int] | None = None,
) -> TensorDict:
    """Class activation maps: activations weighted by their pooled gradients.

    For each path in ``layers``: ``w = mean(grad, weight_pooling_dims)`` (of ``|grad|``
    with ``absolute``), ``cam = sum(w * activation, feature_sum_dims)``. No ReLU is applied
    (captum's ``relu_attributions=False``; apply ``torch.relu`` for the paper's maps).

    Args:
        f (Functional): pure function of a model (layers are read through taps).
        params (TensorDict): parameters for ``f``.
        inputs (TensorDict | Tensor): inputs, any batch size ``[*B]``; or a tensor, batch
            first (with one layer the result is then a tensor; see `saliency`).
        target (int | tuple[int, ...] | Tensor | Callable): see `tdhook_fn.as_target`.
        layers (Mapping[str, DimsConfig]): path -> dims (see `DimsConfig`).
        absolute (bool): pool ``|grad|``. Default: ``False``.
        per_target (bool): one map per target on a leading dim ``T``. Default: ``False``.
        target_layers (Sequence[str]): paths whose activations the target sees, as in `saliency`.
        grad_fns (Mapping[str, Callable] | None): path -> function applied to the gradient at that
            module's output, as in `saliency`.
        taps (Sequence[Tap]): any further taps for the call, as in `saliency`.
        cotangents (Callable | None): the gradients fed back from the targets, as in `saliency`.
            Default: ones.
        layer_calls (Mapping[str, int] | None): the run to attribute of a layer whose module runs
            more than once, as in `saliency`.

    Returns:
        TensorDict: one map per layer path, batch ``[*B]`` or ``[T, *B]``.

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
        ...                           torch.nn.Linear(4 * 6 * 6, 3))
        >>> f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
        >>> x = TensorDict(input=torch.randn(2, 1, 8, 8), batch_size=[2])
        >>> grad_cam(f, p, x, target=0, layers={"[1]": DimsConfig((1, 2), (0,))})["[1]"].shape
        torch.Size([2, 6, 6])
    """
    _check_dims(layers)
    result = gradients(
        f, params, inputs, target, input_keys=(), layers=dict.fromkeys(layers),
        target_layers=target_layers, taps=grad_taps(grad_fns, taps), per_target=per_target, cotangents=cotangents,
        layer_calls=layer_calls, caller="grad_cam",
    )
    lead = len(result.grads.batch_size) - len(inputs.batch_size)
    offset = len(result.grads.batch_size)
    maps = TensorDict({}, batch_size=result.grads.batch_size)
    for path, dims in layers.items():
        _check_rank(path, dims, result.activations.get(path).shape[len(inputs.batch_size):])
        grad = result.grads.get(path)
        grad = grad.abs() if absolute else grad
        act = result.activations.get(path).reshape((*[1] * lead, *result.activations.get(path).shape))
        weights = grad if dims.weight_pooling_dims is None else grad.mean(
            _shift(dims.weight_pooling_dims, offset), keepdim=True)
        cam = weights * act
        maps.set(path, cam if dims.feature_sum_dims is None else cam.sum(_shift(dims.feature_sum_dims, offset)))
    return maps
