"""Two-class probabilities from decision values, as tdhook's ``predict_proba`` gives them."""

from __future__ import annotations

import torch

__all__ = ["two_class_proba"]


def two_class_proba(scores: torch.Tensor) -> torch.Tensor:
    """``(..., 2)``: the probabilities of the negative and the positive class, ``1 - s`` and ``s = sigmoid(scores)``.

    Args:
        scores (Tensor): decision values ``(...)``, positive on the positive side.

    Returns:
        Tensor: ``(..., 2)``, each row summing to 1; ``[0.5, 0.5]`` where the score is 0.

    Examples:
        >>> import torch
        >>> two_class_proba(torch.tensor([0.0, 100.0]))
        tensor([[0.5000, 0.5000],
                [0.0000, 1.0000]])
    """
    positive = torch.sigmoid(scores)
    return torch.stack([1 - positive, positive], dim=-1)
