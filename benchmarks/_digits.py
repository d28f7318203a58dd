"""The small CNN on scikit-learn's digits that the perturbation, surrogate and metric benchmarks share."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn


def cnn() -> nn.Sequential:
    """Conv 8 (3x3) -> ReLU -> max pool 2 -> linear 128 -> 10, seeded 0, in eval mode."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(128, 10)).eval()


def digits(n: int) -> torch.Tensor:
    """The first ``n`` 8x8 digits, ``[n, 1, 8, 8]`` float32 in ``[0, 1]``."""
    return torch.as_tensor(load_digits().data[:n] / 16.0, dtype=torch.float32).reshape(n, 1, 8, 8)


class _PoolPlanes(torch.autograd.Function):
    """Max pooling by the channels-last kernel, differentiated by the plain kernel's backward (its indices)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, pool: _ChannelsLastMaxPool) -> torch.Tensor:
        y, where = F.max_pool2d(x.contiguous(memory_format=torch.channels_last), pool.kernel_size, pool.stride,
                                pool.padding, pool.dilation, pool.ceil_mode, return_indices=True)
        where = where.contiguous()
        ctx.save_for_backward(x, where)
        ctx.settings = pool.settings
        return y.contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, where = ctx.saved_tensors
        return _POOL_BACKWARD(grad, x, *ctx.settings, where), None


_POOL_BACKWARD = torch.ops.aten.max_pool2d_with_indices_backward.default


class _ChannelsLastMaxPool(nn.MaxPool2d):
    """Max pooling on a channels-last copy of an input in the default layout: the same maxima, and on the CPU
    faster for planes of several channels; where autograd differentiates it, its gradient comes back in the
    default layout, by the plain kernel's backward (a channels-last gradient makes the convolutions' backward
    below slower)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        pair = nn.modules.utils._pair  # (the backward's settings, made once)
        self.settings = (pair(self.kernel_size), pair(self.stride), pair(self.padding), pair(self.dilation),
                         self.ceil_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not faster_in_channels_last(x):
            return super().forward(x)
        if x.requires_grad and torch.is_grad_enabled():
            return _PoolPlanes.apply(x, self)  # type: ignore[no-any-return]
        return super().forward(x.contiguous(memory_format=torch.channels_last)).contiguous()


def faster_in_channels_last(x: torch.Tensor) -> bool:
    """Whether max pooling ``x`` on a channels-last copy is the faster on the CPU: not channels-last already, and
    enough channels and elements that the kernel saves more than the copies cost (the rule ours follows)."""
    return x.is_contiguous() and x.shape[1] >= 4 and x.numel() >= 1 << 15


def max_pool_with_indices(layer: nn.MaxPool2d, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer``'s maxima of ``h`` and their indices, in the default layout; on a channels-last copy where that is
    the faster (the walk floors' pooling)."""
    x = h.contiguous(memory_format=torch.channels_last) if faster_in_channels_last(h) else h
    y, where = F.max_pool2d(x, layer.kernel_size, layer.stride, layer.padding, layer.dilation, layer.ceil_mode,
                            return_indices=True)
    return y.contiguous(), where.contiguous()


def fastest_pooling(net: nn.Sequential) -> nn.Sequential:
    """``net`` (sharing its modules) with its max pooling on channels-last copies.

    The CNN a capable engineer runs on the CPU, forward only or differentiated by autograd,
    and what tdhook_fn runs there (NOTE [shadow max pooling]): the floors of the methods
    that run it run this. Build it before the timing.
    """
    return nn.Sequential(*(
        _ChannelsLastMaxPool(m.kernel_size, m.stride, m.padding, m.dilation, ceil_mode=m.ceil_mode)
        if type(m) is nn.MaxPool2d else m for m in net)).eval()
