"""What lrp refuses and checks: tracing, a rule's module call, conservation (its maps' differentiation: in
`.._replaced_derivatives`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from tensordict import TensorDict, TensorDictBase

from .._engine import Cotangents

__all__ = [
    "check_module_call",
    "check_pass",
    "never_traced",
    "raise_unless_conserved",
]

_F = TypeVar("_F", bound=Callable[..., Any])
_compiler_disable: Callable[[Callable[..., Any]], Callable[..., Any]] = torch.compiler.disable  # (untyped in torch)


def never_traced(fn: _F) -> _F:
    """``fn`` run eagerly inside compiled code (NOTE [lrp is never traced])."""
    # NOTE [lrp is never traced]
    # The rule taps carry Python objects (templates, rules) into autograd Functions'
    # backward, which Dynamo cannot trace: with ``fullgraph=True`` it fails, and with graph
    # breaks it failed on an internal assertion (a wrong map was the risk). So lrp is
    # excluded from tracing: inside a compiled function it runs eagerly and gives the
    # eager maps; ``fullgraph=True`` reports the excluded call. The DeepLift methods
    # (``deeplift``, ``deeplift_shap``, ``layer_deeplift``) run on the same rule taps
    # wherever the chain walk does not (always under tracing), so they are excluded alike.
    return cast(_F, _compiler_disable(fn))  # (no reason=: it needs torch 2.8)


def raise_unless_conserved(relevance: TensorDict, targets: TensorDictBase, per_target: bool,
                           cotangents: Cotangents | None, batch: torch.Size) -> None:
    """Raise ``RuntimeError`` unless each map sums to the relevance put in at its targets."""
    lead = relevance.batch_size[: len(relevance.batch_size) - len(batch)]

    def total(td: Any, dims: int) -> torch.Tensor:
        sums = [v.reshape(*v.shape[:dims], -1).sum(-1) for v in td.values(True, True)]
        return torch.stack([s.expand(sums[0].shape) for s in sums]).sum(0)

    got = total(relevance, len(lead) + len(batch))
    if cotangents is not None:
        put = total(cotangents(targets), len(batch))
    elif per_target:
        put = torch.ones(())
    else:
        put = total(targets.apply(torch.ones_like), len(batch))
    put = put.to(got.dtype).expand_as(got)
    tol = 1e-6 if got.dtype == torch.float64 else 1e-4
    bad = ~torch.isclose(got, put, rtol=tol, atol=tol)
    if bool(bad.any()):
        worst = int((got - put).abs().argmax())
        raise RuntimeError(f"lrp: relevance is not conserved: the inputs hold {got.flatten()[worst].item():.6g}, "
                           f"the targets put in {put.flatten()[worst].item():.6g} (map {worst} of {got.numel()}); "
                           "biases, epsilon and non-conserving rules (Flat on a biased layer, Stop) absorb some")


def check_module_call(caller: str, path: str, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
    """Raise unless a ruled module took tensors as positional arguments only and returned one tensor (the error
    named for ``caller``, the method whose rules these are)."""
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"{caller}: module {path!r} returns a {type(output).__name__}; a rule needs a module "
                        "returning one tensor (give the rule to its sublayers)")
    if not all(isinstance(a, torch.Tensor) for a in args) or any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        raise TypeError(f"{caller}: module {path!r} is called with non-tensor positional or tensor keyword "
                        "arguments; rules need tensors as positional arguments only")


def check_pass(caller: str, path: str, args: tuple[Any, ...], output: torch.Tensor) -> None:
    """Raise unless the module of a Pass rule maps one input to an output of its shape."""
    if len(args) != 1 or args[0].shape != output.shape:
        raise ValueError(f"{caller}: Pass at {path!r} needs one input of the output's shape, got "
                         f"{[tuple(a.shape) for a in args]} and {tuple(output.shape)}")
