"""The points of the straight path from the baselines to the inputs, and sums of gradients along it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from .._functional import NestedKey

__all__ = ["fold", "in_dtypes", "path_points", "wide"]


def path_points(inputs: TensorDictBase, base: TensorDictBase, keys: Sequence[NestedKey],
                 alphas: Sequence[float]) -> TensorDict:
    """Inputs at the path points, batch ``[n, *B]``; other keys repeated."""
    n = len(alphas)
    points = TensorDict({}, batch_size=[n, *inputs.batch_size])
    for key, x in inputs.items(True, True):
        if key in keys:
            b = base.get(key)
            a = torch.tensor(alphas, dtype=x.dtype, device=x.device).reshape(n, *[1] * x.dim())
            points.set(key, b + a * (x - b))  # captum's baseline + alpha * (input - baseline)
        else:
            points.set(key, x.expand(n, *x.shape))
    for key, value in inputs.non_tensor_items(True):  # a string or number kwarg the forward also takes
        points.set_non_tensor(key, value)
    return points


def fold(total: TensorDict | None, grads: TensorDict, weights: Sequence[float], lead: int) -> TensorDict:
    """``total + sum_k w_k * grads[k]``, added one step at a time."""
    # NOTE [chunk-invariant sums]
    # The path points are added one by one, in order, so every ``chunk_size`` folds the same
    # terms in the same order. The terms themselves may differ in the last bits: a chunk's
    # gradients come from one forward and VJP over ``chunk * N`` points, and CPU kernels
    # (MKL and oneDNN gemms) may block and reduce differently for another batch size and
    # instruction set. Results for different ``chunk_size`` agree to a few ulps, not always
    # bitwise. captum reduces with ``torch.sum`` over all steps at once, whose blocked order
    # differs from a sequential one by an ulp or so in float32. In float64 captum also rounds
    # the weights to float32; ours keep the input's dtype. Half-precision gradients (bf16,
    # fp16) are summed in float32: added one by one in their own dtype, hundreds of steps
    # lose most of their digits (measured: 13% relative error in bf16 at 300 steps, captum
    # 0.3%); `integrated_gradients` casts the sum back at the end.
    out = TensorDict({}, batch_size=[s for i, s in enumerate(grads.batch_size) if i != lead])
    for key, g in grads.items(True, True):
        assert isinstance(g, torch.Tensor)
        if g.dtype in (torch.float16, torch.bfloat16):
            g = g.float()
        acc: Any = None if total is None else total.get(key)
        for k, w in enumerate(weights):
            acc = g.select(lead, k) * w if acc is None else torch.add(acc, g.select(lead, k), alpha=w)
        out.set(key, acc)
    return out


def in_dtypes(total: TensorDict, dtypes: Mapping[Any, torch.dtype]) -> TensorDict:
    """``total`` (summed in float32 where the gradients were half precision) back in the gradients' dtypes."""
    if all(total.get(key).dtype == dtype for key, dtype in dtypes.items()):
        return total
    out = total.clone(False)
    for key, dtype in dtypes.items():
        out.set(key, total.get(key).to(dtype))
    return out


def wide(t: torch.Tensor) -> torch.Tensor:
    """Half-precision floats in float32 (the sum of the steps is kept there too); others as they are."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
