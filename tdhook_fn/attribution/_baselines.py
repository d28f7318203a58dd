"""The straight path from the baselines to the inputs: where it starts (the baselines of the attributed inputs, as
integrated gradients, its delta and the perturbation methods take them), and the quadrature along it (captum's
exact nodes and weights, the path points at the nodes, and the weighted sum of gradients read there).

``riemann_*`` nodes are ``torch.linspace`` in the default float32 dtype, read back as
Python floats, and the weights ``1 / n`` (halved at both ends for the trapezoid), as in
captum 0.9. ``gausslegendre`` takes numpy's ``leggauss`` (numpy is a dependency of
tensordict) rescaled from ``[-1, 1]`` to ``[0, 1]``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from .._traced import trace_constant
from .._types import NestedKey
from ._engine import input_keys_of

__all__ = [
    "SUPPORTED_METHODS", "Baselines", "attributed_keys", "both_ends", "fold", "in_dtypes", "interpolation",
    "path_points", "path_starts", "quadrature", "starts_by_key", "wide",
]

Baselines = TensorDictBase | torch.Tensor | float


def attributed_keys(caller: str, f: Callable[..., Any], inputs: TensorDictBase,
                    input_keys: NestedKey | Sequence[NestedKey] | None) -> tuple[NestedKey, ...]:
    """The inputs the baselines replace: ``input_keys``, else every input ``f`` reads (one, or all positional)."""
    if input_keys is None and len(getattr(f, "keywords", {})) > 1:
        raise ValueError(
            f"{caller}: f passes {list(getattr(f, 'in_keys', ()))} as keyword arguments; say which of them the "
            "baselines replace with input_keys=[...] (e.g. input_keys=['input_ids']: the others, such as an "
            "attention mask, are then passed unchanged, as captum's additional_forward_args)")
    keys = input_keys_of(f, inputs, input_keys)
    if input_keys is None:
        return keys
    present = inputs.keys(True, True)
    missing = []
    for key in keys:  # (a loop, not a comprehension: one Python call less, on every compat call)
        if key not in present:
            missing.append(key)
    if missing:
        raise KeyError(f"{caller}: input_keys names {missing}, which the inputs do not hold; they hold "
                       f"{sorted(map(str, present))}")
    return keys


def path_starts(inputs: TensorDictBase, baselines: Baselines, keys: Sequence[NestedKey], caller: str) -> TensorDict:
    """The baseline of each of ``keys``, in the input's shape: from a TensorDict, a tensor or a number."""
    out = TensorDict({}, batch_size=inputs.batch_size)
    for key, b in starts_by_key(inputs, baselines, keys, caller).items():
        out.set(key, b)
    return out


def starts_by_key(inputs: TensorDictBase, baselines: Baselines, keys: Sequence[NestedKey],
                  caller: str) -> dict[NestedKey, torch.Tensor]:
    """`path_starts` as a dict by key (no TensorDict built: the perturbation methods read each key's)."""
    if isinstance(baselines, torch.Tensor) and len(keys) != 1:
        raise TypeError(f"{caller}: a tensor baseline fits one attributed input, but {len(keys)} are "
                        f"attributed {list(keys)}; pass baselines as a TensorDict with those keys, or a number")
    starts = {}
    for key in keys:  # (a loop, not a comprehension: one Python call less, on every call)
        starts[key] = _start(inputs.get(key), baselines, key, caller)
    return starts


def _start(x: torch.Tensor, baselines: Baselines, key: NestedKey, caller: str) -> torch.Tensor:
    """The baseline of the input ``x`` under ``key``, in its shape."""
    if isinstance(baselines, TensorDictBase):
        if key not in baselines.keys(True, True):
            raise KeyError(f"{caller}: no baseline for input {key!r}; give one, or name the inputs the baselines "
                           "replace with input_keys=[...]")
        b = baselines.get(key)
        if b.shape != x.shape:  # (one sample's, [1, ...], broadcasts, as a tensor baseline does)
            return _broadcast(caller, key, b, x)
        _check_kind(caller, key, b, x)
        return cast(torch.Tensor, b)
    if isinstance(baselines, torch.Tensor):
        return _broadcast(caller, key, baselines, x)
    if isinstance(baselines, (int, float)) and not isinstance(baselines, bool):
        if not (x.is_floating_point() or x.is_complex()) and not float(baselines).is_integer():
            raise ValueError(f"{caller}: input {key!r} is {x.dtype} (token ids) and the baseline "
                             f"{baselines!r} is not a whole number; give an id (a pad or mask token)")
        return torch.full_like(x, baselines)
    raise TypeError(f"{caller}: baselines must be a TensorDict, a tensor or a number, got "
                    f"{type(baselines).__name__}")


