"""The small CNN on scikit-learn's digits that the perturbation, surrogate and metric benchmarks share."""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits
from torch import nn


def cnn() -> nn.Module:
    """Conv 8 (3x3) -> ReLU -> max pool 2 -> linear 128 -> 10, seeded 0, in eval mode."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(128, 10)).eval()


def digits(n: int) -> torch.Tensor:
    """The first ``n`` 8x8 digits, ``[n, 1, 8, 8]`` float32 in ``[0, 1]``."""
    return torch.as_tensor(load_digits().data[:n] / 16.0, dtype=torch.float32).reshape(n, 1, 8, 8)
