"""The stub's ``torchvision.ops``: only ``FrozenBatchNorm2d``, for isinstance checks."""

from torch import nn


class FrozenBatchNorm2d(nn.Module):
    """Stands for torchvision's class; no model here holds one."""
