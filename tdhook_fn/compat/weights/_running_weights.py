"""The weights a context's module runs a submodule with: what tdhook's contexts read from the module."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

from tdhook_fn import params as params_of
from tdhook_fn.compat.modules import RoutedModule

__all__ = ["running_weights"]


def running_weights(routed: Any, target: nn.Module, *, detach: bool) -> TensorDictBase:
    """``target``'s tensors as the calls of ``routed`` (a context's `RoutedModule`) run them now: over another
    context's hooked module, pruned, or a block's applied vectors (tdhook edits the model, then reads it).

    A tensor nothing replaces is the model's own (``detach``: detached); a replaced one, its value, detached.
    """
    if isinstance(routed, RoutedModule):
        for name, module in routed.model.named_modules():
            if module is target:
                with torch.no_grad():  # (a replaced value is computed outside any graph)
                    weights = routed.params(detach=detach)
                return weights.get(tuple(name.split("."))) if name else weights
    return params_of(target, detach=detach)  # (a module that runs the model's own tensors)
