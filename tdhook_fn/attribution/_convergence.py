"""The convergence delta of integrated gradients: ``sum(attributions) - (F(x) - F(b))``."""

# NOTE [convergence delta]
# Completeness (Sundararajan et al. 2017): integrated gradients along a path sum to the
# change of the target along it. `convergence_delta` is that sum minus that change,
# as captum's ``compute_convergence_delta``: every map it is given counts. What
# ``integrated_gradients(..., return_convergence_delta=True)`` gives it are the maps of the
# path's own space, the only ones completeness speaks of: the inputs' maps where the
# inputs move; the layers' where the layers move (``interpolate="layers"``). Gradients
# read at a layer while the inputs move (``interpolate="inputs"``) are path-averaged
# gradients, not shares of the change, and do not count. With ``cotangents`` the maps sum
# to the change weighted by them, exactly where they do not depend on the target values
# (the same at both ends of the path); with others no difference of two values is what
# the maps sum to, and the delta raises. The compat layer gives tdhook's formula: every
# map counted, the change not weighted.

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from tensordict import TensorDictBase

from .._taps import Tap
from .._targets import Target
from .._types import NestedKey
from ._baselines import Baselines, attributed_keys, both_ends, path_starts
from ._engine import Cotangents
from ._inputs import check_call
from ._target_values import target_values

__all__ = ["convergence_delta", "delta_of"]


def convergence_delta(
    f: Callable[[TensorDictBase, TensorDictBase], TensorDictBase],
    params: TensorDictBase,
    inputs: TensorDictBase,
    baselines: Baselines,
    attributions: TensorDictBase,
    *,
    target: Target,
    per_target: bool = False,
    input_keys: NestedKey | Sequence[NestedKey] | None = None,
    target_layers: Sequence[str] = (),
    taps: Sequence[Tap] = (),
    cotangents: Cotangents | None = None,
) -> torch.Tensor:
    """``sum(attributions) - (F(inputs) - F(baselines))`` per sample (and target), as captum's delta.

    Every map in ``attributions`` counts (completeness speaks of the maps of the path's
    space: the inputs', or the layers' when the layers are interpolated); ``F`` is the
    target, summed over its values, or one per target with ``per_target`` (``attributions``
    then ``[T, *B]``).

    Args:
        f (Functional | Callable): the pure function the attribution was computed with.
        params (TensorDict): its parameters, as the attribution was computed.
        target (int | tuple[int, ...] | Tensor | Callable): the attribution's target.
        target_layers (Sequence[str]): the attribution's ``target_layers``.
        taps (Sequence[Tap]): the attribution's ``taps``.
        inputs (TensorDict): the path's end, batch ``[*B]``.
        baselines (TensorDict | Tensor | float): the path's start, as
            `integrated_gradients` takes it: a baseline per attributed input (other
            keys of a TensorDict are not read), one tensor for the one attributed input,
            or a number for all of them. The inputs not attributed stay as they are.
        attributions (TensorDict): the maps, batch ``[*B]`` or ``[T, *B]``.
        per_target (bool): one delta per target.
        input_keys (list | None): the inputs the baselines replace, as in
            `integrated_gradients` (default: every input ``f`` reads).
        cotangents (Callable | None): what the attribution put in at the targets; the
            change is weighted by it. It must not depend on the target values.

    Returns:
        Tensor: ``[*B]``, or ``[T, *B]`` with ``per_target``.

    Raises:
        KeyError: a TensorDict of baselines lacks an attributed input.
        ValueError: ``cotangents`` differ between the two ends (they depend on the
            values), a baseline's shape is not its input's, or ``f`` takes several keyword
            inputs and ``input_keys`` does not say which the baselines replace.

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> from tdhook_fn.attribution import integrated_gradients
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> f, p = tdhook_fn.pure(net)
        >>> x = TensorDict(input=torch.randn(5, 3), batch_size=[5])
        >>> b = TensorDict(input=torch.zeros(5, 3), batch_size=[5])
        >>> attr = integrated_gradients(f, p, x, b, target=1, n_steps=64)
        >>> bool(convergence_delta(f, p, x, b, attr, target=1).abs().max() < 1e-3)
        True
        >>> attr = integrated_gradients(f, p, x, 0.0, target=1, n_steps=64)  # baselines as a number
        >>> bool(convergence_delta(f, p, x, 0.0, attr, target=1).abs().max() < 1e-3)
        True
    """
    check_call("convergence_delta", f, params, inputs)
    keys = attributed_keys("convergence_delta", f, inputs, input_keys)
    ends = both_ends(inputs, path_starts(inputs, baselines, keys, "convergence_delta"))
    values = target_values(f, params, ends, target, target_layers=target_layers, taps=taps)
    return delta_of(values, inputs.batch_size, attributions, per_target, cotangents)


def delta_of(values: TensorDictBase, batch: torch.Size, attributions: TensorDictBase, per_target: bool,
             cotangents: Cotangents | None) -> torch.Tensor:
    """``sum(attributions) - change``; ``values`` are the target values at both ends, ``[2, *B]``."""
    values = values.reshape(2, *batch)
    weights = None if cotangents is None else _constant_weights(cotangents, values)
    lead = 1 if per_target else 0
    change: Any = None
    for key, v in values.items(True, True):
        difference = v[1] - v[0]
        if weights is not None:
            difference = difference * weights[key]
        if difference.dim() == len(batch):
            difference = difference.unsqueeze(-1)
        difference = difference.flatten(len(batch))  # [*B, T]
        if not per_target:  # each target its own sum: targets of different widths add up per sample
            difference = difference.sum(-1)
        change = difference if change is None else change + difference
    assert change is not None
    if per_target:
        change = change.movedim(-1, 0)
    total = sum(a.flatten(lead + len(batch)).sum(-1) for a in attributions.values(True, True))
    return cast(torch.Tensor, total - change)


def _constant_weights(cotangents: Cotangents, values: TensorDictBase) -> dict[Any, torch.Tensor]:
    """The cotangents at both ends, which must agree (NOTE [convergence delta]); those of the end, by key."""
    weights = cotangents(values)
    if not isinstance(weights, TensorDictBase):
        raise TypeError(f"cotangents must return a TensorDict, got {type(weights).__name__}")
    end: dict[Any, torch.Tensor] = {}
    for key, leaf in weights.items(True, True):
        w = cast(torch.Tensor, leaf).expand(values.get(key).shape)
        end[key] = w[1]
        if not torch.equal(w[0], w[1]):
            raise ValueError(
                f"integrated_gradients: the convergence delta with cotangents that depend on the target values "
                f"(target {key!r} gets other cotangents at the baseline than at the input): the maps then sum to "
                "the integral of the cotangents along the path, which no difference of two values gives. Use "
                "cotangents that do not depend on the values, or leave the delta out")
    return end
