"""Reading the two representations an estimator compares, with tdhook's checks and empty batches."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase


def read_pair(td: TensorDictBase, key_a: str, key_b: str, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``td[key_a]`` and ``td[key_b]``; their batch shapes must be equal (tdhook does not broadcast)."""
    x, y = td[key_a], td[key_b]
    if x.ndim < 2 or y.ndim < 2:
        raise ValueError(f"{what} expects tensors with shape (N, D) or (..., N, D), got {tuple(x.shape)} "
                         f"({key_a!r}) and {tuple(y.shape)} ({key_b!r})")
    if x.shape[:-2] != y.shape[:-2]:
        raise ValueError(f"{what}: expected matching batch shapes, got {tuple(x.shape[:-2])} ({key_a!r}) and "
                         f"{tuple(y.shape[:-2])} ({key_b!r}); for broadcasting call tdhook_fn.latent.similarity")
    return x, y


def empty_result(x: torch.Tensor) -> torch.Tensor:
    """tdhook's result for a batch with no entries: float32 of the batch shape."""
    return torch.empty(x.shape[:-2], dtype=torch.float32, device=x.device)
