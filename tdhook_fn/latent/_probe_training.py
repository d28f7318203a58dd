"""Small probes trained by minibatch Adam: scores, loss and one epoch, as pure functions.

A probe is a flat mapping of named tensors (the names of its ``named_parameters``):

- ``"linear"``: ``linear.weight`` ``(C, D)``, ``linear.bias`` ``(C,)`` or absent;
  scores ``x @ W.T + b``.
- ``"bilinear"``: ``bilinear.weight`` ``(C, D1, D2)``, ``bilinear.bias``;
  scores ``h1 A_c h2 + b_c``.
- ``"low_rank_bilinear"``: ``linear1.*`` ``(C, D1)``, ``linear2.*`` ``(C, D2)``, ``bias``;
  scores ``(U h1 + a) * (V h2 + c) + b``.
"""

# NOTE [probe epochs]
# tdhook trains its estimators with a shuffled ``DataLoader`` and ``torch.optim.Adam``.
# `adam_epoch` runs the same updates (the same minibatches in the same order, Adam's
# single-tensor update with the same operations) without the loader's per-sample
# collation and the optimizer's bookkeeping, so a fit is the same fit, faster. The
# shuffling order is an argument: the caller chooses it (tdhook's compat estimators draw
# it as the loader does).

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["AdamState", "adam_epoch", "adam_init", "probe_loss", "probe_scores"]

KINDS = ("linear", "bilinear", "low_rank_bilinear")
Params = Mapping[str, torch.Tensor]


def probe_scores(kind: str, params: Params, *xs: torch.Tensor) -> torch.Tensor:
    """The scores ``(N, C)`` of a probe on its inputs ``(N, D)`` (one, or two for bilinear kinds).

    Args:
        kind (str): ``"linear"``, ``"bilinear"`` or ``"low_rank_bilinear"``.
        params (Mapping[str, Tensor]): the probe's tensors by name (module docstring).
        *xs (Tensor): the inputs.

    Returns:
        Tensor: the scores, ``(N, C)``.

    Raises:
        ValueError: an unknown ``kind`` or the wrong number of inputs.

    Examples:
        >>> import torch
        >>> p = {"linear.weight": torch.eye(2), "linear.bias": torch.zeros(2)}
        >>> probe_scores("linear", p, torch.tensor([[1.0, 2.0]]))
        tensor([[1., 2.]])
    """
    if kind not in KINDS:
        raise ValueError(f"probe_scores: kind must be one of {KINDS}, got {kind!r}")
    wanted = 1 if kind == "linear" else 2
    if len(xs) != wanted:
        raise ValueError(f"probe_scores: a {kind} probe expects {wanted} input tensor(s), got {len(xs)}")
    if kind == "linear":
        return F.linear(xs[0], params["linear.weight"], params.get("linear.bias"))
    if kind == "bilinear":
        return F.bilinear(xs[0], xs[1], params["bilinear.weight"], params.get("bilinear.bias"))
    u = F.linear(xs[0], params["linear1.weight"], params.get("linear1.bias"))
    v = F.linear(xs[1], params["linear2.weight"], params.get("linear2.bias"))
    bias = params.get("bias")
    return u * v if bias is None else u * v + bias


def probe_loss(scores: torch.Tensor, target: torch.Tensor, *, num_classes: int | None) -> torch.Tensor:
    """Mean squared error (``num_classes=None``) or cross-entropy of scores against targets.

    Args:
        scores (Tensor): ``(N, 1)``-like regression outputs shaped as ``target``, or
            ``(N, C)`` class scores.
        target (Tensor): regression targets, or ``(N,)`` class indices.
        num_classes (int | None): ``None`` for regression, else ``C``.

    Returns:
        Tensor: the scalar loss.

    Raises:
        ValueError: the shapes do not fit (for regression, ``target`` must have the
            scores' shape: reshape it to ``(N, 1)``).

    Examples:
        >>> import torch
        >>> probe_loss(torch.zeros(2, 3), torch.tensor([0, 2]), num_classes=3)
        tensor(1.0986)
    """
    if num_classes is None:
        if scores.shape != target.shape:
            raise ValueError(
                f"Output shape {scores.shape} does not match target shape {target.shape}: regression targets "
                "must have the outputs' shape (reshape y to (N, 1) for one output)"
            )
        return F.mse_loss(scores, target)
    if scores.shape[:-1] != target.shape or scores.shape[-1] != num_classes:
        raise ValueError(
            f"Output shape {scores.shape} does not match target shape {target.shape}: class targets are "
            f"(N,) indices for (N, {num_classes}) scores"
        )
    return F.cross_entropy(scores, target)


class AdamState(NamedTuple):
    """Adam's moments and number of steps taken, by parameter name."""

    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    step: dict[str, int]


