"""Gradients with a rule at each ReLU, by the chain walk: the deconvnet's, guided backprop's and guided Grad-CAM's
maps without taps or autograd."""

# NOTE [gradient rules on a chain]
# On a chain the walk knows (NOTE [a chain walked by hand]), a class's gradient is the
# same walk without references: the inputs' rows forward without a graph, then back, each
# activation's derivative by the backward kernel autograd itself runs (the same numbers),
# a max pool's by the indices of its maxima, a linear layer's by autograd's product
# (NOTE [autograd's linear pullback]), another affine map's by the walk's adjoint
# (NOTE [affine modules]; at stride 1 a convolution's is a few ulps from autograd's
# kernel, as on DeepLift's and LRP's walks). The deconvnet changes only what an
# ``nn.ReLU`` module passes back (``relu`` of what arrives), guided backprop puts ``relu``
# where its taps would sit, and guided Grad-CAM walks back twice from the one forward
# (plainly to the layer, guided to the input): so their maps take this walk with those
# rules, and none of the shadow, taps and autograd of the general path, which on a small
# model cost more than the model. Anything the walk does not take (another module, a hook,
# a ReLU subclass or an in-place one, a callable target, ``cotangents``, ``input_keys``, a
# transform, params that require grad) takes the general path, which gives the same maps
# (tests compare both) and raises what is to be raised. Two differences, both the walk's
# numbers the right ones: a non-finite weight of another class in the last linear layer
# leaves the walk's maps finite where autograd's one-hot product puts NaN
# (NOTE [seed rows]), and under ``torch.inference_mode()`` the walk, needing no autograd,
# runs where the general path refuses.

# NOTE [plain gradients on a chain]
# The plain gradient (saliency's map, and so input x gradient's, integrated gradients',
# SmoothGrad's and GradientSHAP's, whose copies and path points are one batch) takes the
# same walk wherever it gives autograd's numbers bitwise, so the engine's shadow, VJP and
# target machinery are left out and only speed changes: every link's backward is then the
# kernel autograd runs on the same operands (linear layers: the product by the weight
# autograd picks, NOTE [autograd's linear pullback]; ReLU, LeakyReLU, Sigmoid, Tanh, the
# last-dim softmax: their backward kernels; reshapes and eval dropout: views), so
# convolutions (whose adjoint is another kernel) and max pooling (whose scatter may add in
# another order) keep the general path; a non-finite weight in
# the last linear layer too (NOTE [seed rows]). The map must also be what the engine
# returns in every other respect: a value, so the walk declines where the engine's map
# carries a graph (inputs or params that require grad, under grad mode: a gradient
# penalty differentiates the map; any transform, ``vmap`` and ``grad`` included), and
# under ``torch.inference_mode()`` or on inference tensors, where the engine raises. The engine asks first, for a
# call of the input maps alone (no layers, taps, passes or cotangents, an index target).

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from .._targets import Target
from .._types import NestedKey, Pullback
from .._vjp import untransformed
from ._chain_walk import (
    ACTIVATIONS,
    SEED_BACK,
    Step,
    WalkLink,
    WalkPass,
    WalkPlan,
    chain_gradient_passes,
    chain_gradients,
    chain_links,
    holds_only,
    tensor_plan,
    walk_plan,
    walked_map,
)
from ._deeplift_chain import deeplift_step
from ._inputs import UNSET, check_call
from ._lrp.max_pool import MAX_POOLS, max_pool_with_indices, to_maxima

__all__ = ["Guide", "ReluRule", "gradient_step", "guided_backprop_step", "plain_gradients", "tensor_gradients",
           "walked_gradients", "walked_guided_and_cam"]

ReluRule = Callable[[torch.Tensor], Pullback]  # a ReLU's output -> its backward (the gradient at its output -> input's)


class Guide:
    """Whether one call's guided taps rectify the gradient, switched between the pullbacks of one forward.

    Attributes:
        on (bool): ``relu`` of the gradient (guided backprop), else the gradient as it is.
    """

    __slots__ = ("on",)

    def __init__(self, on: bool = True) -> None:
        self.on = on

    def setter(self, on: bool) -> Callable[[], None]:
        """What switches the guide to ``on`` (a pass's ``before``)."""
        def switch() -> None:
            self.on = on

        return switch

_V = TypeVar("_V")
_aten: Any = torch.ops.aten  # (autograd's own backward kernels: the numbers of the general path)


