"""Type aliases the modules share."""

from __future__ import annotations

from collections.abc import Callable

from tensordict import TensorDictBase

__all__ = ["PureFn"]

PureFn = Callable[[TensorDictBase, TensorDictBase], TensorDictBase]  # f(params, td) -> td
