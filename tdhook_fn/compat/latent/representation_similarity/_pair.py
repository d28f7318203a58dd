"""Reading the two representations an estimator compares, with tdhook's checks and empty batches."""

from __future__ import annotations

from textwrap import indent
from typing import ClassVar

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase


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


class PairEstimator(TensorDictModuleBase):
    """Reads ``td[in_key_a]`` and ``td[in_key_b]``, writes one value per batch entry at each out key.

    A subclass names itself in errors (``_what``), lists the keys it writes (`_targets`),
    computes them in `_estimate` and adds its options to the repr (`_options`).
    """

    _what: ClassVar[str]

    def __init__(self, in_key_a: str, in_key_b: str, out_keys: list[str]) -> None:
        super().__init__()
        self.in_key_a, self.in_key_b = in_key_a, in_key_b
        self.in_keys = [in_key_a, in_key_b]
        self.out_keys = [*out_keys]

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        """Write the estimates of ``td[in_key_a]`` and ``td[in_key_b]`` at the out keys.

        Args:
            td (TensorDictBase): holds both representations; it is written in place.

        Returns:
            TensorDictBase: ``td``.
        """
        x, y = read_pair(td, self.in_key_a, self.in_key_b, self._what)
        targets = self._targets()
        values = [empty_result(x) for _ in targets] if x.shape[:-2].numel() == 0 else self._estimate(x, y)
        for key, value in zip(targets, values, strict=True):
            td[key] = value
        return td

    def _targets(self) -> list[str]:
        """The keys written, in the order of `_estimate`'s values."""
        raise NotImplementedError

    def _estimate(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        """The values at `_targets` for ``x`` and ``y``, ``(..., N, D)`` each with a non-empty batch."""
        raise NotImplementedError

    def _options(self) -> str:
        """The repr's lines after the keys, each led by ``",\\n"``."""
        return ""

    def __repr__(self) -> str:
        fields = f"in_keys={self.in_keys},\nout_keys={self.out_keys}{self._options()}"
        return f"{type(self).__name__}(\n{indent(fields, 4 * ' ')})"
