"""DeepLift's rules on the chain walk: multipliers known in the forward, a backward of products and adjoints."""

# NOTE [deeplift on a chain]
# On a chain the walk knows (NOTE [a chain walked by hand]): linear layers and
# convolutions, the rescaled nonlinearities with a closed-form derivative (ReLU,
# LeakyReLU, Sigmoid, Tanh), max pooling, a last-dim softmax and reshapes, every
# multiplier of the rescale rule is known once the inputs and the references have gone
# forward: ``dy / dx`` (or the derivative where ``|dx| < eps``) at a nonlinearity, and the
# backward is the adjoints of the linear maps (one op each, NOTE [affine modules]) and
# elementwise products. `deeplift_step` is that rule: the walk runs the inputs (``n``
# rows) and the references (one row when shared, NOTE [deeplift as lrp rules]) as one
# batch, without a graph, and pulls back one-hot seeds: the numbers of the rules on LRP's
# walk, without the stacked batch, the taps or autograd. Anything else (other modules,
# buffers, a callable target, a transform) takes the general path of `deeplift`, which
# gives the same maps.

# NOTE [layers on the chain]
# A layer of `layer_deeplift` that is one link's output on such a chain (named by its path,
# the module in the chain once) takes the same walk: the whole forward (the links after the
# layer need their multipliers too), the walk back stopped at the layer's output, and the
# layer's change read off the forward's rows there: no second forward for the activations.
# A path that names no link, a module in the chain twice, or anything the walk refuses
# takes the general path, which names what is wrong or gives the same maps.

# NOTE [pairs on the chain]
# DeepLiftShap pairs each of ``n`` inputs with each of ``k`` references. The walk's forward
# runs the ``n + k`` rows once (not ``2 n k``: a pair's rows at a link are those of its
# input and its reference), and each rule takes its pairs' differences by broadcasting
# (``h[:n, None] - h[None, n:]``, pairs input-major): the backward runs on ``n k`` rows,
# pair ``(i, j)`` at row ``i k + j``, with the numbers of each pair walked on its own.
# Where a rule reads the inputs' rows alone (a derivative, a softmax's output, a pool's
# maxima), they broadcast along the pairs of each input.

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from torch import nn

from .._targets import Target
from .._types import Pullback
from ._chain_walk import ACTIVATIONS, WalkLink, WalkPlan, walk
from ._deeplift_rules import below_eps
from ._lrp.max_pool import MAX_POOLS, max_pool_with_indices

__all__ = ["chain_deeplift", "chain_layer_deeplift", "deeplift_step"]


def _ratio(dy: torch.Tensor, dx: torch.Tensor) -> torch.Tensor:
    # no graph here: the inf or nan where dx is 0 is never selected, and never differentiated
    return dy / dx


def _flat(dx: torch.Tensor, eps: float, *, owned: bool = False) -> torch.Tensor | None:
    """Where ``|dx| < eps``; ``None`` where nowhere, the usual case, told by a reduction (the mask's full op is
    saved; the walk runs eagerly, so the data may decide). A nan reads as somewhere: the mask is exact (in half
    precision too: NOTE [eps in half precision]).

    ``owned``: ``dx`` is the caller's and read no more, so its sizes are taken in place (no new tensor).
    """
    size = dx.abs_() if owned else dx.abs()
    # the smallest size compared as a Python number: one op fewer than a 0-d comparison and its bool
    return None if size.numel() == 0 or size.amin().item() >= eps else below_eps(size, eps)


