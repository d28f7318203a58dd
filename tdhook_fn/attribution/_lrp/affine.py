"""Modules whose forward is one affine map with a known adjoint: ``nn.Linear`` and ``nn.ConvNd``."""

# NOTE [affine modules]
# The rules on a linear layer or a convolution (z+, alpha-beta, w², flat, epsilon) need
# the module's map, often with modified parameters, and its adjoint ``J^T``. By autograd
# each costs a module rebuilt from its template, a graph and a pullback; for these
# modules both are one op: ``F.linear`` and ``v @ W``, ``F.convNd`` and
# ``F.conv_transposeNd`` with the output padding that gives back the input's shape (the
# transposed convolution *is* the convolution's adjoint, groups and dilation included).
# Measured on the benchmarks' CNN (z+ on both convolutions, warm, batch 64): the rules'
# relevance took 3.5 ms by autograd, 1.0 ms by these ops (with NOTE [fused alpha-beta]).
#
# Only the exact classes qualify (a subclass may have its own ``forward``), with zero
# padding given as numbers (``padding_mode`` other than ``"zeros"``, or ``padding="same"``,
# take the generic path), called with one positional input and no keywords, and with no
# instance ``forward`` (accelerate's hooks). The ops compose with every transform, as the
# module's own forward does.

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..._types import Pullback

__all__ = ["Affine", "affine_of"]

_CONVS: dict[type[nn.Module], tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]] = {
    nn.Conv1d: (F.conv1d, F.conv_transpose1d),
    nn.Conv2d: (F.conv2d, F.conv_transpose2d),
    nn.Conv3d: (F.conv3d, F.conv_transpose3d),
}


@dataclass(frozen=True)
class Affine:
    """The map ``x -> W x + b`` of a linear layer (``conv`` ``None``) or a convolution, and its adjoint."""

    conv: Callable[..., torch.Tensor] | None = None
    transpose: Callable[..., torch.Tensor] | None = None
    stride: tuple[int, ...] = ()
    padding: tuple[int, ...] = ()
    dilation: tuple[int, ...] = ()
    groups: int = 1

    @property
    def channel_dim(self) -> int:
        """The dim of an input or output that the weight maps (features, or channels)."""
        return -1 if self.conv is None else -len(self.stride) - 1

    def run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The module's forward on ``x`` with ``weight`` and ``bias``."""
        if self.conv is None:
            return F.linear(x, weight, bias)
        return self.conv(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    def pullback(self, weight: torch.Tensor, x_shape: torch.Size, y_shape: torch.Size) -> Pullback:
        """``J^T`` for ``weight`` at an input of shape ``x_shape`` whose output had ``y_shape`` (of a convolution,
        only their spatial dims are read): one op, its settings fixed here, in the forward.

        A convolution's is the transposed convolution, with the output padding that gives back
        the input's size (not the convolution with the kernel flipped and its channels swapped:
        with torch 2.13 the transposed one is 1.1-1.4x faster on the benchmarks' CNN at 1 and 2
        threads, it needs no flipped copy of the kernel per call, and its rounding does not
        move with the batch size, where the flipped one's moved by 9 ulps under ``vmap``).
        """
        if self.transpose is None:
            return partial(torch.matmul, other=weight)
        kernel = weight.shape[2:]
        spatial = zip(x_shape[-len(kernel):], y_shape[-len(kernel):], kernel, self.stride, self.padding,
                      self.dilation, strict=True)
        # the transposed convolution's own output size, and what it lacks of the input's
        output_padding = tuple(n - ((m - 1) * s - 2 * p + d * (k - 1) + 1) for n, m, k, s, p, d in spatial)
        return partial(self.transpose, weight=weight, bias=None, stride=self.stride, padding=self.padding,
                       output_padding=output_padding, groups=self.groups, dilation=self.dilation)


_LINEAR = Affine()


def affine_of(cls: type[nn.Module], state: Mapping[str, Any], parameters: Mapping[str, Any]) -> Affine | None:
    """The affine map of a module of class ``cls``, instance attributes ``state`` and ``parameters``, if any.

    ``state`` is the module's ``__dict__`` (or a template's state): a ``forward`` in it
    (an instance wrapper), padding other than zeros given as numbers, a weight that
    is not a parameter, or one registered after the bias (``del m.weight; m.weight = ...``) mean no.
    """
    if "forward" in state or parameters.get("weight") is None or any(k != "weight" and k != "bias" for k in parameters):
        return None
    if next(iter(parameters)) != "weight":  # (a bias registered first: the walks read a link's tensors in slot order)
        return None
    if cls is nn.Linear:
        return _LINEAR
    ops = _CONVS.get(cls)
    if ops is None or state.get("padding_mode") != "zeros":
        return None
    padding = state.get("padding")
    if not (isinstance(padding, tuple) and all(isinstance(p, int) for p in padding)):
        return None
    return Affine(ops[0], ops[1], tuple(state["stride"]), padding, tuple(state["dilation"]), int(state["groups"]))
