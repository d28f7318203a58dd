"""What tdhook 0.1.3's four estimators share: reading the points, ``k``, and their repr."""

from __future__ import annotations

from textwrap import indent
from typing import ClassVar, Literal

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

__all__ = ["Estimator", "K", "KEstimator", "check_k", "resolve_k"]

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

    def _options(self) -> str:
        """The repr's lines between the keys and ``eps``, each led by ``",\\n"``."""
        return ""

    def __repr__(self) -> str:
        fields = f"in_keys={self.in_keys},\nout_keys={self.out_keys}{self._options()},\neps={self.eps}"
        return f"{type(self).__name__}(\n{indent(fields, 4 * ' ')})"


class KEstimator(Estimator):
    """A per-point estimator over ``k`` neighbours: ``k`` checked when built, resolved per call.

    A subclass names the method, the least ``k`` with tdhook's message, and the points a
    cloud needs (``_per_k * k + _extra``), and computes in `_estimate`.
    """

    _method: ClassVar[str]
    _least_k: ClassVar[int] = 1
    _least_k_message: ClassVar[str] = "k must be at least 1"
    _per_k: ClassVar[int] = 1
    _extra: ClassVar[int]

    def __init__(self, k: K = "auto", in_key: str = "data", out_key: str = "dimension", eps: float = 1e-5) -> None:
        super().__init__(in_key, out_key, eps)
        check_k(k, self._least_k, self._least_k_message)
        self.k = k

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        data = self.points(td)
        n = data.shape[-2]
        k = resolve_k(self.k, n)
        if n < self._per_k * k + self._extra:
            rule = f"{self._per_k if self._per_k != 1 else ''}k+{self._extra}"
            raise ValueError(f"At least {rule} points required for {self._method} (k={k}), got {n}")
        td[self.out_key] = self._estimate(data, k)
        return td

    def _estimate(self, data: torch.Tensor, k: int) -> torch.Tensor:
        """The dimensions of ``data`` ``(..., N, D)`` with ``k`` resolved, ``(..., N)``."""
        raise NotImplementedError

    def _options(self) -> str:
        return f",\nk={self.k}"
