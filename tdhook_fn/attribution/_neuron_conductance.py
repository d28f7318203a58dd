"""Neuron conductance (Dhamdhere et al. 2018): the inputs' shares of the flow through one neuron."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from .._functional import Functional
from .._targets import Target
from .._types import NestedKey, PureFn
from ._baselines import Baselines, fold, in_dtypes, path_points, quadrature, wide
from ._engine import scaled, seed_cotangents, unflatten
from ._inputs import accepts_tensors
from ._layer_pullbacks import layer_pullbacks
from ._path_checks import check_chunk_size, check_steps, checked_path_ends

__all__ = ["neuron_conductance"]

Selector = int | tuple[int | slice, ...] | Callable[[torch.Tensor], torch.Tensor]
_CALLER = "neuron_conductance"


@accepts_tensors
def neuron_conductance(
    f: PureFn,
    params: TensorDictBase,
    inputs: TensorDictBase,
    baselines: Baselines = 0.0,
    *,
    target: Target,
    layer: str,
    neuron_selector: Selector,
    n_steps: int = 50,
    method: str = "riemann_trapezoid",
    multiply_by_inputs: bool = True,
    per_target: bool = False,
    chunk_size: int | None = None,
    input_keys: NestedKey | Sequence[NestedKey] | None = None,
    layer_call: int | None = None,
) -> TensorDict:
    """Each input's conductance through one neuron: captum's ``NeuronConductance``, batched.

    ``attr = (x - b) * sum_k w_k * dF/dn(p_k) * dn/dx(p_k)`` at the path points
    ``p_k = b + a_k (x - b)`` with the nodes and weights of ``method``, ``n`` the neuron
    that ``neuron_selector`` picks from ``layer``'s output. Both gradients come from one
    forward of all points of a chunk, pulled back twice; several
    targets give one map each with ``per_target``.

    Args:
        f (Functional): pure ``f(params, td) -> td`` (a `tdhook_fn.Functional`).
        params (TensorDict): parameters for ``f`` (constants here).
        inputs (TensorDict | Tensor): inputs, any batch size ``[*B]``; or a tensor, batch
            first, for an ``f`` with one in_key (the one map is then a tensor).
        baselines (TensorDict | Tensor | float): the path's start, as in
            `integrated_gradients`. Default: ``0.0`` (captum's ``None``).
        target (int | tuple[int, ...] | Tensor | Callable): see `tdhook_fn.as_target`.
        layer (str): path of the layer whose output holds the neuron.
        neuron_selector (int | tuple | Callable): as captum's: an index into one sample's
            activation (an int, or a tuple of ints and slices; the units a slice selects are
            summed), or a callable taking the layer's activation of the flattened batch of
            path points ``[R, ...]`` and returning one value per row ``[R]`` (captum applies
            it to the gradients at the layer too, and so does this).
        n_steps (int): number of path points. Default: 50.
        method (str): ``riemann_left|right|middle|trapezoid`` or ``gausslegendre``.
            Default: ``"riemann_trapezoid"``, as captum's.
        multiply_by_inputs (bool): multiply by ``x - b``. Default: ``True``.
        per_target (bool): one map per target on a new leading dim ``T``. Default: the sum.
        chunk_size (int | None): path points per forward; bounds memory.
        input_keys (Sequence | None): the inputs attributed and moved along the path (the
            others are passed unchanged). Default: every input ``f`` reads.
        layer_call (int | None): the run of ``layer``'s module to read, where it runs more
            than once (``0`` first, ``-1`` last).

    Returns:
        TensorDict: keyed like the attributed inputs, batch ``[*B]`` or ``[T, *B]``. For
        a tensor ``inputs``, the one map as a tensor.

    Raises:
        ValueError: unknown method, too few steps, a bad ``chunk_size``, or a selector that
            does not fit the layer (too many indices, one out of range, a callable not
            returning one value per row).
        TypeError: ``f`` is not a `tdhook_fn.Functional`, ``layer`` is not a path, the
            selector is neither an index nor a callable, or an input is not floating point.

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> f, p = tdhook_fn.pure(net)
        >>> x = TensorDict(input=torch.randn(5, 3), batch_size=[5])
        >>> neuron_conductance(f, p, x, 0.0, target=1, layer="[1]", neuron_selector=(2,))["input"].shape
        torch.Size([5, 3])
        >>> per_sample = torch.func.vmap(
        ...     lambda td: neuron_conductance(f, p, td, target=1, layer="[1]", neuron_selector=2))(x)
        >>> full = neuron_conductance(f, p, x, target=1, layer="[1]", neuron_selector=2)
        >>> torch.allclose(per_sample["input"], full["input"])
        True
    """
    if not isinstance(layer, str):
        raise TypeError(f"{_CALLER}: layer must be one submodule path (str), got {layer!r}")
    select = _selector(neuron_selector)
    check_steps(_CALLER, n_steps, least=1)
    check_chunk_size(_CALLER, chunk_size)
    alphas, steps = quadrature(method, n_steps)
    keys, base = checked_path_ends(_CALLER, f, params, inputs, baselines, target, input_keys)
    if not isinstance(f, Functional):
        raise TypeError(f"{_CALLER}: f must be a tdhook_fn.Functional (the layer is read through taps); build it with "
                        "f, params = tdhook_fn.pure(model)")
    calls = {} if layer_call is None else {layer: layer_call}
    lead = 1 if per_target else 0
    total: TensorDict | None = None
    size = chunk_size or n_steps
    for start in range(0, n_steps, size):
        chunk = slice(start, min(start + size, n_steps))
        points = path_points(inputs, base, keys, alphas[chunk])
        grads = _neuron_gradients(f, params, points, target, layer, select, keys, per_target, calls)
        total = fold(total, grads, steps[chunk], lead=lead)
    assert total is not None
    if multiply_by_inputs:
        total = scaled(total, {k: wide(inputs.get(k)) - wide(base.get(k)) for k in keys})
    return in_dtypes(total, {k: inputs.get(k).dtype for k in keys})  # half precision: summed in float32


def _neuron_gradients(f: Functional, params: TensorDictBase, points: TensorDictBase, target: Target, layer: str,
                      select: Callable[[torch.Tensor], torch.Tensor], keys: Sequence[NestedKey], per_target: bool,
                      calls: Mapping[str, int]) -> TensorDict:
    """``dF/dn * dn/dx`` at every point of ``points`` (batch ``[n, *B]``), by input key; ``[T, n, *B]`` per target."""
    batch = points.batch_size
    # see NOTE [two pullbacks of one forward]
    pulled = layer_pullbacks(f, params, points, target, [layer], keys, calls, _CALLER)
    cot, lead = seed_cotangents(pulled.values, per_target, None)
    (act,) = pulled.acts
    maps = []
    for t in range(cot.batch_size[0]) if lead else [None]:
        (at_layer,) = pulled.to_layers(cot if t is None else cot[t])
        mid = _checked(select(at_layer), at_layer)
        local: Any = torch.func.vjp(select, act)[1]  # the neuron's gradient at the layer, weighted by dF/dn
        maps.append(pulled.to_inputs([local(mid)[0]]))
    grads: TensorDictBase = cast(TensorDictBase, torch.stack(cast(Any, maps))) if lead else maps[0]
    out = TensorDict({}, batch_size=[*grads.batch_size[:lead], *batch])
    for key, value in grads.items(True, True):
        out.set(key, unflatten(cast(torch.Tensor, value), lead, batch))
    return out


def _selector(neuron_selector: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """``neuron_selector`` as a function ``[R, ...] -> [R]``; indices are checked against the activation."""
    if callable(neuron_selector):
        return cast(Callable[[torch.Tensor], torch.Tensor], neuron_selector)
    index = (neuron_selector,) if isinstance(neuron_selector, int) else neuron_selector
    if (not isinstance(index, tuple) or not index
            or not all(isinstance(i, slice) or (isinstance(i, int) and not isinstance(i, bool)) for i in index)):
        raise TypeError(f"{_CALLER}: neuron_selector must be an int, a tuple of ints and slices (an index into one "
                        f"sample's activation), or a callable activation -> one value per row; got {neuron_selector!r}")
    summed = any(isinstance(i, slice) for i in index)

    def pick(act: torch.Tensor) -> torch.Tensor:
        dims = act.shape[1:]
        if len(index) > len(dims):
            raise ValueError(f"{_CALLER}: neuron_selector {neuron_selector!r} has {len(index)} indices, but the "
                             f"layer's activation has {len(dims)} dims per sample {list(dims)}")
        for i, size in zip(index, dims, strict=False):
            if isinstance(i, int) and not -size <= i < size:
                raise ValueError(f"{_CALLER}: neuron_selector {neuron_selector!r} is out of range for the layer's "
                                 f"activation of {list(dims)} per sample")
        chosen = act[(slice(None), *index)]
        return chosen.reshape(chosen.shape[0], -1).sum(1) if summed else chosen

    return pick


def _checked(mid: Any, at_layer: torch.Tensor) -> torch.Tensor:
    if not isinstance(mid, torch.Tensor) or mid.shape != at_layer.shape[:1]:
        seen = list(mid.shape) if isinstance(mid, torch.Tensor) else type(mid).__name__
        raise ValueError(f"{_CALLER}: neuron_selector must give one value per row of the layer's activation "
                         f"([{at_layer.shape[0]}] for its {list(at_layer.shape)}), got {seen}; select one neuron "
                         "(or sum several) per sample")
    return mid
