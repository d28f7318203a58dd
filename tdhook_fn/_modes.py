"""Training-mode modules that make an attribution depend on the batch or on chance.

# NOTE [training mode in attributions]
:func:`tdhook_fn.call` runs a model in whatever mode it is in (its buffers are private
copies for the call, NOTE [pure buffers]). An attribution is
different: its forward sees a batch the user never built (integrated gradients pushes
``n_steps`` path points through at once, ``per_target`` and ``vmap`` reshape it), so

- a batch norm in training mode normalises with the statistics of that batch (of the
  path points, for integrated gradients): the number is wrong, so the methods raise and
  say to call ``model.eval()``;
- dropout in training mode makes two identical calls differ: the methods warn, once per
  module.
"""

from __future__ import annotations

import warnings
import weakref

from torch import nn

__all__ = ["check_attribution_modes"]

_warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _is_stochastic(module: nn.Module) -> bool:
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p > 0
    # transformers' attention modules call functional dropout with a float attribute
    return any(
        isinstance(v, float) and v > 0 and "dropout" in k for k, v in vars(module).items() if not k.startswith("_")
    )


def check_attribution_modes(model: nn.Module, method: str) -> None:
    """Raise for batch-dependent training-mode modules, warn once for stochastic ones.

    Raises:
        ValueError: a batch norm is in training mode; the message names the modules.
    """
    batch_dependent, stochastic = [], []
    for name, module in model.named_modules():
        if not module.training:
            continue
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            batch_dependent.append(name or "<root>")
        elif _is_stochastic(module) and module not in _warned:
            stochastic.append(name or "<root>")
            _warned.add(module)
    if batch_dependent:
        raise ValueError(
            f"{method}: modules {batch_dependent} are batch norms in training mode, which normalise with the "
            "statistics of the batch; an attribution's batch holds path points and reshaped samples, so the result "
            "would be wrong. Call model.eval() first"
        )
    if stochastic:
        warnings.warn(
            f"{method}: modules {stochastic} apply dropout in training mode, so two identical calls give different "
            "attributions; call model.eval() for deterministic results",
            RuntimeWarning,
            stacklevel=3,
        )
