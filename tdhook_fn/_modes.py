"""Training-mode modules that make an attribution depend on the batch or on chance."""

# NOTE [training mode in attributions]
# `tdhook_fn.call` runs a model in whatever mode it is in (its buffers are private
# copies for the call, NOTE [pure buffers]). An attribution is
# different: its forward sees a batch the user never built (integrated gradients pushes
# ``n_steps`` path points through at once, ``per_target`` and ``vmap`` reshape it), so
#
# - a batch norm in training mode (or without running statistics) normalises with the
#   statistics of that batch (of the path points, for integrated gradients): the number is
#   wrong, so the methods raise and say to call ``model.eval()``;
# - dropout in training mode makes two identical calls differ: the methods warn, once per
#   module.

from __future__ import annotations

import warnings
import weakref
from typing import Literal

from torch import nn

__all__ = ["check_attribution_modes"]

_warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def check_attribution_modes(model: nn.Module, caller: str, *, batch_norms: bool = True,
                            dropout: Literal["warn", "raise"] = "warn", why: str = "") -> None:
    """Raise for batch-dependent batch norms, warn once (or raise) for modules that draw at random.

    Args:
        batch_norms: refuse batch norms that use the batch's statistics (training mode,
            or ``track_running_stats=False``); off where the batch is the caller's own.
        dropout: ``"raise"`` where random draws cannot run (under ``vmap``); ``why`` says why.

    Raises:
        ValueError: such a batch norm, or dropout with ``dropout="raise"``; the message
            names the modules.
    """
    # One plain walk of the module tree with the tests inline, names built only for a module to report: this
    # runs on every call, and a call per module (or an any() of a generator: a call per step) costs more than it.
    batch_dependent: set[int] = set()
    drawing: list[nn.Module] = []
    stack, seen = [model], set()
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if batch_norms and isinstance(module, nn.modules.batchnorm._BatchNorm):
            if module.training or module.running_mean is None:  # normalises with the batch's statistics
                batch_dependent.add(id(module))
        elif module.training and (dropout == "raise" or module not in _warned):
            if isinstance(module, nn.modules.dropout._DropoutNd):
                draws = module.p > 0
            else:  # transformers' attention modules call functional dropout with a float attribute
                draws = False
                for k, v in vars(module).items():
                    if isinstance(v, float) and v > 0 and "dropout" in k and not k.startswith("_"):
                        draws = True
                        break
            if draws:
                drawing.append(module)
        for child in module._modules.values():
            if child is not None:
                stack.append(child)
    if batch_dependent:
        names = [name or "<root>" for name, module in model.named_modules() if id(module) in batch_dependent]
        raise ValueError(
            f"{caller}: modules {names} are batch norms that normalise with the statistics of the batch "
            "(training mode, or track_running_stats=False); the batch this method runs holds path points, runs or "
            "reshaped samples, so the result would be wrong. Call model.eval() first (with running statistics)"
        )
    if not drawing:
        return
    draw = set(map(id, drawing))
    stochastic = [name or "<root>" for name, module in model.named_modules() if id(module) in draw]
    if dropout == "raise":
        raise ValueError(f"{caller}: modules {stochastic} apply dropout in training mode{why}; call model.eval()")
    _warned.update(drawing)
    warnings.warn(
        f"{caller}: modules {stochastic} apply dropout in training mode, so two identical calls give different "
        "results; call model.eval() for deterministic results",
        RuntimeWarning,
        stacklevel=3,
    )