def _activation(module: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, Pullback] | None:
    """An activation other than ``nn.ReLU``, with its own derivative; ``None``: one this walk has no kernel for."""
    cls = type(module)
    if cls is nn.LeakyReLU:
        slope = module.__dict__["negative_slope"]
        if isinstance(slope, torch.Tensor):
            return None  # (the functional reads a 0-d tensor as its number, the backward kernel takes numbers only)
        return ACTIVATIONS[cls][0](module, h), lambda g: _aten.leaky_relu_backward(g, h, slope, False)
    if cls is nn.Sigmoid:
        y = torch.sigmoid(h)
        return y, lambda g: _aten.sigmoid_backward(g, y)
    if cls is nn.Tanh:
        y = torch.tanh(h)
        return y, lambda g: _aten.tanh_backward(g, y)
    return None  # (an activation DeepLift's table gained later: the general path)


def _max_pool(module: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, Pullback]:
    pool = MAX_POOLS[type(module)]
    dims = pool[0]
    y, indices = max_pool_with_indices(pool, h, module.__dict__)  # NOTE [max pooling in channels-last]

    def back(g: torch.Tensor) -> torch.Tensor:  # (each maximum's gradient added where it came from)
        return to_maxima(g.reshape(y.shape), h.shape, indices, dims)

    return y, back


# NOTE [autograd's linear pullback]
# autograd pulls a linear layer back by ``grad @ W``, except where the matrix its product
# read is column-major (strides ``(1, rows)``: a transposed input, or a ``[1, 1]``
# activation, a width-1 layer at batch 1), where it takes ``(W^T @ grad^T)^T`` to give the
# map that layout; the two products may round differently in the last bit. That matrix
# is the layer's input where it is 2-d, else its rows folded into one dim, a view where
# the input is contiguous (a copy, or a batched product, else: the walk declines). So the
# gradient's step reads the input's layout and takes the product autograd takes.


def _linear(ran: tuple[torch.Tensor, Pullback], weight: torch.Tensor,
            h: torch.Tensor) -> tuple[torch.Tensor, Pullback] | None:
    """A linear layer's forward and pullback ``ran`` (``g @ W``) on its input ``h``, the pullback autograd's own
    product (NOTE [autograd's linear pullback]); ``None``: a product the walk does not run."""
    dims = h.dim()
    if dims == 2:
        folded = h
    elif dims < 2:
        return ran
    elif not h.is_contiguous():
        return None  # (autograd's product is then another kernel's: the general path)
    else:
        folded = h.view(math.prod(h.shape[:-1]), h.shape[-1])
    if folded.stride(0) != 1 or folded.stride(1) != folded.shape[0]:  # (not column-major: ``g @ W``)
        return ran
    rows, shape = folded.shape[0], h.shape

    def back(g: torch.Tensor) -> torch.Tensor:
        return weight.t().mm(g.reshape(rows, -1).t()).t().reshape(shape)

    return ran[0], back


def gradient_step(relu: ReluRule) -> Step:
    """The walk's step for a gradient whose ``nn.ReLU`` modules pass back by ``relu(output)``, every other link
    by its own derivative (NOTE [gradient rules on a chain])."""

    def step(link: WalkLink, own: tuple[torch.Tensor, ...], h: torch.Tensor, n: int, eps: float,
             rows: int) -> tuple[torch.Tensor, Pullback] | None:
        kind, module = link.kind, link.module
        if kind == "activation":
            if type(module) is nn.ReLU:
                y = torch.relu(h)
                return y, relu(y)
            return _activation(module, h)
        if kind == "pool":
            return _max_pool(module, h)
        if kind == "softmax":
            dim = module.__dict__.get("dim")
            if isinstance(dim, bool) or dim not in (-1, h.dim() - 1):
                return None  # (a bool equals 0 or 1, which the softmax refuses: the general path says so)
            y = torch.softmax(h, -1)
            return y, lambda g: _aten._softmax_backward_data(g.reshape(y.shape), y, h.dim() - 1, h.dtype)
        ran = deeplift_step(link, own, h, n, eps, rows)  # (an affine map or a reshape: DeepLift's are gradients)
        if ran is None or link.affine is None or link.affine.conv is not None:
            return ran
        return _linear(ran, own[0], h)

    return step


def _flat_input(f: Any, inputs: TensorDictBase, key: Any) -> tuple[WalkPlan, torch.Tensor] | None:
    """The walk's plan of ``f``'s model and the one input ``key``, its batch dims flattened to one; ``None``: the
    general path's call (a transform, another input, no chain the walk knows, an input not floating point)."""
    if not untransformed() or inputs.batch_dims == 0 or not holds_only(inputs, key):
        return None
    plan = walk_plan(f)
    x = inputs.get(key)
    if plan is None or plan.links is None or not x.is_floating_point():
        return None
    return plan, x if inputs.batch_dims == 1 else x.reshape(-1, *x.shape[inputs.batch_dims:])


