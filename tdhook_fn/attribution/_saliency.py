"""Saliency: gradients, their absolute value, or input x gradient."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from .._taps import Tap
from .._targets import Target
from .._types import GradFn, NestedKey
from ._engine import Cotangents, grad_taps, gradients, input_keys_of, per_key, scaled
from ._inputs import accepts_tensors, check_layers
from ._replaced_derivatives import values_where_replaced

__all__ = ["saliency"]

@accepts_tensors
def saliency(
    f: Callable[[TensorDictBase, TensorDictBase], TensorDictBase],
    params: TensorDictBase,
    inputs: TensorDictBase,
    *,
    target: Target,
    abs: bool = False,
    multiply_by_inputs: bool = False,
    per_target: bool = False,
    layers: Sequence[str] = (),
    target_layers: Sequence[str] = (),
    use_inputs: bool = True,
    input_keys: NestedKey | Sequence[NestedKey] | None = None,
    grad_fns: Mapping[str, GradFn] | None = None,
    taps: Sequence[Tap] = (),
    cotangents: Cotangents | None = None,
    layer_calls: Mapping[str, int] | None = None,
) -> TensorDict:
    """Gradient of the target with respect to the inputs (and layer activations).

    ``abs`` gives saliency maps |dy/dx| (Simonyan et al.), ``multiply_by_inputs`` input x
    gradient (captum's ``InputXGradient``); both apply in that order, as in tdhook.
    Only the attributed inputs and the perturbations of ``layers`` are differentiated;
    ``params`` are constants here (wrap the call in ``torch.func.grad`` to differentiate
    them).

    Args:
        f (Functional | Callable): pure ``f(params, td) -> td``, e.g. from
            ``f, params = tdhook_fn.pure(model)``.
        params (TensorDict): parameters for ``f``.
        inputs (TensorDict | Tensor): inputs with any batch size ``[*B]``; or, for an
            ``f`` with one in_key, a tensor whose first dim is the batch (captum's
            ``inputs``): the result is then that key's map, as a tensor.
        target (int | tuple[int, ...] | Tensor | Callable): see `tdhook_fn.as_target`;
            a tensor holds one class index per sample (captum's ``target=pred``), a
            callable may return a tensor.
        abs (bool): absolute value of the gradient. Default: ``False``.
        multiply_by_inputs (bool): multiply by the inputs (activations for layers).
            Default: ``False``.
        per_target (bool): one map per target along a new leading dim ``T``, from one
            forward. Default: ``False`` (the targets' sum).
        layers (Sequence[str]): paths whose activations are attributed too (tdhook's
            ``input_modules``; captum's ``LayerGradientXActivation`` with
            ``multiply_by_inputs``). Keys of the result are the paths.
        target_layers (Sequence[str]): paths whose activations the target sees, under
            their path (tdhook's ``target_modules``).
        use_inputs (bool): attribute the inputs. Default: ``True``.
        input_keys (Sequence | None): which inputs. Default: ``f.in_keys``.
        grad_fns (Mapping[str, Callable] | None): path -> function applied to the
            gradient at that module's output (tdhook's ``output_grad_callbacks``).
        taps (Sequence[Tap]): any further taps for the call.
        cotangents (Callable | None): ``target_values -> TensorDict`` of the gradients fed
            back from the targets (tdhook's ``init_attr_grads``). Default: ones (per-target
            one-hots with ``per_target``).
        layer_calls (Mapping[str, int] | None): for a layer whose module runs more than
            once in one forward, the run to attribute (``0`` first, ``-1`` last); gradient
            and activation both come from that run. Such a layer without an entry raises.

    Returns:
        TensorDict: keyed like the attributed inputs (and layer paths), batch ``[*B]`` or
        ``[T, *B]``. For a tensor ``inputs``, the one map as a tensor (a call giving
        several maps, inputs and layers, raises ``ValueError``).

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
        >>> x = TensorDict(input=torch.randn(5, 3), batch_size=[5])
        >>> saliency(f, p, x, target=1)["input"].shape
        torch.Size([5, 3])
        >>> per_sample = torch.func.vmap(lambda td: saliency(f, p, td, target=1))(x)
        >>> torch.allclose(per_sample["input"], saliency(f, p, x, target=1)["input"])
        True
        >>> pred = net(x["input"]).argmax(-1)  # captum style: a tensor in, a tensor out
        >>> saliency(f, p, x["input"], target=pred).shape
        torch.Size([5, 3])
    """
    caller = "input_x_gradient" if multiply_by_inputs else "saliency"
    keys = input_keys_of(f, inputs, input_keys) if use_inputs else ()
    check_layers(caller, layers)
    all_taps = grad_taps(grad_fns, taps)
    if multiply_by_inputs:  # (the product below carries no graph either; the engine reads its own copy)
        inputs = values_where_replaced(caller, params, inputs, all_taps)
    result = gradients(
        f, params, inputs, target, input_keys=keys, layers=dict.fromkeys(layers),
        target_layers=target_layers, taps=all_taps, per_target=per_target, cotangents=cotangents,
        layer_calls=layer_calls, caller=caller,
    )
    grads = result.grads
    if abs:
        grads = per_key(torch.abs, grads)
    if multiply_by_inputs:
        factors = {k: inputs.get(k) for k in keys}
        factors.update(result.activations.items(True, True))
        grads = scaled(grads, factors)
    return grads
