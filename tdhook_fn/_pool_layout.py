"""Max pooling of 2-d planes on the CPU in the channels-last layout: how shadows run ``nn.MaxPool2d``."""

# NOTE [shadow max pooling]
# On the CPU, torch's max pooling kernel for a batch of 2-d planes in the default layout
# is slow on small planes: on the benchmarks' CNN ([1344, 8, 8, 8], 2x2) it takes more
# than half of the forward; the same kernel on a channels-last copy takes a third of
# that, the copy included, and gives the same numbers (the first maximum of a window on
# ties, NaN as the default kernel takes it: tests compare both on ties, NaNs and signed
# zeros, with every setting). So the forwards whose outputs are only read (the engine's
# `target_values`: the perturbation and surrogate methods, infidelity, the deltas of the
# path methods) run in `forward_only` blocks, whose
# shadows (a pool of their own) are made of `ChannelsLastMaxPool2d` where the model has an
# ``nn.MaxPool2d`` (that very class, not a subclass with its own forward). It pools a batch
# of planes that nothing differentiates on a channels-last copy and hands on its result in
# the default layout: the model computes exactly what its own forward computes. A forward
# being differentiated keeps the plain kernel, so that gradients keep their layout (a
# channels-last gradient would reach the layers below in another layout, where a
# convolution's backward may round otherwise); so do calls under ``vmap`` or
# ``torch.compile``, other devices and inputs already channels-last. Every other call's
# shadows keep the model's own classes: the walks of LRP and DeepLift choose rules by the
# class of the module they run (and pool on a channels-last copy themselves:
# NOTE [max pooling in channels-last]).

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import Any

import torch
from torch import nn

__all__ = ["FORWARD_ONLY", "ChannelsLastMaxPool2d", "forward_only", "shadow_class"]

# whether a `forward_only` block is open (read directly by `run`, never under torch.compile)
FORWARD_ONLY: ContextVar[bool] = ContextVar("tdhook_fn_forward_only", default=False)


class forward_only:  # (a context manager read as a function; a class, not a generator: it runs on every call)
    """Calls in this block run on shadows for reading outputs only (NOTE [shadow max pooling]).

    Nothing under ``torch.compile``: Dynamo cannot trace a ``ContextVar`` being set, and a
    compiled call keeps the plain kernel anyway.
    """

    __slots__ = ("token",)
    token: Token[bool] | None

    def __enter__(self) -> None:
        self.token = None if torch.compiler.is_compiling() else FORWARD_ONLY.set(True)

    def __exit__(self, *exc: object) -> None:
        if self.token is not None:
            FORWARD_ONLY.reset(self.token)


_functorch = torch._C._functorch


def _undifferentiated_cpu_planes(x: torch.Tensor) -> bool:
    """Whether ``x`` is a batch of 2-d planes on the CPU in the default layout that nothing differentiates."""
    return (x.dim() == 4 and x.device.type == "cpu" and not (x.requires_grad and torch.is_grad_enabled())
            and not _functorch.is_functorch_wrapped_tensor(x) and not torch.compiler.is_compiling()
            and x.is_contiguous())


class ChannelsLastMaxPool2d(nn.MaxPool2d):
    """The class of a shadow of an ``nn.MaxPool2d``: the same forward, in channels-last where that is faster."""

    def forward(self, input: torch.Tensor) -> Any:
        if not _undifferentiated_cpu_planes(input):
            return super().forward(input)
        x = input.contiguous(memory_format=torch.channels_last)
        settings = (self.kernel_size, self.stride, self.padding, self.dilation)
        if self.return_indices:
            out, indices = nn.functional.max_pool2d(x, *settings, ceil_mode=self.ceil_mode, return_indices=True)
            return out.contiguous(), indices.contiguous()
        return nn.functional.max_pool2d(x, *settings, ceil_mode=self.ceil_mode).contiguous()


def shadow_class(module: nn.Module) -> type[nn.Module]:
    """The class a shadow of ``module`` is made of: its own, but for ``nn.MaxPool2d`` itself."""
    kind = type(module)
    return ChannelsLastMaxPool2d if kind is nn.MaxPool2d else kind
