"""The autograd Functions behind `map_grad`: a tensor's value forward, ``fn`` of its gradient backward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = ["Handed", "handed", "mapped_gradient", "writes_in_place", "writing_back", "written_back"]

GradFn = Callable[[torch.Tensor], torch.Tensor]


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


# NOTE [replaced derivatives of in-place modules]
# A module that writes its input in place (``y = relu_(h)``) leaves ``h`` holding its
# output, and a model may read ``h`` again (``head(y) + other(h)``). A tap that replaces
# the module's derivative hands the module a copy of ``h`` (a `map_grad`'s, or a copy for
# the module's own backward to keep), so ``h`` would keep its old value and ``other(h)``
# would read that, silently. So where the module wrote its copy, the tap writes the
# module's result, with the replaced derivative, back into ``h`` and hands on ``h``
# itself, as the module does: every reader of ``h`` then gets the module's value and the
# replaced derivative (``h``'s gradient node becomes the copy's, which leads to the
# replaced one). Whether the module wrote its copy is read from the copy's version
# counters, not from ``inplace=True``: dropout in eval mode, or a module whose
# ``inplace`` means something else, writes nothing, and writing ``h`` would then break a
# backward that keeps ``h`` (the ReLU's before it). Only modules that say
# ``inplace=True`` are watched (and under ``torch.compile``, where versions are symbols,
# taken at their word). A rule's Function that keeps the module's input keeps a
# copy (``h`` may be written after). A leaf that requires grad (the attributed input
# itself) cannot be written in place: there the module runs on the copy, as before
# (plain autograd refuses such a model outright: `saliency` raises).


def writes_in_place(module: Any) -> bool:
    """Whether ``module`` says it writes its input in place (``inplace=True``, as torch's activations)."""
    return getattr(module, "inplace", False) is True


def _versions(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s version counters at every functorch level (a write bumps the wrapper's under grad, the inner's under
    vmap); none while compiling, where they are symbols Dynamo cannot compare: a module that says so writes."""
    if torch.compiler.is_compiling():
        return ()
    versions = [t._version]
    while torch._C._functorch.is_batchedtensor(t) or torch._C._functorch.is_gradtrackingtensor(t):
        t = torch._C._functorch.get_unwrapped(t)
        versions.append(t._version)
    return tuple(versions)


class Handed(NamedTuple):
    """A module's input, the copy it was handed instead, and the copy's versions then."""

    original: torch.Tensor
    copy: torch.Tensor
    versions: tuple[int, ...]


def handed(original: Any, copy: Any) -> Handed | None:
    """What `written_back` needs of a module handed ``copy`` in place of ``original``; ``None`` where it is moot."""
    if (not isinstance(original, torch.Tensor) or not isinstance(copy, torch.Tensor) or copy is original
            or (original.is_leaf and original.requires_grad)):
        return None
    return Handed(original, copy, _versions(copy))


def written_back(run: Handed | None, result: Any) -> Any:
    """``result``, or the module's input holding it where the module wrote its copy in place.

    NOTE [replaced derivatives of in-place modules]. Where ``result`` is not shaped as the
    input, the input takes what the module wrote, and ``result`` is handed on.
    """
    if run is None or (run.versions and _versions(run.copy) == run.versions):
        return result
    original = run.original
    if isinstance(result, torch.Tensor) and result.shape == original.shape:
        return original.copy_(result)
    original.copy_(run.copy)
    return result


PreHook = Callable[[Any, tuple[Any, ...]], Any]
Hook = Callable[[Any, tuple[Any, ...], Any], Any]


def writing_back(pre: PreHook | None, post: Hook | None) -> tuple[PreHook, Hook]:
    """A `map_grad`'s hooks on a module that writes its input in place, keeping the model as it is.

    ``pre`` (the tap's at the module's input) or ``post`` (at its output); the module is
    handed ``pre``'s copy, or a copy of its own, and the returned hook writes back
    (NOTE [replaced derivatives of in-place modules]).
    """
    runs: list[Handed | None] = []  # (per call; a module may run more than once, nested in itself)

    def before(module: Any, args: tuple[Any, ...]) -> Any:
        new = None if pre is None else pre(module, args)
        x = args[0] if args else None
        if pre is None and isinstance(x, torch.Tensor) and not (x.is_leaf and x.requires_grad):
            new = (x.clone(), *args[1:])  # (a leaf that requires grad is written as the module writes it: torch raises)
        runs.append(handed(x, new[0]) if new is not None else None)
        return new

    def after(module: Any, args: tuple[Any, ...], output: Any) -> Any:
        new = None if post is None else post(module, args, output)
        return written_back(runs.pop(), output if new is None else new)

    return before, after
