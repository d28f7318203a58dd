"""Gradients at layers (and inputs) summed along the inputs' straight path, from the layer pullbacks.

The one mechanism of integrated gradients read at layers while the inputs move
(``integrated_gradients(..., layers=..., interpolate="inputs")``, tdhook's
``input_modules``) and of `internal_influence`, which is that without input maps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from .._functional import Functional
from .._taps import Tap
from .._targets import Target
from .._types import NestedKey
from ._baselines import fold, path_points
from ._engine import Cotangents, check_per_target_or_cotangents, seed_cotangents, unflatten
from ._layer_pullbacks import layer_pullbacks

__all__ = ["gradients_along_path"]


def gradients_along_path(f: Functional, params: TensorDictBase, inputs: TensorDictBase, base: TensorDictBase,
                         path_keys: Sequence[NestedKey], target: Target, *, layers: Sequence[str],
                         alphas: Sequence[float], weights: Sequence[float], input_keys: Sequence[NestedKey] = (),
                         per_target: bool = False, chunk_size: int | None = None,
                         layer_calls: Mapping[str, int] | None = None, taps: Sequence[Tap] = (),
                         target_layers: Sequence[str] = (), cotangents: Cotangents | None = None,
                         caller: str) -> tuple[TensorDict, dict[NestedKey, torch.dtype]]:
    """``sum_k w_k * grad F(b + a_k (x - b))`` at ``layers`` and at the inputs ``input_keys``.

    The inputs ``path_keys`` move from ``base`` to ``inputs``; each chunk of points is one
    forward, pulled back once per target (NOTE [two pullbacks of one forward]) and folded
    by weight (NOTE [weighted sums of the steps]). Returns the sums (batch ``[*B]``, or ``[T, *B]``
    with ``per_target``; half-precision gradients summed in float32) and the gradients'
    dtypes by key, for `in_dtypes`.
    """
    check_per_target_or_cotangents(caller, per_target, cotangents)
    calls = dict(layer_calls or {})
    totals: list[TensorDict | None] = []  # per target (one without per_target)
    dtypes: dict[NestedKey, torch.dtype] = {}
    n_steps = len(alphas)
    size = chunk_size or n_steps
    for start in range(0, n_steps, size):
        chunk = slice(start, min(start + size, n_steps))
        points = path_points(inputs, base, path_keys, alphas[chunk])
        pulled = layer_pullbacks(f, params, points, target, layers, input_keys, calls, caller, taps=taps,
                                 target_layers=target_layers)
        cot, lead = seed_cotangents(pulled.values, per_target, cotangents)
        targets = cot.batch_size[0] if lead else 1
        totals += [None] * (targets - len(totals))
        for t in range(targets):  # one target's gradients at a time: no [T, points, ...] stack
            fed = cot[t] if lead else cot
            if input_keys:
                at_inputs, at_layers = pulled.to_both(fed)
            else:
                at_inputs, at_layers = None, pulled.to_layers(fed)
            grads = TensorDict({}, batch_size=points.batch_size)
            for key, grad in at_inputs.items(True, True) if at_inputs is not None else ():
                dtypes[key] = grad.dtype
                grads.set(key, unflatten(cast(torch.Tensor, grad), 0, points.batch_size))
            for path, grad in zip(layers, at_layers, strict=True):
                dtypes[path] = grad.dtype
                grads.set(path, unflatten(grad, 0, points.batch_size))
            totals[t] = fold(totals[t], grads, weights[chunk], lead=0)  # NOTE [weighted sums of the steps]
    sums = [cast(TensorDict, total) for total in totals]
    return (cast(TensorDict, torch.stack(cast(Any, sums))) if per_target else sums[0]), dtypes
