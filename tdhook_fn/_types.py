"""Type aliases the modules share."""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import TensorDictBase

__all__ = ["GradFn", "NestedKey", "Pullback", "PureFn", "Replace"]

NestedKey = str | tuple[str, ...]  # an entry of a TensorDict: one name, or the names down its levels
PureFn = Callable[[TensorDictBase, TensorDictBase], TensorDictBase]  # f(params, td) -> td
Pullback = Callable[[torch.Tensor], torch.Tensor]  # a cotangent (a relevance) at a map's output -> at its input
Replace = Callable[[torch.Tensor], torch.Tensor]  # a tensor's new value from its value (an activation, a parameter)
GradFn = Callable[[torch.Tensor], torch.Tensor]  # a gradient at a module -> the gradient sent on (`map_grad`)
