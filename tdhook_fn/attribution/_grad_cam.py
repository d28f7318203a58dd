"""Grad-CAM (Selvaraju et al. 2017) with tdhook's ``DimsConfig``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tensordict import TensorDict, TensorDictBase

from .._taps import Tap
from .._targets import Target
from ._engine import Cotangents, gradients
from ._saliency import GradFn, grad_taps

__all__ = ["DimsConfig", "grad_cam"]


@dataclass(frozen=True)
class DimsConfig:
    """Which dims of one sample's activation Grad-CAM pools and sums.

    Attributes:
        weight_pooling_dims (tuple[int, ...] | None): the gradient is averaged over these
            dims (kept as size 1) to give the weights; ``None`` uses the gradient itself.
        feature_sum_dims (tuple[int, ...] | None): ``weights * activation`` is summed over
            these dims; ``None`` keeps them all.

    Dims count within one sample (``0`` is the channel dim of a ``[C, H, W]`` activation),
    so results are the same batched and per sample under ``vmap``; negative dims count
    from the end. For a conv layer, ``DimsConfig((1, 2), (0,))`` is captum's ``LayerGradCam``.
    """

    weight_pooling_dims: tuple[int, ...] | None = None
    feature_sum_dims: tuple[int, ...] | None = None


def _shift(dims: tuple[int, ...], offset: int) -> tuple[int, ...]:
    return tuple(d + offset if d >= 0 else d for d in dims)


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
) -> TensorDict:
    """Class activation maps: activations weighted by their pooled gradients.

    For each path in ``layers``: ``w = mean(grad, weight_pooling_dims)`` (of ``|grad|``
    with ``absolute``), ``cam = sum(w * activation, feature_sum_dims)``. No ReLU is applied
    (captum's ``relu_attributions=False``; apply ``torch.relu`` for the paper's maps).

    Args:
        f (Functional): pure function of a model (layers are read through taps).
        params (TensorDict): parameters for ``f``.
        inputs (TensorDict): inputs, any batch size ``[*B]``.
        target (int | tuple[int, ...] | Callable): see :func:`tdhook_fn.as_target`.
        layers (Mapping[str, DimsConfig]): path -> dims (see :class:`DimsConfig`).
        absolute (bool): pool ``|grad|``. Default: ``False``.
        per_target (bool): one map per target on a leading dim ``T``. Default: ``False``.
        target_layers, grad_fns, taps, cotangents: as in :func:`saliency`.

    Returns:
        TensorDict: one map per layer path, batch ``[*B]`` or ``[T, *B]``.

    >>> import torch, tdhook_fn
    >>> from tensordict import TensorDict
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
    ...                           torch.nn.Linear(4 * 6 * 6, 3))
    >>> f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
    >>> x = TensorDict(input=torch.randn(2, 1, 8, 8), batch_size=[2])
    >>> grad_cam(f, p, x, target=0, layers={"[1]": DimsConfig((1, 2), (0,))})["[1]"].shape
    torch.Size([2, 6, 6])
    """
    result = gradients(
        f, params, inputs, target, input_keys=(), layers=dict.fromkeys(layers),
        target_layers=target_layers, taps=grad_taps(grad_fns, taps), per_target=per_target, cotangents=cotangents,
    )
    lead = len(result.grads.batch_size) - len(inputs.batch_size)
    offset = len(result.grads.batch_size)
    maps = TensorDict({}, batch_size=result.grads.batch_size)
    for path, dims in layers.items():
        grad = result.grads.get(path)
        grad = grad.abs() if absolute else grad
        act = result.activations.get(path).reshape(*[1] * lead, *result.activations.get(path).shape)
        weights = grad if dims.weight_pooling_dims is None else grad.mean(
            _shift(dims.weight_pooling_dims, offset), keepdim=True)
        cam = weights * act
        maps.set(path, cam if dims.feature_sum_dims is None else cam.sum(_shift(dims.feature_sum_dims, offset)))
    return maps
