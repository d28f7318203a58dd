"""The hand-written walk the floors of walked methods share: a frozen chain run forward without a graph, then each
layer's backward by hand (no autograd), from the last linear layer's target row."""

from __future__ import annotations

from collections.abc import Callable

import torch
from _digits import max_pool_with_indices
from bench_deeplift import Back, affine_step
from torch import nn

ReluBack = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # a ReLU's (gradient, output) -> its input's


def walk_step(layer: nn.Module, h: torch.Tensor, relu_back: ReluBack) -> tuple[torch.Tensor, Back]:
    """One layer's forward without a graph, and its backward; a ReLU's ``relu_back(gradient, output)``."""
    affine = affine_step(layer, h)
    if affine is not None:
        return affine
    if isinstance(layer, nn.ReLU):
        y = torch.relu(h)
        return y, lambda g: relu_back(g, y)
    if isinstance(layer, nn.MaxPool2d):
        y, idx = max_pool_with_indices(layer, h)
        at, shape = idx.flatten(2), h.shape
        return y, lambda g: g.new_zeros(shape).flatten(2).scatter_add_(2, at, g.reshape(y.shape).flatten(2)).view(shape)
    if isinstance(layer, nn.Flatten):
        return h.flatten(1), lambda g: g.reshape(h.shape)
    raise TypeError(f"floor walk: no rule for {type(layer).__name__}")


def walked_forward(model: nn.Sequential, x: torch.Tensor, relu_back: ReluBack, target: int,
                   ) -> tuple[list[torch.Tensor], list[Back], torch.Tensor]:
    """The forward of a frozen chain ending in a linear layer, without a graph, up to that layer: each layer's
    output and backward, and the seed of the backward, the last weight's ``target`` row (its pullback of the
    one-hot)."""
    *body, last = list(model)
    assert isinstance(last, nn.Linear)
    h, outs, backs = x, [], []
    for layer in body:
        h, back = walk_step(layer, h, relu_back)
        outs.append(h)
        backs.append(back)
    return outs, backs, last.weight[target].expand(len(x), -1)


def plain_walked(model: nn.Module) -> bool:
    """Whether ours walks the model's plain gradient (a chain of linear layers and ReLUs: the benchmarks' MLPs), so
    its floor is the hand-written walk too."""
    return isinstance(model, nn.Sequential) and all(isinstance(m, (nn.Linear, nn.ReLU)) for m in model)


def own_relu_back(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.threshold_backward(g, y, 0)  # (autograd's own ReLU backward)


def walked_gradient(model: nn.Sequential, x: torch.Tensor, target: int) -> torch.Tensor:
    """The plain gradient of ``target`` at ``x`` by the walk (call it under ``torch.no_grad()`` on a frozen model)."""
    _, backs, g = walked_forward(model, x, own_relu_back, target)
    for back in reversed(backs):
        g = back(g)
    return g
