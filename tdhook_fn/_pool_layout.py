"""Max pooling of 2-d planes on the CPU in the channels-last layout: how shadows run ``nn.MaxPool2d``."""

# NOTE [shadow max pooling]
# On the CPU, torch's max pooling kernel for a batch of 2-d planes in the default layout
# is slow where there are several channels: on the benchmarks' CNN ([1600, 8, 8, 8], 2x2)
# it takes a third of a SmoothGrad call, forward and backward; the channels-last kernel,
# which runs the channels as vector lanes, takes a fifth of that on a channels-last copy,
# the copy included, and gives the same numbers (the first maximum of a window on ties,
# NaN as the default kernel takes it: tests compare both on ties, NaNs and signed zeros,
# with every setting). With fewer than four channels it is slower (1.3x-1.6x, measured
# on 8x8 and 112x112 planes), and so it is on inputs of fewer than 2^15 elements, where
# the copies (and, differentiated, the autograd Function below) cost more than the
# kernel saves: a saliency call on a CNN at batch 1 took 60 us more. Measured on planes
# of 8x8 to 32x32, 4 to 32 channels: at 2^14 elements 0.7x-1.5x forward, 0.55x-0.7x
# differentiated; at 2^15 1.35x-3x forward, 0.9x-1.3x differentiated; at 2^16 1.1x-1.8x
# differentiated. There the plain kernel runs.
#
# So the calls that run in `fast_pooling` blocks have shadows (a pool of their own) made
# of `ChannelsLastMaxPool2d` where the model has an ``nn.MaxPool2d`` (that very class, not
# a subclass with its own forward). Such a block is open for the forwards whose outputs
# are only read (`target_values`: the perturbation and surrogate methods,
# infidelity, the deltas of the path methods) and for the engine's gradients (saliency,
# integrated gradients, SmoothGrad, GradientSHAP, Grad-CAM, deconvolution, guided
# backprop); a call that attaches a tap of its own making (a custom tap, `attaches_itself`)
# keeps the plain shadows, whoever asked: such a tap is handed the shadow's module and may
# choose by its class, as the rule methods' do (LRP and DeepLift, whose walks pool on a
# channels-last copy themselves, NOTE [max pooling in channels-last]); the built-in kinds
# hand their functions values only. Its forward pools the planes on a channels-last
# copy and hands on the result in the default layout. Where the input is differentiated by autograd, it does so
# in an autograd Function whose backward is the one autograd runs for the plain kernel
# (`max_pool2d_with_indices_backward` on the input, in its default layout, with the same
# indices): the gradient below keeps its layout, so every layer below rounds as it would
# (a channels-last gradient there makes a convolution's backward round otherwise, and run
# slower), and the maps are autograd's bit for bit, a second derivative included (that
# backward is differentiable as autograd's is). Calls under ``vmap``, ``torch.func``
# transforms, forward AD or ``torch.compile``, on other devices, and inputs already
# channels-last keep the plain kernel. Every other call's shadows keep the model's own
# classes.

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import Any

import torch
from torch import nn
from torch.autograd import forward_ad

__all__ = ["FAST_POOLING", "ChannelsLastMaxPool2d", "channels_last_max_pool", "fast_pooling", "faster_in_channels_last",
           "shadow_class"]

# whether a `fast_pooling` block is open (read directly by `run`, never under torch.compile)
FAST_POOLING: ContextVar[bool] = ContextVar("tdhook_fn_fast_pooling", default=False)

# below these the channels-last kernel is the slower (NOTE [shadow max pooling]): the input's channels, elements
_FEWEST_CHANNELS = 4
_FEWEST_ELEMENTS = 1 << 15


class fast_pooling:  # (a context manager read as a function; a class, not a generator: it runs on every call)
    """Calls in this block run on shadows that pool in channels-last where that is faster
    (NOTE [shadow max pooling]).

    Nothing under ``torch.compile``: Dynamo cannot trace a ``ContextVar`` being set, and a
    compiled call keeps the plain kernel anyway.
    """

    __slots__ = ("token",)
    token: Token[bool] | None

    def __enter__(self) -> None:
        self.token = None if torch.compiler.is_compiling() else FAST_POOLING.set(True)

    def __exit__(self, *exc: object) -> None:
        if self.token is not None:
            FAST_POOLING.reset(self.token)


