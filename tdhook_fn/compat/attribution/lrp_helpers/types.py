"""``tdhook.attribution.lrp_helpers.types``: groups of ``torch.nn`` classes for ``isinstance``.

``isinstance(module, Convolution)`` is true for any ``nn.Conv*d`` or ``nn.ConvTranspose*d``:
each group is a class whose metaclass checks membership in its ``__subclass__`` tuple
(which may hold other groups). ``BatchNorm`` includes torchvision's ``FrozenBatchNorm2d``
when torchvision is installed.
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


class ConvolutionTranspose(metaclass=SubclassMeta):
    """``nn.ConvTranspose1d``, ``2d``, ``3d``."""

    __subclass__ = TRANSPOSED_CONVOLUTIONS


class ConvolutionStandard(metaclass=SubclassMeta):
    """``nn.Conv1d``, ``2d``, ``3d``."""

    __subclass__ = CONVOLUTIONS


class Convolution(metaclass=SubclassMeta):
    """Every convolution, standard or transposed."""

    __subclass__ = (ConvolutionStandard, ConvolutionTranspose)


class Linear(metaclass=SubclassMeta):
    """``nn.Linear`` and every convolution."""

    __subclass__ = (Convolution, nn.Linear)


class BatchNorm(metaclass=SubclassMeta):
    """``nn.BatchNorm1d``, ``2d``, ``3d`` (and torchvision's ``FrozenBatchNorm2d``)."""

    __subclass__ = (*BATCH_NORMS, *_frozen_batch_norm())


class AvgPool(metaclass=SubclassMeta):
    """Average pooling, plain and adaptive, 1d to 3d."""

    __subclass__ = AVG_POOLS


class MaxPool(metaclass=SubclassMeta):
    """Max pooling, plain and adaptive, 1d to 3d."""

    __subclass__ = MAX_POOLS


class Activation(metaclass=SubclassMeta):
    """The elementwise activations of ``torch.nn`` (ReLU, Tanh, GELU, ...)."""

    __subclass__ = ACTIVATIONS
