"""Type aliases the modules share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tensordict import TensorDictBase

__all__ = ["Keys", "PureFn"]

PureFn = Callable[[TensorDictBase, TensorDictBase], TensorDictBase]  # f(params, td) -> td
Keys = list[Any]  # tdhook's in_keys and out_keys: lists of (nested) keys, as its signatures take them
