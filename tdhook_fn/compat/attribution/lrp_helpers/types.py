"""``tdhook.attribution.lrp_helpers.types``: groups of ``torch.nn`` classes for ``isinstance``.

``isinstance(module, Convolution)`` is true for any ``nn.Conv*d`` or ``nn.ConvTranspose*d``
(each group's metaclass checks membership in its ``__subclass__`` tuple).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from torch import nn

from tdhook_fn.attribution._lrp.composites import (
    ACTIVATIONS,
    AVG_POOLS,
    BATCH_NORMS,
    CONVOLUTIONS,
    MAX_POOLS,
    TRANSPOSED_CONVOLUTIONS,
)

__all__ = [
    "Activation",
    "AvgPool",
    "BatchNorm",
    "Convolution",
    "ConvolutionStandard",
    "ConvolutionTranspose",
    "Linear",
    "MaxPool",
    "SubclassMeta",
]


class SubclassMeta(type):
    """A metaclass making ``isinstance(x, Group)`` mean "``type(x)`` is in ``Group.__subclass__``"."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return cls.__subclasscheck__(type(instance))

    def __subclasscheck__(cls, subclass: Any) -> bool:
        members: tuple[type, ...] = cls.__dict__.get("__subclass__", ())
        return type.__subclasscheck__(cls, subclass) or issubclass(subclass, members)


def _frozen_batch_norm() -> tuple[type, ...]:
    if importlib.util.find_spec("torchvision") is None:
        return ()
    return (importlib.import_module("torchvision.ops").FrozenBatchNorm2d,)


def _group(name: str, members: tuple[type, ...], doc: str) -> SubclassMeta:
    """A class ``name`` for which ``isinstance(x, it)`` means "``type(x)`` is in ``members``" (or their groups)."""
    return SubclassMeta(name, (), {"__subclass__": members, "__doc__": doc})


ConvolutionTranspose = _group("ConvolutionTranspose", TRANSPOSED_CONVOLUTIONS, "``nn.ConvTranspose1d``, 2d, 3d.")
ConvolutionStandard = _group("ConvolutionStandard", CONVOLUTIONS, "``nn.Conv1d``, 2d, 3d.")
Convolution = _group("Convolution", (ConvolutionStandard, ConvolutionTranspose), "Every convolution.")
Linear = _group("Linear", (Convolution, nn.Linear), "``nn.Linear`` and every convolution.")
BatchNorm = _group("BatchNorm", (*BATCH_NORMS, *_frozen_batch_norm()),
                   "``nn.BatchNorm1d``, ``2d``, ``3d`` (and torchvision's ``FrozenBatchNorm2d``).")
AvgPool = _group("AvgPool", AVG_POOLS, "Average pooling, plain and adaptive, 1d to 3d.")
MaxPool = _group("MaxPool", MAX_POOLS, "Max pooling, plain and adaptive, 1d to 3d.")
Activation = _group("Activation", ACTIVATIONS, "The elementwise activations of ``torch.nn`` (ReLU, Tanh, GELU, ...).")
