"""Max pooling with the indices of its maxima, as the walks of LRP and DeepLift run it (no graph)."""

# NOTE [max pooling in channels-last]
# The walks need each window's maximum and where it came from (its gradient goes there).
# On the CPU, torch's kernel for that on a batch of 2-d planes in the default layout is
# slow on small planes: 0.73 ms on the benchmarks' CNN ([64, 8, 8, 8], 2x2), more than the
# two convolutions around it; the same kernel on a channels-last copy takes 0.25 ms with
# the copy. Its maxima are the same numbers and its indices the same positions (flat in
# each channel's plane; the first maximum of a window on ties, and NaN as autograd's
# kernel takes it: tests compare both kernels on ties and NaNs), so the walk runs it
# there and hands on a result in the default layout (the next module computes as on
# the general path), where the shadows' max pooling would (`faster_in_channels_last`:
# planes of four channels or more, 2^15 elements or more, in the default layout,
# NOTE [shadow max pooling]).
# Other pools (1-d, 3-d) keep the plain kernel.

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..._pool_layout import channels_last_max_pool, faster_in_channels_last

__all__ = ["MAX_POOLS", "max_pool_with_indices", "to_maxima"]

# torch's max pooling modules the walks run by their op: (dims of a plane, the op)
MAX_POOLS: dict[type[nn.Module], tuple[int, Callable[..., Any]]] = {
    nn.MaxPool1d: (1, F.max_pool1d), nn.MaxPool2d: (2, F.max_pool2d), nn.MaxPool3d: (3, F.max_pool3d)}


def max_pool_with_indices(pool: tuple[int, Callable[..., Any]], x: torch.Tensor, state: dict[str, Any],
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The maxima and their indices of the pool ``pool`` (an entry of `MAX_POOLS`: the dims of a plane, the op)
    with the module's settings ``state``."""
    dims, op = pool
    settings = (state["kernel_size"], state["stride"], state["padding"], state["dilation"])
    if dims == 2 and faster_in_channels_last(x):
        return channels_last_max_pool(x, *settings, state["ceil_mode"])
    out, indices = op(x, *settings, ceil_mode=state["ceil_mode"], return_indices=True)
    return out, indices


def to_maxima(values: torch.Tensor, shape: torch.Size, indices: torch.Tensor, dims: int) -> torch.Tensor:
    """``values`` (shaped as the pool's output) added where each window's maximum came from, in an input of
    ``shape``: the pool's adjoint (``indices`` flat within a plane of ``dims`` dims, as `max_pool_with_indices`)."""
    plane = values.new_zeros(shape).flatten(-dims)
    return plane.scatter_add_(-1, indices.flatten(-dims), values.flatten(-dims)).view(shape)