def adam_init(params: Params) -> AdamState:
    """Adam's state before the first step: zero moments, no step.

    Args:
        params (Mapping[str, Tensor]): the tensors to optimise.

    Returns:
        AdamState: the state.

    Examples:
        >>> import torch
        >>> adam_init({"w": torch.ones(2)}).step
        {'w': 0}
    """
    zeros = {name: torch.zeros_like(value) for name, value in params.items()}
    return AdamState(zeros, {name: torch.zeros_like(value) for name, value in params.items()},
                     dict.fromkeys(params, 0))


def _adam_update(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int,
    lr: float, betas: tuple[float, float], eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The operations of torch.optim.Adam's single-tensor update, out of place.
    beta1, beta2 = betas
    exp_avg = exp_avg.lerp(grad, 1 - beta1)
    exp_avg_sq = exp_avg_sq.mul(beta2).addcmul(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add(eps)
    return param.addcdiv(exp_avg, denom, value=-step_size), exp_avg, exp_avg_sq


Scores = Callable[..., torch.Tensor]


def adam_epoch(
    model: str | Scores,
    params: Params,
    state: AdamState,
    xs: tuple[torch.Tensor, ...],
    target: torch.Tensor,
    order: torch.Tensor,
    *,
    num_classes: int | None = None,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    lr: float = 1e-3,
    batch_size: int = 128,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> tuple[dict[str, torch.Tensor], AdamState]:
    """One epoch of minibatch Adam: batches of ``order``, in order.

    Args:
        model (str | Callable): a probe kind (see `probe_scores`), or a pure
            ``scores(params, *xs) -> Tensor``.
        params (Mapping[str, Tensor]): the tensors to train; not modified.
        state (AdamState): from `adam_init` or the previous epoch.
        xs (tuple[Tensor, ...]): the inputs, ``(N, ...)`` each.
        target (Tensor): the targets, ``(N, ...)``.
        order (Tensor): a permutation of ``range(N)``; consecutive slices of
            ``batch_size`` are the minibatches (the last may be smaller).
        num_classes (int | None): for the default loss, `probe_loss`'s. Default: None.
        loss (Callable | None): ``loss(scores, target) -> scalar``. Default: `probe_loss`.
        lr (float): the learning rate. Default: 1e-3.
        batch_size (int): the minibatch size. Default: 128.
        betas (tuple[float, float]): Adam's decay rates. Default: (0.9, 0.999).
        eps (float): added to the denominator. Default: 1e-8.

    Returns:
        tuple[dict[str, Tensor], AdamState]: the new tensors and state. A tensor the loss
        does not depend on in a step is left as it is, its state too (as torch's Adam
        skips a parameter without a gradient).

    Raises:
        ValueError: ``batch_size`` below 1, or ``order`` not of length ``N``.

    Examples:
        >>> import torch
        >>> p = {"linear.weight": torch.zeros(1, 2), "linear.bias": torch.zeros(1)}
        >>> x, y = torch.randn(8, 2), torch.randn(8, 1)
        >>> p2, s = adam_epoch("linear", p, adam_init(p), (x,), y, torch.randperm(8), batch_size=4)
        >>> s.step
        {'linear.weight': 2, 'linear.bias': 2}
    """
    if batch_size < 1:
        raise ValueError(f"adam_epoch: batch_size must be at least 1, got {batch_size}")
    n = target.shape[0]
    if order.shape != (n,):
        raise ValueError(f"adam_epoch: order must be a permutation of the {n} samples, got shape {tuple(order.shape)}")
    scores = functools.partial(probe_scores, model) if isinstance(model, str) else model
    loss_fn = loss or functools.partial(probe_loss, num_classes=num_classes)
    current = dict(params)
    exp_avg, exp_avg_sq, step = dict(state.exp_avg), dict(state.exp_avg_sq), dict(state.step)
    # one gather per epoch; the minibatches are then views
    batches = zip(*(torch.split(x[order], batch_size) for x in xs), torch.split(target[order], batch_size),
                  strict=True)
    with torch.enable_grad():
        for *inputs, batch_target in batches:
            leaves = {name: value.detach().requires_grad_() for name, value in current.items()}
            value = loss_fn(scores(leaves, *inputs), batch_target)
            grads = torch.autograd.grad(value, list(leaves.values()), allow_unused=True)
            for name, grad in zip(leaves, grads, strict=True):
                if grad is None:
                    continue
                step[name] += 1
                current[name], exp_avg[name], exp_avg_sq[name] = _adam_update(
                    current[name].detach(), grad, exp_avg[name], exp_avg_sq[name], step[name], lr, betas, eps)
    return current, AdamState(exp_avg, exp_avg_sq, step)
