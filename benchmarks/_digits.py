"""The small CNN on scikit-learn's digits that the perturbation, surrogate and metric benchmarks share."""

from __future__ import annotations

import torch
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


class _ChannelsLastMaxPool(nn.MaxPool2d):
    """Max pooling on a channels-last copy of its input: the same maxima, and on the CPU faster for small planes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.contiguous(memory_format=torch.channels_last)).contiguous()


def fastest_forward(net: nn.Sequential) -> nn.Sequential:
    """``net`` (sharing its modules) with its max pooling on channels-last copies.

    The forward a capable engineer writes for a CNN on the CPU when only the outputs are
    needed, and what tdhook_fn runs there (NOTE [shadow max pooling]): the floors of the
    forward-only methods run it. Build it before the timing.
    """
    return nn.Sequential(*(
        _ChannelsLastMaxPool(m.kernel_size, m.stride, m.padding, m.dilation, ceil_mode=m.ceil_mode)
        if type(m) is nn.MaxPool2d else m for m in net)).eval()
