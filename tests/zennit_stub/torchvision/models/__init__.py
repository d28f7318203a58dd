"""The stub's ``torchvision.models``: only ``resnet``."""

from . import resnet

__all__ = ["resnet"]
