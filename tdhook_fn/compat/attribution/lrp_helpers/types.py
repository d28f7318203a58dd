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

    __subclass__ = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


class ConvolutionStandard(metaclass=SubclassMeta):
    """``nn.Conv1d``, ``2d``, ``3d``."""

    __subclass__ = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


class Convolution(metaclass=SubclassMeta):
    """Every convolution, standard or transposed."""

    __subclass__ = (ConvolutionStandard, ConvolutionTranspose)


class Linear(metaclass=SubclassMeta):
    """``nn.Linear`` and every convolution."""

    __subclass__ = (Convolution, nn.Linear)


class BatchNorm(metaclass=SubclassMeta):
    """``nn.BatchNorm1d``, ``2d``, ``3d`` (and torchvision's ``FrozenBatchNorm2d``)."""

    __subclass__ = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, *_frozen_batch_norm())


class AvgPool(metaclass=SubclassMeta):
    """Average pooling, plain and adaptive, 1d to 3d."""

    __subclass__ = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
                    nn.AdaptiveAvgPool3d)


class MaxPool(metaclass=SubclassMeta):
    """Max pooling, plain and adaptive, 1d to 3d."""

    __subclass__ = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
                    nn.AdaptiveMaxPool3d)


class Activation(metaclass=SubclassMeta):
    """The elementwise activations of ``torch.nn`` (ReLU, Tanh, GELU, ...)."""

    __subclass__ = (
        nn.ELU, nn.Hardshrink, nn.Hardsigmoid, nn.Hardtanh, nn.Hardswish, nn.LeakyReLU, nn.LogSigmoid, nn.PReLU,
        nn.ReLU, nn.ReLU6, nn.RReLU, nn.SELU, nn.CELU, nn.GELU, nn.Sigmoid, nn.SiLU, nn.Softplus, nn.Softshrink,
        nn.Softsign, nn.Tanh, nn.Tanhshrink, nn.Threshold,
    )
