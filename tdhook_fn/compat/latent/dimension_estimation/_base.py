"""What tdhook 0.1.3's four estimators share: reading the points, ``k``, and their repr."""

from __future__ import annotations

from textwrap import indent
from typing import Literal

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

__all__ = ["Estimator", "K", "check_k", "resolve_k"]

K = int | Literal["auto"]


def check_k(k: object, least: int, message: str) -> None:
    """tdhook's checks of ``k`` when an estimator is built, with its messages."""
    if k != "auto":
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError("k must be an int or 'auto'")
        if k < least:
            raise ValueError(message)


def resolve_k(k: K, n: int) -> int:
    """``"auto"``: ``sqrt(N)``, at least 2 and at most ``(N - 1) // 2`` (tdhook's rule)."""
    if k == "auto":
        return max(2, min(int(n**0.5), (n - 1) // 2))
    return k


class Estimator(TensorDictModuleBase):
    """Reads ``td[in_key]`` ``(..., N, D)`` and writes ``td[out_key]``."""

    def __init__(self, in_key: str, out_key: str, eps: float, out_keys: list[str] | None = None) -> None:
        super().__init__()
        self.in_key = in_key
        self.out_key = out_key
        self.eps = eps
        self.in_keys = [in_key]
        self.out_keys = list(out_keys if out_keys is not None else [out_key])

    def points(self, td: TensorDictBase) -> torch.Tensor:
        data: torch.Tensor = td[self.in_key]
        return data

    def _fields(self) -> str:
        return f"in_keys={self.in_keys},\nout_keys={self.out_keys}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(\n{indent(self._fields(), 4 * ' ')})"

