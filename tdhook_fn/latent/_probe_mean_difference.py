"""The mean-difference classifier: the direction between the two classes' means."""

from __future__ import annotations

import torch

__all__ = ["mean_difference"]


def mean_difference(x: torch.Tensor, index: torch.Tensor, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight (..., 1, D)`` and ``bias (..., 1)`` from ``x (..., N, D)`` and 0/1 class ``index (N,)``.

    The weight is ``mu_1 - mu_0`` and the bias ``-(|mu_1|^2 - |mu_0|^2) / 2``: the decision
    is positive on the side of the bisecting hyperplane nearer ``mu_1``. ``normalize``
    divides both by ``|mu_1 - mu_0|`` (unless it is 0), as tdhook's ``MeanDifferenceClassifier``.
    """
    positive = (index == 1).to(x.dtype)
    means = torch.stack([(1 - positive) @ x / (1 - positive).sum(), positive @ x / positive.sum()], -2)
    weight = means[..., 1, :] - means[..., 0, :]
    squares = (means**2).sum(-1)
    bias = -0.5 * (squares[..., 1] - squares[..., 0])
    if normalize:
        norm = torch.linalg.vector_norm(weight, dim=-1)
        scale = torch.where(norm > 0, norm, torch.ones_like(norm))
        weight, bias = weight / scale[..., None], bias / scale
    return weight[..., None, :], bias[..., None]