def _batched(t: torch.Tensor, first: int, batch: torch.Size) -> torch.Tensor:
    """A walked tensor (``first`` leading target dims) with the inputs' batch dims again."""
    return t if len(batch) == 1 else t.reshape((*t.shape[:first], *batch, *t.shape[first + 1:]))


def _maps(key: Any, walked: torch.Tensor, per_target: bool, batch: torch.Size) -> TensorDict:
    """The walked map of the input ``key`` (its batch flat) as the methods return it (`walked_map`)."""
    return walked_map(key, _batched(walked, 1 if per_target else 0, batch), batch, per_target)


def walked_gradients(caller: str, f: Any, params: Any, inputs: TensorDictBase, target: Target, per_target: bool,
                     step_of: Callable[[WalkPlan], Step]) -> TensorDict | None:
    """The maps of ``f``'s one input by the walk with the step ``step_of(plan)`` (NOTE [gradient rules on a chain]);
    ``None``: the general path's call (what the walk does not take, or an argument that path checks and names)."""
    keys = getattr(f, "in_keys", None)
    if not isinstance(params, TensorDictBase) or not isinstance(keys, tuple) or len(keys) != 1:
        return None
    found = _flat_input(f, inputs, keys[0])
    if found is None:
        return None
    plan, x = found
    check_call(caller, f, params, inputs, keys, target, modes=False)
    plan.check_modes(f.model, caller)
    walked = chain_gradients(plan, params, x, target, per_target, step_of(plan))
    return None if walked is None else _maps(keys[0], walked, per_target, inputs.batch_size)


def tensor_gradients(caller: str, step: Step) -> Callable[..., torch.Tensor | None]:
    """A method's tensor path (NOTE [captum-style calls]) by the walk with ``step``, for a method taking ``target``,
    ``per_target``, ``input_keys`` and ``cotangents``: the map of the tensor ``x``, or ``None`` (the TensorDict's
    way, also where the arguments do not fit the method's signature: it says how)."""

    def of_tensor(f: Any, params: Any, key: Any, x: torch.Tensor, *unknown: Any, target: Target = UNSET,
                  per_target: bool = False, input_keys: Any = None, cotangents: Any = None,
                  **unknown_keywords: Any) -> torch.Tensor | None:
        if unknown or unknown_keywords or target is UNSET or cotangents is not None:
            return None
        plan = tensor_plan(caller, f, params, x, 0.0, input_keys)  # (its checks: those of the TensorDict's way)
        return None if plan is None else chain_gradients(plan, params, x, target, per_target, step)

    return of_tensor


def _own_relu(y: torch.Tensor) -> Pullback:
    """A ReLU's own backward (autograd's kernel): the gradient where its output is positive."""
    return lambda g: _aten.threshold_backward(g, y, 0)


_OWN_STEP = gradient_step(_own_relu)


_DERIVED_KEPT = 16  # (the steps a plan keeps, one per option: a loop over many starts over rather than grow)

_AUTOGRAD_EXACT = "autograd's kernels"  # (the plan's derived key: whether every link's backward is autograd's)


def _derive(plan: WalkPlan, key: Hashable, value: _V) -> _V:
    """``value`` kept with ``plan`` under ``key`` (bounded: a loop over many options starts over rather than grow)."""
    if len(plan.derived) >= _DERIVED_KEPT:
        plan.derived.clear()
    plan.derived[key] = value
    return value


def _autograd_exact(plan: WalkPlan) -> bool:
    """Whether the walk's plain gradient on ``plan``'s links is autograd's, bitwise
    (NOTE [plain gradients on a chain]): no convolution, no max pool."""
    exact: bool | None = plan.derived.get(_AUTOGRAD_EXACT)
    if exact is None:
        assert plan.links is not None
        exact = _derive(plan, _AUTOGRAD_EXACT, all(
            link.kind in ("activation", "softmax", "reshape")
            or (link.kind == "affine" and link.affine is not None and link.affine.conv is None)
            for link in plan.links))
    return exact


