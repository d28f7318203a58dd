"""The two ResNet block classes zennit's canonizers test for with ``isinstance`` (never built here)."""

from torch import nn


class BasicBlock(nn.Module):
    """Stands for torchvision's block class; no model here is one."""


class Bottleneck(nn.Module):
    """Stands for torchvision's block class; no model here is one."""
