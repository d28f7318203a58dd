"""Checking and promoting the two representations a similarity statistic compares."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._broadcast_einsum import broadcast


def as_float_pair(name: str, x: Tensor, y: Tensor, *, min_samples: int) -> tuple[Tensor, Tensor]:
    """``x`` and ``y`` as one floating dtype, after checking they can be compared.

    Both are ``(..., N, D)`` with the same ``N``; their leading dims must broadcast.
    Integer and bool inputs become the default float dtype; float64 stays float64.
    """
    for arg, t in (("x", x), ("y", y)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor of shape (N, D) or (..., N, D), "
                            f"got {type(t).__name__}")
        if t.is_complex():
            raise TypeError(f"{name}: {arg} is complex ({t.dtype}); pass real activations (e.g. {arg}.abs())")
    if x.ndim < 2 or y.ndim < 2:
        raise ValueError(f"{name}: x and y must have shape (N, D) or (..., N, D), got {tuple(x.shape)} and "
                         f"{tuple(y.shape)}; add a feature dim with .unsqueeze(-1)")
    if x.shape[-2] != y.shape[-2]:
        raise ValueError(f"{name}: x and y need matching sample counts (dim -2), got {x.shape[-2]} and "
                         f"{y.shape[-2]}; row i of both must be the same input")
    try:
        batch_shape(x, y)
    except RuntimeError:
        raise ValueError(f"{name}: the leading (batch) dims of x {tuple(x.shape[:-2])} and y "
                         f"{tuple(y.shape[:-2])} do not broadcast; for all pairs use x[:, None] and y[None, :]"
                         ) from None
    if x.device != y.device:
        raise ValueError(f"{name}: x and y must be on the same device, got {x.device} and {y.device}")
    if x.shape[-2] < min_samples:
        raise ValueError(f"{name}: needs at least {min_samples} samples (dim -2 of x and y), got {x.shape[-2]}")
    dtype = torch.promote_types(x.dtype, y.dtype)
    if not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    return x.to(dtype), y.to(dtype)


def sample_range(name: str, arg: str, t: Tensor) -> Tensor:
    """``(..., 2, D)``: the least and the largest value of each feature over the samples.

    One pass over ``t`` that also refuses NaN and inf (they propagate to the extremes).
    """
    extremes = torch.stack([t.amin(-2), t.amax(-2)], dim=-2)  # aminmax over dim -2 is 20x slower (torch 2.13)
    if values_visible(t) and not bool(torch.isfinite(extremes).all()):
        raise ValueError(f"{name}: {arg} holds NaN or inf; the statistic would be NaN or meaningless")
    return extremes


def batch_shape(x: Tensor, y: Tensor) -> torch.Size:
    """The broadcast of the leading dims of ``x`` and ``y`` (both ``(..., N, D)``)."""
    return broadcast(x.shape[:-2], y.shape[:-2])


def values_visible(t: Tensor) -> bool:
    """Whether Python may branch on the values of ``t`` (not under ``vmap`` nor ``torch.compile``)."""
    if torch.compiler.is_compiling():
        return False
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t):
            return False
        t = functorch.get_unwrapped(t)
    return True


def first_true(mask: Tensor) -> tuple[int, ...] | None:
    """The index of the first ``True`` in ``mask``, or ``None`` (only where `values_visible`)."""
    if not values_visible(mask) or not bool(mask.any()):
        return None
    flat = int(torch.nonzero(mask.reshape(-1))[0, 0])
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), mask.shape))


def for_both(fn: Callable[[str, Tensor], Tensor], x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """``fn("x", x)`` and ``fn("y", y)`` for ``(..., N, D)`` inputs, ``fn`` keeping the batch dims.

    ``fn`` runs once when ``y`` is ``x`` with size-1 batch dims moved (``acts[:, None]``
    and ``acts[None, :]``, the all-pairs call): the same tensor seen twice.
    """
    fx = fn("x", x)
    if same_values(x, y):
        return fx, fx.reshape(y.shape[:-2] + fx.shape[x.ndim - 2:])
    return fx, fn("y", y)


def same_values(x: Tensor, y: Tensor, core: int = 2) -> bool:
    """Whether ``y`` is ``x`` (a view of the same memory) with only size-1 batch dims added or moved (the batch
    dims are those before the last ``core``)."""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if torch.compiler.is_compiling() or wrapped(x) or wrapped(y):
        return False  # no storage to compare under torch.func transforms
    if x.dtype != y.dtype or x.device != y.device:
        return False
    if x.data_ptr() != y.data_ptr() or x.shape[-core:] != y.shape[-core:]:
        return False
    layout_x = [(n, st) for n, st in zip(x.shape, x.stride(), strict=True) if n != 1]
    layout_y = [(n, st) for n, st in zip(y.shape, y.stride(), strict=True) if n != 1]
    return layout_x == layout_y