def plain_gradients(f: Any, params: Any, inputs: TensorDictBase, target: Target, input_keys: Sequence[NestedKey],
                    per_target: bool) -> TensorDict | None:
    """The engine's input maps of a plain gradient by the walk (NOTE [plain gradients on a chain]); ``None``: the
    engine's own way. The engine checked the arguments."""
    keys = getattr(f, "in_keys", None)
    if not isinstance(params, TensorDictBase) or not isinstance(keys, tuple) or len(keys) != 1 \
            or len(input_keys) != 1 or input_keys[0] != keys[0]:
        return None
    found = _flat_input(f, inputs, keys[0])  # (transforms declined there first: Dynamo cannot trace the flag below)
    if found is None or torch.is_inference_mode_enabled() or (found[1].requires_grad and torch.is_grad_enabled()) \
            or found[1].is_inference() or not _autograd_exact(found[0]):
        return None  # (inference mode or tensors: autograd refuses them, so the engine raises)
    batch = inputs.batch_size
    if isinstance(target, torch.Tensor) and 0 < target.dim() < len(batch) and target.shape == batch[-target.dim():]:
        # (labels of the trailing batch dims, as the engine reads them: NOTE [tensor targets])
        target = target.expand(batch)
    walked = chain_gradients(found[0], params, found[1], target, per_target, _OWN_STEP, as_autograd=True)
    return None if walked is None else _maps(keys[0], walked, per_target, batch)


def guided_backprop_step(plan: WalkPlan, model: nn.Module, classes_to_skip: tuple[type[nn.Module], ...]) -> Step:
    """Guided backprop's walk step on ``plan``'s links (NOTE [guided backprop as taps], as a walk): each link's own
    backward, then ``relu`` of the gradient leaving it where a tap would be at its input: its module is not an
    instance of ``classes_to_skip``, or it is the first link of an enclosing ``Sequential`` (not the root) that is
    not. Made once per plan and classes (kept with the links it reads)."""
    key = ("guided backprop", classes_to_skip)
    step: Step | None = plan.derived.get(key)
    if step is not None:
        return step
    assert plan.links is not None
    rectified = set()
    for index, (name, link) in enumerate(zip(plan.names, plan.links, strict=True)):
        parts = name.split(".")
        # (an enclosing Sequential's input is its first link's: a prefix no earlier link shares)
        containers = [".".join(parts[:depth]) for depth in range(1, len(parts))]
        first_of = [c for c in containers if not any(n.startswith(c + ".") for n in plan.names[:index])]
        if not isinstance(link.module, classes_to_skip) or any(
                not isinstance(model.get_submodule(c), classes_to_skip) for c in first_of):
            rectified.add(id(link))  # (the plan holds its links: their ids stay theirs while it is kept)
    # an empty Sequential has no link, but a tap at its input: where one is guided, the walk declines (the general path)
    unlinked = any(isinstance(m, nn.Sequential) and not m._modules and not isinstance(m, classes_to_skip)
                   for m in model.modules())

    def guided(link: WalkLink, own: tuple[torch.Tensor, ...], h: torch.Tensor, n: int, eps: float,
               rows: int) -> tuple[torch.Tensor, Pullback] | None:
        ran = None if unlinked else _OWN_STEP(link, own, h, n, eps, rows)
        if ran is None or id(link) not in rectified:
            return ran
        y, back = ran
        return y, lambda g: torch.relu(back(g))

    # where the last link's weight rows seed the walk, its relu goes on them (NOTE [seed rows], `SEED_BACK`)
    if plan.links and id(plan.links[-1]) in rectified:
        setattr(guided, SEED_BACK, torch.relu)
    return _derive(plan, key, guided)


def _guided(guide: Guide) -> ReluRule:
    """Guided backprop's ReLU rule, ``relu`` of the ReLU's own gradient, where ``guide`` is on; else its own."""

    def rule(y: torch.Tensor) -> Pullback:
        def back(g: torch.Tensor) -> torch.Tensor:
            own: torch.Tensor = _aten.threshold_backward(g, y, 0)
            return torch.relu(own) if guide.on else own

        return back

    return rule


def walked_guided_and_cam(f: Any, params: TensorDictBase, inputs: TensorDictBase, target: Target, key: Any,
                          layer: str, per_target: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Guided Grad-CAM's three tensors by the walk: the input's guided-backprop map, the layer's plain gradient and
    its activation (NOTE [guided Grad-CAM in one forward], walked back twice from the one forward of
    NOTE [gradient rules on a chain]); ``None``: the general path's call. The caller checked the arguments."""
    found = _flat_input(f, inputs, key)
    stops = None if found is None else chain_links(found[0], f.model, (layer,))
    if found is None or stops is None:
        return None
    guide = Guide(on=False)
    walked = chain_gradient_passes(found[0], params, found[1], target, per_target, gradient_step(_guided(guide)),
                                   (WalkPass(stops, guide.setter(False)), WalkPass((-1,), guide.setter(True))))
    if walked is None:
        return None
    (layer_grad, act), (guided, _) = walked
    first, batch = (1 if per_target else 0), inputs.batch_size
    return _batched(guided, first, batch), _batched(layer_grad, first, batch), _batched(act, 0, batch)