def both_ends(inputs: TensorDictBase, starts: TensorDictBase) -> TensorDictBase:
    """The path's start (the inputs, ``starts`` in place of theirs) and end in one batch ``[2, *B]``."""
    first = inputs.clone(False)
    first.update(starts)
    return cast(TensorDictBase, torch.stack([first, inputs]))


def _check_kind(caller: str, key: NestedKey, b: torch.Tensor, x: torch.Tensor) -> None:
    """A baseline of ids for ids, a floating-point one for floating-point inputs."""
    if (b.is_floating_point() or b.is_complex()) != (x.is_floating_point() or x.is_complex()):
        raise TypeError(f"{caller}: baselines is {b.dtype} for input {key!r}, which is {x.dtype} (token ids "
                        "take a baseline of ids, floating-point inputs a floating-point baseline)")


def _broadcast(caller: str, key: NestedKey, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A tensor baseline for input ``key``: its shape, or one that broadcasts to it (one sample's, ``[1, ...]``)."""
    _check_kind(caller, key, b, x)
    try:
        return b.to(x.dtype).expand(x.shape)
    except RuntimeError:
        raise ValueError(f"{caller}: baselines for input {key!r} have shape {list(b.shape)}, which does not "
                         f"broadcast to its shape {list(x.shape)}; give the input's shape, one sample's "
                         f"{list(x.shape[1:])} or a number") from None


# -- the quadrature along the path ----------------------------------------------------------------------

SUPPORTED_METHODS = ("riemann_left", "riemann_right", "riemann_middle", "riemann_trapezoid", "gausslegendre")


def _riemann(method: str, n: int) -> tuple[list[float], list[float]]:
    weights = [1 / n] * n
    if method == "riemann_trapezoid":
        weights[0] /= 2
        weights[-1] /= 2
        nodes = torch.linspace(0, 1, n)
    elif method == "riemann_left":
        nodes = torch.linspace(0, 1 - 1 / n, n)
    elif method == "riemann_middle":
        nodes = torch.linspace(1 / (2 * n), 1 - 1 / (2 * n), n)
    else:
        nodes = torch.linspace(1 / n, 1, n)
    return nodes.tolist(), weights


def _gauss_legendre(n: int) -> tuple[list[float], list[float]]:
    import numpy as np

    points, weights = np.polynomial.legendre.leggauss(n)
    return (0.5 * (1 + points)).tolist(), (0.5 * weights).tolist()


def quadrature(method: str, n_steps: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Nodes ``alphas`` in ``[0, 1]`` and weights ``steps`` of a quadrature rule.

    Args:
        method (str): one of `SUPPORTED_METHODS`.
        n_steps (int): number of nodes; at least 2 for the Riemann rules, 1 for
            ``gausslegendre``.

    Returns:
        tuple: ``(alphas, steps)``, each ``n_steps`` floats.

    Raises:
        ValueError: unknown method (the supported ones are listed) or too few steps.

    Examples:
        >>> quadrature("riemann_trapezoid", 3)
        ((0.0, 0.5, 1.0), (0.16666666666666666, 0.3333333333333333, 0.16666666666666666))
    """
    if not isinstance(method, str) or method not in SUPPORTED_METHODS:
        raise ValueError(f"unknown integration method {method!r}; supported: {list(SUPPORTED_METHODS)}")
    least = 1 if method == "gausslegendre" else 2
    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < least:
        raise ValueError(f"n_steps must be an int >= {least} for {method!r}, got {n_steps!r}")
    return _nodes(method, n_steps)


@trace_constant  # Dynamo cannot trace numpy's leggauss: the rule is a constant of the trace
def _nodes(method: str, n_steps: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    return _cached_nodes(method, n_steps)


@functools.lru_cache(maxsize=64)
def _cached_nodes(method: str, n_steps: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    nodes, weights = _gauss_legendre(n_steps) if method == "gausslegendre" else _riemann(method, n_steps)
    return tuple(nodes), tuple(weights)


def path_points(inputs: TensorDictBase, base: TensorDictBase, keys: Sequence[NestedKey],
                 alphas: Sequence[float]) -> TensorDict:
    """Inputs at the path points, batch ``[n, *B]``; other keys repeated."""
    n = len(alphas)
    points = TensorDict({}, batch_size=[n, *inputs.batch_size])
    for key, x in inputs.items(True, True):
        if key in keys:
            assert isinstance(x, torch.Tensor)  # (leaves)
            points.set(key, interpolation(base.get(key), x, alphas))
        else:
            points.set(key, x.expand(n, *x.shape))
    for key, value in inputs.non_tensor_items(True):  # a string or number kwarg the forward also takes
        points.set_non_tensor(key, value)
    return points


def interpolation(start: torch.Tensor, end: torch.Tensor, alphas: Sequence[float]) -> torch.Tensor:
    """``start + alpha * (end - start)`` for each of ``alphas`` (captum's order of operations), ``[n, *shape]``."""
    a = torch.tensor(alphas, dtype=end.dtype, device=end.device).reshape(len(alphas), *[1] * end.dim())
    return start + a * (end - start)


def fold(total: TensorDict | None, grads: TensorDict, weights: Sequence[float], lead: int) -> TensorDict:
    """``total + sum_k w_k * grads[k]``: the steps (dim ``lead`` of ``grads``) contracted with their weights."""
    # NOTE [weighted sums of the steps]
    # One contraction per chunk (a matrix-vector product over the steps), not one add per
    # step: on a small model 49 adds were half the call, and on a large one each add reads
    # the running sum again. Results for different ``chunk_size`` agree to a few ulps, not
    # bitwise: a chunk's gradients come from one forward and VJP over ``chunk * N`` points,
    # whose CPU kernels (MKL and oneDNN gemms) block differently for another batch size, and
    # the contraction's order depends on how many steps a chunk holds. captum multiplies
    # each step by its weight and reduces with ``torch.sum``, an order of its own, so the
    # two agree to an ulp or so in float32. In float64 captum also rounds the weights to
    # float32; ours keep the input's dtype. Half-precision gradients (bf16, fp16) are summed
    # in float32 (measured in bf16 at 300 steps, summed in their own dtype: 13% relative
    # error, captum 0.3%); `integrated_gradients` casts the sum back at the end.
    batch = grads.batch_size
    out = TensorDict({}, batch_size=[*batch[:lead], *batch[lead + 1:]])
    for key, g in grads.items(True, True):
        assert isinstance(g, torch.Tensor)
        if g.dtype in (torch.float16, torch.bfloat16):  # (`wide`, inline: no call per key on every call)
            g = g.float()
        w = torch.tensor(weights, dtype=g.dtype, device=g.device)
        summed = torch.tensordot(w, g, dims=([0], [lead]))
        out.set(key, summed if total is None else total.get(key) + summed)
    return out


def in_dtypes(total: TensorDict, dtypes: Mapping[Any, torch.dtype]) -> TensorDict:
    """``total`` (summed in float32 where the gradients were half precision) back in the gradients' dtypes."""
    for key, dtype in dtypes.items():  # (a loop, not `all` of a generator: no Python call per key)
        if total.get(key).dtype != dtype:
            break
    else:
        return total
    out = total.clone(False)
    for key, dtype in dtypes.items():
        out.set(key, total.get(key).to(dtype))
    return out


def wide(t: torch.Tensor) -> torch.Tensor:
    """Half-precision floats in float32 (the sum of the steps is kept there too); others as they are."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
