"""Guided Grad-CAM (Selvaraju et al. 2017): guided backpropagation times the upsampled Grad-CAM map."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase

from .._functional import Functional
from .._targets import Target
from .._types import NestedKey
from ._backward_passes import BackwardPass
from ._deconvolution import relu_rule_taps
from ._engine import gradients, input_keys_of
from ._gradient_chain import Guide, walked_guided_and_cam
from ._inputs import accepts_tensors, check_call
from ._replaced_derivatives import as_values

__all__ = ["guided_grad_cam"]

# NOTE [guided Grad-CAM in one forward]
# The Grad-CAM map needs the layer's gradient by the model's own backward, the guided map
# the inputs' by guided backprop's: two rules, one forward. The ReLUs' guided taps carry a
# `Guide` that the engine's two passes switch (NOTE [attribution engine]): off for the pull
# back to the layer (which stops there), on for the pull back to the inputs. Under
# torch.compile, where a switch would be traced once, two forwards instead.


@accepts_tensors
def guided_grad_cam(
    f: Callable[[TensorDictBase, TensorDictBase], TensorDictBase],
    params: TensorDictBase,
    inputs: TensorDictBase,
    *,
    target: Target,
    layer: str,
    interpolate_mode: str = "nearest",
    per_target: bool = False,
    input_keys: NestedKey | Sequence[NestedKey] | None = None,
    layer_calls: Mapping[str, int] | None = None,
) -> TensorDict:
    """Guided backpropagation of each input, times the ReLU'd Grad-CAM map of ``layer`` upsampled to it.

    As captum's ``GuidedGradCam``: the Grad-CAM map of ``layer`` (a ``[C, *spatial]``
    activation per sample: gradients averaged over the spatial dims weight the channels,
    which are summed) goes through a ReLU, is resized to each input's spatial dims
    (``torch.nn.functional.interpolate`` with ``interpolate_mode``) and multiplies the
    input's guided-backpropagation map (a ReLU on the gradient leaving every ``nn.ReLU``
    module) on every channel. One forward, pulled back twice: to the layer by the plain
    backward, to the inputs by guided backprop's.

    Args:
        f (Functional): pure function of a model (`tdhook_fn.functional`).
        params (TensorDict): parameters for ``f`` (constants here).
        inputs (TensorDict | Tensor): inputs ``[*B, C, *spatial]``, any batch size, as in `saliency`.
        target (int | tuple[int, ...] | Tensor | Callable): what is attributed, as in `saliency`.
        layer (str): path of the layer whose Grad-CAM map is used; its activation has as many
            spatial dims as the inputs.
        interpolate_mode (str): ``"nearest"``, ``"area"``, ``"bilinear"`` (2-d), ...:
            how the map is resized. Default: ``"nearest"``, as captum.
        per_target (bool): one map per target along a new leading dim ``T``. Default: ``False``.
        input_keys (Sequence | None): which inputs, as in `saliency`. Default: ``f.in_keys``.
        layer_calls (Mapping[str, int] | None): the run of ``layer`` to read when its module
            runs more than once, as in `saliency`.

    Returns:
        TensorDict: keyed like the inputs, ``[*B]`` or ``[T, *B]``; a tensor for a tensor ``inputs``.

    Raises:
        TypeError: ``f`` is not a Functional, or ``layer`` is not a path.
        ValueError: the layer's activation and an input differ in their number of spatial dims.

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
        ...                           torch.nn.Linear(4 * 6 * 6, 3))
        >>> f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
        >>> x = TensorDict(input=torch.randn(2, 1, 8, 8), batch_size=[2])
        >>> guided_grad_cam(f, p, x, target=0, layer="[0]")["input"].shape
        torch.Size([2, 1, 8, 8])
    """
    if not isinstance(f, Functional):
        raise TypeError("guided_grad_cam needs f to be a tdhook_fn.Functional (it taps the layer and the ReLUs); "
                        "build it with tdhook_fn.functional(model) or tdhook_fn.pure(model)")
    if not isinstance(layer, str):
        raise TypeError(f"guided_grad_cam: layer must be one submodule path (str), got {layer!r}")
    keys = tuple(dict.fromkeys(input_keys_of(f, inputs, input_keys)))
    check_call("guided_grad_cam", f, params, inputs, keys, target)
    inputs = as_values("guided_grad_cam", params, inputs)  # (its rule replaces derivatives; the calls are `checked`)
    dims = inputs.batch_dims
    rank = {k: inputs.get(k).dim() - dims for k in keys if isinstance(inputs.get(k, None), torch.Tensor)}
    if not rank or min(rank.values()) < 2:
        raise ValueError(f"guided_grad_cam: the inputs {list(keys)} need a channel dim and spatial dims per sample "
                         f"([C, *spatial]); got per-sample ranks {rank}")
    r = next(iter(rank.values()))
    guided, layer_grad, act = _guided_and_cam(f, params, inputs, target, keys, layer, per_target, layer_calls)
    if act.dim() - dims < r:
        raise ValueError(f"guided_grad_cam: layer {layer!r} has fewer dims per sample than the inputs' [C, *spatial] "
                         f"({r}); pick a layer with a [C, *spatial] activation of the input's spatial rank")
    lead = layer_grad.dim() - act.dim() + dims  # (the target dim, then the batch dims)
    # captum's LayerGradCam: the channels weighted by their gradient's mean over the spatial dims, summed
    weights = layer_grad.mean(tuple(range(lead + 1, lead + r)), keepdim=True)
    cam = torch.relu((weights * act).sum(lead))
    out: dict[NestedKey, torch.Tensor] = {}
    for key, value in zip(keys, guided, strict=True):
        spatial = value.shape[lead + 1:]
        if cam.dim() - lead != len(spatial):
            raise ValueError(f"guided_grad_cam: the Grad-CAM map of layer {layer!r} has {cam.dim() - lead} spatial "
                             f"dims per sample (shape {list(cam.shape[lead:])}), input {key!r} has {len(spatial)} "
                             f"(shape {list(value.shape[lead:])}); pick a layer with a [C, *spatial] activation of "
                             "the input's spatial rank")
        flat = cam.reshape(-1, 1, *cam.shape[lead:])
        resized = F.interpolate(flat, size=tuple(spatial), mode=interpolate_mode)
        out[key] = value * resized.reshape(*cam.shape[:lead], 1, *spatial)
    batch = torch.Size([*layer_grad.shape[:lead - dims], *inputs.batch_size])  # ([T, *B] or [*B])
    result = TensorDict({}, batch_size=batch)
    for key, value in out.items():
        result.set(key, value)
    return result


def _guided_and_cam(f: Functional, params: TensorDictBase, inputs: TensorDictBase, target: Target,
                    keys: tuple[NestedKey, ...], layer: str, per_target: bool,
                    layer_calls: Mapping[str, int] | None) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The inputs' guided-backprop maps, and the layer's plain gradient and activation
    (NOTE [guided Grad-CAM in one forward])."""
    if not layer_calls and len(keys) == 1:  # (NOTE [gradient rules on a chain])
        walked = walked_guided_and_cam(f, params, inputs, target, keys[0], layer, per_target)
        if walked is not None:
            return [walked[0]], walked[1], walked[2]
    common: dict[str, Any] = {"per_target": per_target, "layer_calls": layer_calls, "caller": "guided_grad_cam",
                              "checked": True}
    if torch.compiler.is_compiling():  # (a switched rule is not for Dynamo: NOTE [guided backprop as taps])
        cam = gradients(f, params, inputs, target, input_keys=(), layers={layer: None}, **common)
        guided = gradients(f, params, inputs, target, input_keys=keys, taps=relu_rule_taps(f, guided=True),
                           **common).grads
        return [guided.get(k) for k in keys], cam.grads.get(layer), cam.activations.get(layer)
    guide = Guide(on=False)
    both = gradients(f, params, inputs, target, input_keys=keys, layers={layer: None},
                     taps=relu_rule_taps(f, guided=True, guide=guide), **common,
                     passes=(BackwardPass((layer,), guide.setter(False)), BackwardPass(keys, guide.setter(True))))
    return [both.grads.get(k) for k in keys], both.grads.get(layer), both.activations.get(layer)
