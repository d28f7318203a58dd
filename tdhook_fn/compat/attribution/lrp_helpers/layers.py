"""``tdhook.attribution.lrp_helpers.layers``: layers that LRP composites know."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Sum"]


class Sum(nn.Module):
    """``torch.sum(input, dim)`` as a module, so that a composite can give it a rule.

    Args:
        dim (int): the dimension summed over. Default: ``-1``.
    """

    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.sum(input, dim=self.dim)