def _halves(t: torch.Tensor, n: int, pairs: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs' rows and the references' of a link's tensor; with ``pairs``, ``[n, 1, ...]`` and ``[1, k, ...]``,
    which broadcast to every pair (NOTE [pairs on the chain])."""
    inputs, references = t.split_with_sizes((n, t.shape[0] - n))  # (one op for both)
    return (inputs.unsqueeze(1), references.unsqueeze(0)) if pairs else (inputs, references)


def _rows(t: torch.Tensor, pairs: bool) -> torch.Tensor:
    """A backward's tensor of the pairs ``[n, k, ...]`` as the walk's rows ``[n k, ...]`` (a view: made here)."""
    return t.flatten(0, 1) if pairs else t


def _elementwise(module: nn.Module, both: torch.Tensor, n: int, eps: float,
                 pairs: bool) -> tuple[torch.Tensor, Pullback]:
    function, derivative = ACTIVATIONS[type(module)]
    out = function(module, both)
    (h, r), (y, y_ref) = _halves(both, n, pairs), _halves(out, n, pairs)
    dx = h - r
    # both made here and read by nothing else: the ratio divides in place, then dx becomes its sizes in place
    ratio = (y - y_ref).div_(dx)
    flat = _flat(dx, eps, owned=True)
    # where no |dx| is below eps the multiplier is the ratio itself: the derivative and the select are skipped
    multiplier = _rows(ratio if flat is None else torch.where(flat, derivative(module, h, y), ratio), pairs)
    return out, lambda g: g * multiplier


def _softmax(module: nn.Module, both: torch.Tensor, n: int, eps: float, pairs: bool) -> tuple[torch.Tensor, Pullback]:
    out = module(both)
    (h, r), (y, y_ref) = _halves(both, n, pairs), _halves(out, n, pairs)
    dx = h - r
    flat = below_eps(dx.abs(), eps)
    ratio = _ratio(y - y_ref, dx)

    def back(g: torch.Tensor) -> torch.Tensor:
        g = g.view(ratio.shape)
        plain = y * (g - (g * y).sum(-1, keepdim=True))
        multiplied = _rows(torch.where(flat, plain, g * ratio), pairs)
        return multiplied - multiplied.flatten(1).mean(1).reshape((-1, *[1] * (multiplied.dim() - 1)))

    return out, back


def _max_pool(module: nn.Module, both: torch.Tensor, n: int, eps: float, pairs: bool) -> tuple[torch.Tensor, Pullback]:
    pool = MAX_POOLS[type(module)]
    dims = pool[0]
    out, indices = max_pool_with_indices(pool, both, module.__dict__)  # NOTE [max pooling in channels-last]
    (h, r), (y, y_ref), (at_x, at_ref) = _halves(both, n, pairs), _halves(out, n, pairs), _halves(indices, n, pairs)
    dx = h - r
    flat = _flat(dx, eps)
    top = torch.maximum(y, y_ref)
    up, down = top - y_ref, y - top
    # (broadcast views: the plane of each input, or reference, read by all its pairs)
    flat_x, flat_ref = at_x.expand_as(top).flatten(-dims), at_ref.expand_as(top).flatten(-dims)

    def back(g: torch.Tensor) -> torch.Tensor:
        g = g.view(top.shape)
        # both halves' changes scattered into one plane: where the inputs' and the references' maxima are
        moved = g.new_zeros(dx.shape).flatten(-dims)
        moved.scatter_add_(-1, flat_x, (g * up).flatten(-dims)).scatter_add_(-1, flat_ref, (g * down).flatten(-dims))
        if flat is None:  # (no |dx| below eps: the plain gradient and the select are skipped)
            return _rows(_ratio(moved.view(dx.shape), dx), pairs)
        plain = g.new_zeros(dx.shape).flatten(-dims).scatter_add_(-1, flat_x, g.flatten(-dims))
        return _rows(torch.where(flat, plain.view(dx.shape), _ratio(moved.view(dx.shape), dx)), pairs)

    return out, back


def deeplift_step(link: WalkLink, own: tuple[torch.Tensor, ...], both: torch.Tensor, n: int, eps: float,
                  rows: int) -> tuple[torch.Tensor, Pullback] | None:
    """One module's forward at the inputs and the references (``both``, ``n`` input rows first), and its backward
    on ``rows`` rows (``n``; ``n k``: every pair, NOTE [pairs on the chain]).

    ``None``: not a module the walk knows.
    """
    kind, module, pairs = link.kind, link.module, rows != n
    if kind == "affine":
        affine = link.affine
        assert affine is not None
        weight, bias = own[0], (own[1] if len(own) > 1 else None)
        out = affine.run(both, weight, bias)
        return out, affine.pullback(weight, both.shape, out.shape)  # (a C-level callable: one op)
    if kind == "activation":
        return _elementwise(module, both, n, eps, pairs)
    if kind == "pool":
        return _max_pool(module, both, n, eps, pairs)
    if kind == "softmax":
        return _softmax(module, both, n, eps, pairs) if module.__dict__.get("dim") in (-1, both.dim() - 1) else None
    in_shape = torch.Size((rows, *both.shape[1:]))
    return module(both), lambda g: g.reshape(in_shape)


def chain_deeplift(plan: WalkPlan, params: TensorDictBase, x: torch.Tensor, reference: torch.Tensor,
                   target: Target, eps: float, per_target: bool, *, pairs: bool = False) -> torch.Tensor | None:
    """DeepLift's multipliers of ``x`` (``[n, ...]``; ``[T, n, ...]`` per target) by NOTE [deeplift on a chain].

    ``reference`` has ``n`` rows or one; with ``pairs``, ``k`` rows, each the reference of
    every input: the multipliers of every pair, ``[n k, ...]`` (NOTE [pairs on the chain]).
    ``None`` where the walk does not apply.
    """
    walked = walk(plan, params, x, reference, target, eps, per_target, (-1,), deeplift_step, pairs)
    return None if walked is None else walked[0][0]


def chain_layer_deeplift(plan: WalkPlan, params: TensorDictBase, x: torch.Tensor, reference: torch.Tensor,
                         target: Target, eps: float, per_target: bool, stops: tuple[int, ...],
                         ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """DeepLift's multipliers at the output of each link in ``stops`` (``[n, ...]``; ``[T, n, ...]`` per target),
    each with that output at the inputs' and the references' rows (``n`` rows, then one or ``n``), by
    NOTE [layers on the chain]. ``None`` where the walk does not apply.
    """
    return walk(plan, params, x, reference, target, eps, per_target, stops, deeplift_step)