_functorch = torch._C._functorch


def faster_in_channels_last(x: torch.Tensor) -> bool:
    """Whether ``x`` is a batch of 2-d planes of several channels on the CPU, in the default layout, not small, that
    no transform of torch.func or torch.compile sees: max pooling it is faster on a channels-last copy."""
    return (x.dim() == 4 and x.shape[1] >= _FEWEST_CHANNELS and x.numel() >= _FEWEST_ELEMENTS
            and x.device.type == "cpu" and x.is_contiguous() and not _functorch.is_functorch_wrapped_tensor(x)
            and not torch.compiler.is_compiling())


def channels_last_max_pool(x: torch.Tensor, kernel: Any, stride: Any, padding: Any, dilation: Any,
                           ceil_mode: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.max_pool2d(x, ..., return_indices=True)`` run on a channels-last copy of ``x``: the same maxima and
    indices, both in the default layout (NOTE [shadow max pooling])."""
    out, indices = nn.functional.max_pool2d(x.contiguous(memory_format=torch.channels_last), kernel, stride,
                                            padding, dilation, ceil_mode=ceil_mode, return_indices=True)
    return out.contiguous(), indices.contiguous()


# autograd's backward of the plain kernel (its overload itself: the packet resolves it at every call)
_POOL_BACKWARD: Callable[..., torch.Tensor] = torch.ops.aten.max_pool2d_with_indices_backward.default


class _PlanesMaxPool(torch.autograd.Function):
    """`channels_last_max_pool`, differentiated by autograd's backward of the plain kernel
    (NOTE [shadow max pooling])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kernel: Any, stride: Any, padding: Any, dilation: Any,
                ceil_mode: bool) -> tuple[torch.Tensor, torch.Tensor]:
        out, indices = channels_last_max_pool(x, kernel, stride, padding, dilation, ceil_mode)
        ctx.save_for_backward(x, indices)
        ctx.settings = (kernel, stride, padding, dilation, ceil_mode)
        ctx.mark_non_differentiable(indices)
        return out, indices

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _indices: Any) -> tuple[Any, ...]:
        x, indices = ctx.saved_tensors
        back = _POOL_BACKWARD(grad, x, *ctx.settings, indices)
        return back, None, None, None, None, None


# (torch declares Function.apply untyped: its signature, stated once)
_planes_max_pool: Callable[..., tuple[torch.Tensor, torch.Tensor]] = _PlanesMaxPool.apply


class ChannelsLastMaxPool2d(nn.MaxPool2d):
    """The class of a shadow of an ``nn.MaxPool2d``: the same forward, in channels-last where that is faster."""

    def forward(self, input: torch.Tensor) -> Any:
        if not faster_in_channels_last(input):
            return super().forward(input)
        if input.requires_grad and torch.is_grad_enabled():
            if forward_ad._current_level >= 0:  # (the Function has no forward-mode derivative)
                return super().forward(input)
            # (the settings as the module holds them: the kernels read an int as both dims and an empty stride as
            # the kernel's, as F.max_pool2d does, and refuse a zero one)
            out, indices = _planes_max_pool(input, self.kernel_size, self.stride, self.padding, self.dilation,
                                            self.ceil_mode)
            return (out, indices) if self.return_indices else out
        if self.return_indices:
            return channels_last_max_pool(input, self.kernel_size, self.stride, self.padding, self.dilation,
                                          self.ceil_mode)
        x = input.contiguous(memory_format=torch.channels_last)  # (the maxima alone: no indices to convert)
        return nn.functional.max_pool2d(x, self.kernel_size, self.stride, self.padding, self.dilation,
                                        ceil_mode=self.ceil_mode).contiguous()


def shadow_class(module: nn.Module) -> type[nn.Module]:
    """The class a shadow of ``module`` is made of: its own, but for ``nn.MaxPool2d`` itself."""
    kind = type(module)
    return ChannelsLastMaxPool2d if kind is nn.MaxPool2d else kind
