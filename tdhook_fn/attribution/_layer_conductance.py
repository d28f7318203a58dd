"""Layer conductance (Dhamdhere et al. 2018): a layer's share of the change of the target along the path."""

# NOTE [conductance by differences]
# The conductance of a hidden unit ``y`` is ``int dF/dy * dy/da da`` along the straight
# path from the baselines to the inputs. As captum 0.9's ``LayerConductance``, the
# ``dy/da da`` factor is the difference of the layer's activations at consecutive path
# points: ``sum_k dF/dy(a_k) * (y(a_{k+1}) - y(a_k))`` over the ``n_steps + 1`` nodes of
# ``method`` (its weights are not used). So one forward reads both ``y`` and, by a zero
# perturbation, ``dF/dy`` at every point: all points of a chunk in one forward and one
# pullback per target, no Jacobian of the layer. With the trapezoid nodes (``0`` and ``1`` included) the maps sum
# over the layer to ``F(x) - F(b)`` exactly where ``F`` is linear in the layer, and up to
# the quadrature's error elsewhere. Chunks need no overlapping point: the last gradient and
# activation of a chunk are carried to the next one's first difference.

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from .._functional import Functional
from .._targets import Target
from .._types import NestedKey, PureFn
from .._vjp import untransformed
from ._baselines import Baselines, both_ends, path_points, quadrature, wide
from ._convergence import delta_of
from ._engine import seed_cotangents, unflatten
from ._inputs import accepts_tensors
from ._layer_pullbacks import layer_pullbacks
from ._path_checks import check_chunk_size, check_layer_paths, check_steps, checked_path_ends
from ._target_values import target_values

__all__ = ["layer_conductance"]

_CALLER = "layer_conductance"


@accepts_tensors
def layer_conductance(
    f: PureFn,
    params: TensorDictBase,
    inputs: TensorDictBase,
    baselines: Baselines = 0.0,
    *,
    target: Target,
    layers: Sequence[str],
    n_steps: int = 50,
    method: str = "gausslegendre",
    per_target: bool = False,
    chunk_size: int | None = None,
    return_convergence_delta: bool = False,
    input_keys: NestedKey | Sequence[NestedKey] | None = None,
    layer_calls: Mapping[str, int] | None = None,
) -> TensorDict | tuple[TensorDict, torch.Tensor]:
    """Conductance of every unit of each layer: captum's ``LayerConductance``, batched.

    ``attr[y] = sum_k dF/dy(p_k) * (y(p_{k+1}) - y(p_k))`` over the path points
    ``p_k = b + a_k (x - b)`` at the ``n_steps + 1`` nodes ``a_k`` of ``method`` (its
    weights are not used: the differences of the activations stand for ``dy``, as in
    captum). All points of a chunk go through ``f`` in one
    forward and one VJP; several targets give one map each with ``per_target`` (no extra
    forward). Only the inputs move; ``params`` are constants.

    Args:
        f (Functional): pure ``f(params, td) -> td`` (a `tdhook_fn.Functional`: layers are
            read through taps).
        params (TensorDict): parameters for ``f``.
        inputs (TensorDict | Tensor): inputs, any batch size ``[*B]``; or a tensor, batch
            first, for an ``f`` with one in_key (the one map is then a tensor).
        baselines (TensorDict | Tensor | float): the path's start, as in
            `integrated_gradients`. Default: ``0.0`` (captum's ``None``).
        target (int | tuple[int, ...] | Tensor | Callable): see `tdhook_fn.as_target`.
        layers (Sequence[str]): paths of the layers whose outputs are attributed; each
            gets its own map (several layers cost one forward).
        n_steps (int): number of differences; the path has ``n_steps + 1`` points.
            Default: 50.
        method (str): the node rule, ``riemann_left|right|middle|trapezoid`` or
            ``gausslegendre`` (captum's default; its nodes miss both ends, so completeness
            is approximate). Default: ``"gausslegendre"``.
        per_target (bool): one map per target on a new leading dim ``T``. Default: the sum.
        chunk_size (int | None): path points per forward (captum's
            ``internal_batch_size`` is ``chunk_size`` times the batch); bounds memory.
        return_convergence_delta (bool): also return ``sum(attr) - (F(x) - F(b))`` per
            sample (and per target), summed over every layer's map: give one layer for
            captum's delta.
        input_keys (Sequence | None): the inputs the baselines replace (the others are
            passed unchanged, as captum's ``additional_forward_args``). Default: every
            input ``f`` reads.
        layer_calls (Mapping[str, int] | None): the run to attribute of a layer whose
            module runs more than once, as in `saliency`.

    Returns:
        TensorDict | tuple[TensorDict, Tensor]: one map per layer path, shaped like its
        activation (batch ``[*B]``, or ``[T, *B]``); with the delta, shaped ``[*B]`` or
        ``[T, *B]``. For a tensor ``inputs`` and one layer, the map as a tensor.

    Raises:
        ValueError: no layers, unknown method, ``n_steps`` below 1, a bad ``chunk_size``,
            or baselines whose shape does not fit.
        TypeError: an input on the path is not floating point, or ``f`` is not a
            `tdhook_fn.Functional`.

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> f, p = tdhook_fn.pure(net)
        >>> x = TensorDict(input=torch.randn(5, 3), batch_size=[5])
        >>> attr, delta = layer_conductance(f, p, x, 0.0, target=1, layers=["[1]"], method="riemann_trapezoid",
        ...                                 return_convergence_delta=True)
        >>> attr["[1]"].shape, bool(delta.abs().max() < 1e-5)  # the last layer is linear: complete
        (torch.Size([5, 4]), True)
        >>> per_sample = torch.func.vmap(lambda td: layer_conductance(f, p, td, target=1, layers=["[1]"]))(x)
        >>> torch.allclose(per_sample["[1]"], layer_conductance(f, p, x, target=1, layers=["[1]"])["[1]"])
        True
    """
    check_layer_paths(_CALLER, layers)
    check_steps(_CALLER, n_steps, least=1)
    check_chunk_size(_CALLER, chunk_size)
    alphas, _ = quadrature(method, n_steps + 1)
    keys, base = checked_path_ends(_CALLER, f, params, inputs, baselines, target, input_keys)
    if not isinstance(f, Functional):
        raise TypeError(f"{_CALLER}: f must be a tdhook_fn.Functional (layers are read through taps); build it with "
                        "f, params = tdhook_fn.pure(model)")
    maps = _summed_shares(f, params, inputs, base, keys, target, layers, alphas, per_target, chunk_size,
                          dict(layer_calls or {}))
    lead = [next(iter(maps.values())).shape[0]] if per_target else []  # T
    attrs = TensorDict(maps, batch_size=[*lead, *inputs.batch_size])
    if not return_convergence_delta:
        return attrs
    values = target_values(f, params, both_ends(inputs, base), target)
    return attrs, delta_of(values, inputs.batch_size, attrs, per_target, None)


