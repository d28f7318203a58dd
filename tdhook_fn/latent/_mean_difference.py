"""The mean-difference classifier: the direction between two class means, as pure functions."""

from __future__ import annotations

import torch

__all__ = ["mean_difference_fit", "mean_difference_proba", "mean_difference_scores"]


def mean_difference_fit(
    x: torch.Tensor, y: torch.Tensor, *, normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The hyperplane halfway between the means of the positive and the negative samples.

    With class means ``p`` and ``n``, the direction is ``w = p - n`` and the offset
    ``b = -(|p|^2 - |n|^2) / 2``, so ``x @ w + b`` is zero at the midpoint ``(p + n) / 2``.
    With ``normalize``, both are divided by ``|w|`` (unless ``w`` is zero), making the score a
    signed distance to the hyperplane.

    Args:
        x (Tensor): samples ``(..., N, D)``; leading dims are batch dims.
        y (Tensor): labels ``(..., N)`` in {0, 1} (or bool).
        normalize (bool): divide by ``|w|``. Default: True.

    Returns:
        tuple[Tensor, Tensor]: ``w`` ``(..., D)`` and ``b`` ``(...)``, in ``x``'s dtype.

    Raises:
        ValueError: ``y`` is not ``x``'s leading shape, holds another value than 0 or 1,
            or misses a class in some batch.

    Examples:
        >>> import torch
        >>> x = torch.tensor([[1.0, 0.0], [2.0, 0.0], [-1.0, 0.0], [-2.0, 0.0]])
        >>> w, b = mean_difference_fit(x, torch.tensor([1, 1, 0, 0]), normalize=False)
        >>> w, b
        (tensor([3., 0.]), tensor(0.))
        >>> torch.vmap(lambda xx: mean_difference_fit(xx, torch.tensor([1, 1, 0, 0]))[0])(x[None]).shape
        torch.Size([1, 2])
    """
    if y.shape != x.shape[:-1]:
        raise ValueError(
            f"mean_difference_fit: y must have the shape {tuple(x.shape[:-1])} of x without its last dim (one "
            f"label per sample; several targets are not supported), got {tuple(y.shape)}"
        )
    if y.dtype != torch.bool and not torch._C._functorch.is_batchedtensor(y):
        if ((y != 0) & (y != 1)).any():
            raise ValueError("mean_difference_fit: y must hold 0/1 labels; map each class to 0 or 1 first")
    positive = y.to(x.dtype).unsqueeze(-1)
    pos_count, neg_count = positive.sum(-2), (1 - positive).sum(-2)
    if not torch._C._functorch.is_batchedtensor(y) and ((pos_count == 0) | (neg_count == 0)).any():
        raise ValueError("mean_difference_fit: Both classes must be present in y (every batch needs a 0 and a 1)")
    pos = (x * positive).sum(-2) / pos_count
    neg = (x * (1 - positive)).sum(-2) / neg_count
    w = pos - neg
    b = -0.5 * (pos.square().sum(-1) - neg.square().sum(-1))
    if normalize:
        norm = torch.linalg.vector_norm(w, dim=-1)
        scale = torch.where(norm > 0, norm, torch.ones_like(norm))
        w, b = w / scale.unsqueeze(-1), b / scale
    return w, b


def mean_difference_scores(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The signed scores ``x @ w + b`` of samples under a fitted `mean_difference_fit`.

    Args:
        x (Tensor): samples ``(..., N, D)``.
        w (Tensor): direction ``(..., D)``.
        b (Tensor): offset ``(...)``.

    Returns:
        Tensor: ``(..., N)``; positive on the side of the positive class.

    Examples:
        >>> import torch
        >>> mean_difference_scores(torch.tensor([[1.0, 0.0]]), torch.tensor([1.0, 0.0]), torch.tensor(0.5))
        tensor([1.5000])
    """
    return (x * w.unsqueeze(-2)).sum(-1) + b.unsqueeze(-1)


def mean_difference_proba(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The probabilities ``(..., N, 2)`` of the negative and the positive class: the sigmoid of the scores.

    Args:
        x (Tensor): samples ``(..., N, D)``.
        w (Tensor): direction ``(..., D)``.
        b (Tensor): offset ``(...)``.

    Returns:
        Tensor: ``(..., N, 2)``, rows summing to 1; 0.5 on the hyperplane.

    Examples:
        >>> import torch
        >>> mean_difference_proba(torch.zeros(1, 2), torch.tensor([1.0, 0.0]), torch.tensor(0.0))
        tensor([[0.5000, 0.5000]])
    """
    positive = torch.sigmoid(mean_difference_scores(x, w, b))
    return torch.stack([1 - positive, positive], dim=-1)
