"""DeepLift with the rescale rule (Shrikumar et al. 2017), as captum 0.9 computes it.

On a chain the walk knows, the chain walk gives the maps (NOTE [deeplift on a chain]),
from a TensorDict or, by the methods' tensor paths, from a tensor; elsewhere LRP's walk
on the inputs and references stacked as one batch (`stacked_deeplift`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from .._functional import Functional, fresh_tensordict
from .._targets import Target
from .._types import NestedKey, PureFn
from .._vjp import untransformed
from ._baselines import Baselines, attributed_keys, path_starts
from ._chain_walk import WalkPlan, chain_links, holds_only, tensor_plan, walk_plan, walked_map
from ._deeplift_chain import chain_deeplift, chain_layer_deeplift
from ._deeplift_rules import EPS
from ._deeplift_stacked import stacked_deeplift, stacked_layer_deeplift
from ._engine import unflatten
from ._inputs import UNSET, accepts_tensors_via, check_call, check_layers, one_tensor
from ._lrp.checks import never_traced

__all__ = ["by_tensor_path", "checked_functional", "deeplift", "deeplift_as", "layer_deeplift"]


def checked_functional(caller: str, f: Any, eps: float) -> Functional:
    """``f`` as the Functional DeepLift needs, once ``f`` and ``eps`` are checked (named by ``caller``)."""
    if not isinstance(f, Functional):
        raise TypeError(f"{caller} needs f to be a tdhook_fn.Functional (it puts the rescale rule on f.model's "
                        "nonlinearities); build it with tdhook_fn.functional(model)")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{caller}: eps must be a number >= 0, got {eps!r}")
    return f


def _reference_rows(caller: str, inputs: TensorDictBase, baselines: Baselines,
                    key: NestedKey) -> tuple[torch.Tensor, TensorDictBase | None]:
    """The chain walk's reference rows for ``key``, and the path starts they come from (``None`` for a number).

    One number for every sample makes one row and no tensor of the input's size; references
    broadcast over the batch (held by this key only: the caller checked) make one row too.
    """
    x, lead = inputs.get(key), inputs.batch_dims
    if isinstance(baselines, (int, float)) and not isinstance(baselines, bool) and x.is_floating_point():
        return x.new_full((1, *x.shape[lead:]), float(baselines)), None
    starts = path_starts(inputs, baselines, (key,), caller)
    b = starts.get(key)
    reference = b.reshape(-1, *b.shape[lead:])
    return (reference[:1] if all(s == 0 for s in b.stride()[:lead]) else reference), starts


def _walked(caller: str, f: Functional, params: TensorDictBase, inputs: TensorDictBase, baselines: Baselines,
            target: Target, eps: float, per_target: bool, key: NestedKey, multiply: bool) -> TensorDict | None:
    """The multipliers by the chain walk (NOTE [deeplift on a chain]), times ``inputs - references`` with
    ``multiply``; ``None``: not a chain."""
    plan = walk_plan(f)
    check_call(caller, f, params, inputs, (key,), target, modes=plan is None)
    if plan is not None:
        plan.check_modes(f.model, caller)
    if plan is None or plan.links is None:
        return None
    x, lead, batch = inputs.get(key), inputs.batch_dims, inputs.batch_size
    reference, starts = _reference_rows(caller, inputs, baselines, key)
    b: torch.Tensor | None = None  # the references, broadcasting to the inputs (read with multiply); None: zeros
    if multiply and starts is not None:
        b = starts.get(key)
    elif multiply and float(cast(float, baselines)) != 0.0:  # (a zero reference: the inputs are their own change)
        b = reference[0]
    walked = _walked_maps(plan, params, x, lead, batch, reference, b, target, eps, per_target, multiply)
    if walked is None:
        return None
    return walked_map(key, walked, batch, per_target)


def _walked_maps(plan: WalkPlan, params: TensorDictBase, x: torch.Tensor, lead: int, batch: torch.Size,
                 reference: torch.Tensor, b: torch.Tensor | None, target: Target, eps: float, per_target: bool,
                 multiply: bool) -> torch.Tensor | None:
    """The chain walk's maps of ``x`` (``lead`` batch dims ``batch``), times ``x - b`` with ``multiply`` (``b``
    ``None``: zeros); ``None``: the walk does not apply."""
    walked = chain_deeplift(plan, params, x if lead == 1 else x.reshape(-1, *x.shape[lead:]), reference, target,
                            eps, per_target)
    if walked is None:
        return None
    if lead != 1:
        walked = unflatten(walked, 1 if per_target else 0, batch)
    if multiply:  # (in place: the walk's maps are its own new tensor; no graph, as in `deeplift`)
        with torch.no_grad():
            walked.mul_(x if b is None else x - b)
    return walked


def by_tensor_path(path: Callable[..., torch.Tensor | None], f: PureFn, params: TensorDictBase, inputs: Any,
                   baselines: Any, *, per_target: bool, key: str | None = None,
                   **options: Any) -> TensorDict | None:
    """The maps of a TensorDict of one tensor by the tensor ``path``, under ``key`` (default: the input's); ``None``
    where ``inputs`` is not one or the path declines (NOTE [captum-style calls])."""
    one = one_tensor(f, inputs)
    if one is None:
        return None
    walked = path(f, params, one[0], one[1], baselines, per_target=per_target, **options)
    return None if walked is None else walked_map(key or one[0], walked, inputs.batch_size, per_target)


def _number(baselines: Any) -> bool:
    return isinstance(baselines, (int, float)) and not isinstance(baselines, bool)


def _deeplift_of_tensor(f: PureFn, params: TensorDictBase, key: NestedKey, x: torch.Tensor, baselines: Baselines = 0.0,
                        *unknown: Any, target: Target = UNSET, multiply_by_inputs: bool = True, eps: float = EPS,
                        per_target: bool = False, input_keys: NestedKey | Sequence[NestedKey] | None = None,
                        **unknown_keywords: Any) -> torch.Tensor | None:
    """`deeplift`'s map of the tensor ``x`` by the chain walk, a number as baselines; ``None``: the TensorDict's way
    (also where the arguments do not fit `deeplift`'s signature: it says how)."""
    fits = not unknown and not unknown_keywords and target is not UNSET and _number(baselines)
    plan = tensor_plan("deeplift", f, params, x, eps, input_keys) if fits else None
    if plan is None:
        return None
    reference = x.new_full((1, *x.shape[1:]), float(cast(float, baselines)))
    b = None if float(cast(float, baselines)) == 0.0 else reference[0]
    return _walked_maps(plan, params, x, 1, x.shape[:1], reference, b, target, eps, per_target, multiply_by_inputs)


@never_traced  # (it runs on lrp's rule taps: NOTE [lrp is never traced])
@accepts_tensors_via(_deeplift_of_tensor)
def deeplift(
    f: PureFn,
    params: TensorDictBase,
    inputs: TensorDictBase,
    baselines: Baselines = 0.0,
    *,
    target: Target,
    multiply_by_inputs: bool = True,
    eps: float = EPS,
    per_target: bool = False,
    input_keys: NestedKey | Sequence[NestedKey] | None = None,
) -> TensorDict:
    """DeepLift (rescale rule): how much each input's change from its reference moves the target, as captum's.

    The inputs and their references run through ``f`` in one batch; the target is pulled
    back with ReLU, ELU, LeakyReLU, Sigmoid, Tanh, Softplus, Softmax and max-pooling
    modules handing on ``dy / dx`` (differences from the reference) instead of their
    derivative, and their plain gradient where ``|dx| < eps``, as captum 0.9's
    ``DeepLift`` (other modules: their plain gradient). With ``multiply_by_inputs`` the
    maps of one sample sum to ``F(x) - F(reference)`` on models built of these modules
    and linear ones (completeness; see `convergence_delta`). Differences from captum: its
    softmax rule centres over the whole batch, here per sample; see the DeepLift page.

    Args:
        f (Functional): pure function of a model (`tdhook_fn.functional`).
        params (TensorDict): parameters for ``f`` (constants here).
        inputs (TensorDict | Tensor): inputs with any batch size ``[*B]``; or a tensor,
            batch first (the result is then a tensor; see `saliency`).
        baselines (TensorDict | Tensor | float): the references, as in
            `integrated_gradients`: per attributed key, with the input's shape; a
            tensor that broadcasts to the one attributed input (one sample's); or a
            number. Default: ``0.0``, as captum.
        target (int | tuple[int, ...] | Tensor | Callable): see `tdhook_fn.as_target`.
        multiply_by_inputs (bool): multiply the multipliers by ``inputs - baselines``
            (captum's global attribution). Default: ``True``.
        eps (float): below this ``|dx|`` a nonlinearity uses its plain gradient. Default:
            ``1e-10``, as captum.
        per_target (bool): one map per target along a new leading dim ``T``, from one
            forward, as in `saliency`. Default: ``False``.
        input_keys (Sequence | None): which inputs are attributed (and replaced by the
            baselines); the others are passed unchanged. Default: ``f.in_keys``.

    Returns:
        TensorDict: keyed like the attributed inputs, batch ``[*B]`` or ``[T, *B]``.

    Raises:
        TypeError: ``f`` is not a Functional, or the baselines do not fit (named).
        ValueError: ``eps`` is negative, or a nonlinearity does not take the batch as its
            first dim (the path is named).
        NotImplementedError: called under ``torch.func.grad``/``vjp`` (maps are not
            differentiable, as LRP's).

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> _ = torch.manual_seed(0)
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).double()
        >>> f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
        >>> x = TensorDict(input=torch.randn(5, 3, dtype=torch.float64), batch_size=[5])
        >>> attr = deeplift(f, p, x, 0.0, target=1)
        >>> gap = net(x["input"])[:, 1] - net(torch.zeros(1, 3, dtype=torch.float64))[:, 1]
        >>> torch.allclose(attr["input"].sum(-1), gap)  # completeness
        True
        >>> per_sample = torch.func.vmap(lambda td: deeplift(f, p, td, 0.0, target=1))(x)
        >>> torch.allclose(per_sample["input"], attr["input"])
        True
    """
    walked = by_tensor_path(_deeplift_of_tensor, f, params, inputs, baselines, target=target, per_target=per_target,
                            multiply_by_inputs=multiply_by_inputs, eps=eps, input_keys=input_keys)
    if walked is not None:
        return walked
    return deeplift_as("deeplift", f, params, inputs, baselines, target=target, multiply_by_inputs=multiply_by_inputs,
                       eps=eps, per_target=per_target, input_keys=input_keys)


def deeplift_as(caller: str, f: PureFn, params: TensorDictBase, inputs: TensorDictBase, baselines: Baselines, *,
                target: Target, multiply_by_inputs: bool, eps: float, per_target: bool,
                input_keys: NestedKey | Sequence[NestedKey] | None) -> TensorDict:
    """`deeplift` of a TensorDict, its errors named by ``caller`` (`deeplift_shap` runs it on every pair)."""
    keys = attributed_keys(caller, f, inputs, input_keys)
    fn = checked_functional(caller, f, eps)
    if len(keys) == 1 and untransformed() and holds_only(inputs, keys[0]):
        walked = _walked(caller, fn, params, inputs, baselines, target, eps, per_target, keys[0], multiply_by_inputs)
        if walked is not None:
            return walked
    return stacked_deeplift(caller, fn, params, inputs, baselines, target, eps, per_target, keys, multiply_by_inputs)


def _layer_maps(plan: WalkPlan, params: TensorDictBase, x: torch.Tensor, lead: int, batch: torch.Size,
                reference: torch.Tensor, target: Target, eps: float, per_target: bool, layers: Sequence[str],
                stops: tuple[int, ...], multiply: bool) -> dict[str, torch.Tensor] | None:
    """The chain walk's map of each layer (by path) of ``x`` (``lead`` batch dims ``batch``); ``None``: the walk
    does not apply."""
    n = batch.numel()
    walked = chain_layer_deeplift(plan, params, x if lead == 1 else x.reshape(-1, *x.shape[lead:]), reference,
                                  target, eps, per_target, stops)
    if walked is None:
        return None
    first = 1 if per_target else 0
    out = {}
    for path, (grads, act) in zip(layers, walked, strict=True):
        if multiply:
            grads = grads * (act[:n] - act[n:])
        elif len(walked) > 1:
            grads = grads.clone()  # (a reshape's pullback is a view: one map must not alias another)
        out[path] = grads if lead == 1 else unflatten(grads, first, batch)
    return out


def _layer_deeplift_of_tensor(f: PureFn, params: TensorDictBase, key: NestedKey, x: torch.Tensor,
                              baselines: Baselines = 0.0, *unknown: Any, target: Target = UNSET,
                              layers: Sequence[str] = (), multiply_by_inputs: bool = True, eps: float = EPS,
                              per_target: bool = False, input_keys: NestedKey | Sequence[NestedKey] | None = None,
                              **unknown_keywords: Any) -> torch.Tensor | None:
    """`layer_deeplift`'s map of the tensor ``x`` at its one layer by the chain walk (NOTE [layers on the chain]),
    a number as baselines; ``None``: the TensorDict's way (which checks the layers, and says what is wrong)."""
    if unknown or unknown_keywords or target is UNSET or not _number(baselines) or type(layers) not in (list, tuple) \
            or len(layers) != 1 or type(layers[0]) is not str:
        return None
    plan = tensor_plan("layer_deeplift", f, params, x, eps, input_keys)
    stops = None if plan is None else chain_links(plan, cast(Functional, f).model, layers)
    if plan is None or stops is None:
        return None
    reference = x.new_full((1, *x.shape[1:]), float(cast(float, baselines)))
    out = _layer_maps(plan, params, x, 1, x.shape[:1], reference, target, eps, per_target, layers, stops,
                      multiply_by_inputs)
    return None if out is None else out[layers[0]]


@never_traced  # (NOTE [lrp is never traced])
@accepts_tensors_via(_layer_deeplift_of_tensor)
def layer_deeplift(
    f: PureFn,
    params: TensorDictBase,
    inputs: TensorDictBase,
    baselines: Baselines = 0.0,
    *,
    target: Target,
    layers: Sequence[str],
    multiply_by_inputs: bool = True,
    eps: float = EPS,
    per_target: bool = False,
    input_keys: NestedKey | Sequence[NestedKey] | None = None,
) -> TensorDict:
    """DeepLift of layer activations (each module's output), as captum 0.9's ``LayerDeepLift``.

    The multiplier at a layer is the rescaled gradient arriving at its output (see
    `deeplift`); with ``multiply_by_inputs`` it is multiplied by the activation at the
    inputs minus the activation at the references, so the map of one sample sums to
    ``F(x) - F(reference)`` where `deeplift`'s does.

    Args:
        f (Functional): pure function of a model (`tdhook_fn.functional`).
        params (TensorDict): parameters for ``f`` (constants here).
        inputs (TensorDict | Tensor): inputs with any batch size ``[*B]``, as in `deeplift`.
        baselines (TensorDict | Tensor | float): the references of the inputs, as in
            `deeplift`. Default: ``0.0``.
        target (int | tuple[int, ...] | Tensor | Callable): see `tdhook_fn.as_target`.
        layers (Sequence[str]): paths of the modules whose outputs are attributed, as in `saliency`.
        multiply_by_inputs (bool): multiply by the change of the activation. Default: ``True``.
        eps (float): as in `deeplift`. Default: ``1e-10``.
        per_target (bool): one map per target along a new leading dim ``T``. Default: ``False``.
        input_keys (Sequence | None): which inputs the baselines replace. Default: ``f.in_keys``.

    Returns:
        TensorDict: keyed by layer path, batch ``[*B]`` or ``[T, *B]``.

    Raises:
        TypeError: ``f`` is not a Functional, or ``layers`` is not a list of paths.
        ValueError: as `deeplift`; a path names no module, or its module runs more than once.

    Examples:
        >>> import torch, tdhook_fn
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).double()
        >>> f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
        >>> x = torch.randn(5, 3, dtype=torch.float64)
        >>> attr = layer_deeplift(f, p, x, target=0, layers=["[1]"])
        >>> attr.shape
        torch.Size([5, 4])
        >>> gap = net(x)[:, 0] - net(torch.zeros(1, 3, dtype=torch.float64))[:, 0]
        >>> torch.allclose(attr.sum(-1), gap)
        True
    """
    check_layers("layer_deeplift", layers)
    walked = None if len(layers) != 1 else by_tensor_path(
        _layer_deeplift_of_tensor, f, params, inputs, baselines, target=target, per_target=per_target, key=layers[0],
        layers=layers, multiply_by_inputs=multiply_by_inputs, eps=eps, input_keys=input_keys)
    if walked is not None:
        return walked
    if not layers:
        raise ValueError("layer_deeplift: layers is empty; name the modules whose outputs are attributed "
                         "(layers=['<path>']), or use deeplift for the inputs")
    keys = attributed_keys("layer_deeplift", f, inputs, input_keys)
    if len(keys) == 1 and untransformed() and holds_only(inputs, keys[0]):
        walked = _layers_walked(f, params, inputs, baselines, target, eps, per_target, keys[0], layers,
                                multiply_by_inputs)
        if walked is not None:
            return walked
    fn = checked_functional("layer_deeplift", f, eps)
    return stacked_layer_deeplift(fn, params, inputs, baselines, target, eps, per_target, keys, layers,
                                  multiply_by_inputs)


def _layers_walked(f: Any, params: TensorDictBase, inputs: TensorDictBase, baselines: Baselines, target: Target,
                   eps: float, per_target: bool, key: NestedKey, layers: Sequence[str],
                   multiply: bool) -> TensorDict | None:
    """`layer_deeplift` by the chain walk stopped at the layers (NOTE [layers on the chain]); ``None``: not a chain
    whose links the layers are."""
    caller = "layer_deeplift"
    fn = checked_functional(caller, f, eps)
    plan = walk_plan(fn)
    if plan is None or plan.links is None:
        return None
    stops = chain_links(plan, fn.model, layers)
    if stops is None:
        return None
    check_call(caller, fn, params, inputs, (key,), target, modes=False)
    plan.check_modes(fn.model, caller)
    x, lead, batch = inputs.get(key), inputs.batch_dims, inputs.batch_size
    reference, _ = _reference_rows(caller, inputs, baselines, key)
    out = _layer_maps(plan, params, x, lead, batch, reference, target, eps, per_target, layers, stops, multiply)
    if out is None:
        return None
    return fresh_tensordict(out, [*next(iter(out.values())).shape[:1 if per_target else 0], *batch])