def _summed_shares(f: Functional, params: TensorDictBase, inputs: TensorDictBase, base: TensorDictBase,
                   keys: Sequence[NestedKey], target: Target, layers: Sequence[str], alphas: Sequence[float],
                   per_target: bool, chunk_size: int | None, calls: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """Each layer's conductance map, ``[*B, ...]`` or ``[T, *B, ...]``, chunk by chunk along the path."""
    total: dict[tuple[str, int], torch.Tensor] = {}
    last_grads: dict[tuple[str, int], torch.Tensor] = {}  # a chunk's last gradient, per layer and target
    last_acts: dict[str, torch.Tensor] = {}  # and its last activation, per layer
    dtypes: dict[str, torch.dtype] = {}
    targets = 1
    size = chunk_size or len(alphas)
    for start in range(0, len(alphas), size):
        points = path_points(inputs, base, keys, alphas[start:start + size])
        # see NOTE [two pullbacks of one forward]
        pulled = layer_pullbacks(f, params, points, target, layers, (), calls, _CALLER)
        cot, lead = seed_cotangents(pulled.values, per_target, None)
        targets = cot.batch_size[0] if lead else 1
        steps = {}  # y(a_{k+1}) - y(a_k): one per layer and chunk, for every target
        for path, act in zip(layers, pulled.acts, strict=True):
            act = unflatten(wide(act), 0, points.batch_size)  # half: summed in float32
            if path in last_acts:  # the difference across the chunks' border
                act = torch.cat([last_acts[path], act])
            steps[path], last_acts[path] = act[1:] - act[:-1], act[-1:]
        for t in range(targets):  # one target's gradients at a time: no [T, points, ...] stack
            fed = cot[t] if lead else cot
            grads = pulled.to_layers(fed)
            owned = _owned(grads, fed)
            for path, grad, own in zip(layers, grads, owned, strict=True):
                dtypes[path] = grad.dtype
                grad = unflatten(wide(grad), 0, points.batch_size)
                if (path, t) in last_grads:
                    grad = torch.cat([last_grads[path, t], grad])
                last_grads[path, t] = grad[-1:].clone()  # (_shares may write grad[:-1], never this row)
                share = _shares(grad, steps[path], own)
                total[path, t] = share if (path, t) not in total else total[path, t] + share
    if per_target:
        return {p: torch.stack([total[p, t] for t in range(targets)]).to(dtypes[p]) for p in layers}
    return {p: total[p, 0].to(dtypes[p]) for p in layers}


def _shares(grad: torch.Tensor, steps: torch.Tensor, own: bool) -> torch.Tensor:
    """``sum_k grad_k * (act_{k+1} - act_k)`` over the points (NOTE [conductance by differences]).

    Where ``grad`` is ``own`` (a fresh gradient nothing else reads), the products are
    written over its rows: no second tensor the size of all points' activations (on the
    CPU its fresh pages cost about as much as the product itself).
    """
    if own:
        return grad[:-1].mul_(steps).sum(0)
    return (grad[:-1] * steps).sum(0)


def _owned(grads: Sequence[torch.Tensor], fed: TensorDictBase) -> list[bool]:
    """Which of a pullback's gradients may be written: eager, whole, and sharing memory with no other
    gradient and no cotangent (autograd passes one buffer on to several inputs where it can)."""
    if not untransformed():
        return [False] * len(grads)
    storages = [g.untyped_storage().data_ptr() for g in grads]
    taken = {t.untyped_storage().data_ptr() for t in fed.values(True, True) if isinstance(t, torch.Tensor)}
    return [not g.requires_grad and g.is_contiguous() and storages.count(s) == 1 and s not in taken
            for g, s in zip(grads, storages, strict=True)]
