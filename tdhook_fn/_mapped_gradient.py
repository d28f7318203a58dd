"""The autograd Functions behind `map_grad`: a tensor's value forward, ``fn`` of its gradient backward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._types import GradFn

__all__ = ["mapped_gradient"]


class _MapGrad(torch.autograd.Function):
    """Identity forward; ``fn`` applied to the gradient on the way back."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, fn: GradFn) -> torch.Tensor:
        # a copy, not a view: whatever reads it may write it in place (ReLU(inplace=True),
        # out += identity), which autograd forbids on a Function's view
        return x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.fn = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.fn(grad), None


# NOTE [plain-style Function outside transforms]
# A Function with a ``setup_context`` (what vmap and grad need) binds its arguments
# through ``inspect.signature`` at every apply, about as long again as the Function
# itself; outside functorch transforms and torch.compile, the plain-style twin with the
# same forward and backward runs instead.


class _PlainMapGrad(torch.autograd.Function):
    """`_MapGrad` in the plain style (NOTE [plain-style Function outside transforms])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fn: GradFn) -> torch.Tensor:
        ctx.fn = fn
        return x.clone()  # (a copy, as `_MapGrad`'s)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.fn(grad), None


# (torch declares Function.apply untyped: each apply's signature, stated once)
_map_grad: Callable[[torch.Tensor, GradFn], torch.Tensor] = _MapGrad.apply
_plain_map_grad: Callable[[torch.Tensor, GradFn], torch.Tensor] = _PlainMapGrad.apply


def mapped_gradient(value: Any, fn: GradFn) -> Any:
    """``value`` (a copy) whose gradient on the way back is ``fn(gradient)``; anything but a tensor as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    if not (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()):
        return _plain_map_grad(value, fn)
    # through a view, never on the tensor itself: under torch.compile (2.13) a Function applied
    # directly to a torch.func.grad primal (a map_grad at the model's input) loses its backward,
    # and the plain gradient comes out (tests/core/test_compile.py, guided_backprop); a view is free
    return _map_grad(value.view_as(value), fn)
