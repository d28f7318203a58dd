"""What lrp refuses and checks: differentiation of its maps, tracing, conservation."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import torch
from tensordict import TensorDict, TensorDictBase

from ..._params import leaves
from ..._vjp import any_requires_grad
from .._cotangents import Cotangents

__all__ = [
    "as_values",
    "check_module_call",
    "check_pass",
    "never_traced",
    "raise_unless_conserved",
    "refuse_level_zero_graph",
]

_F = TypeVar("_F", bound=Callable[..., Any])


def never_traced(fn: _F) -> _F:
    """``fn`` run eagerly inside compiled code (NOTE [lrp is never traced])."""
    # NOTE [lrp is never traced]
    # The rule taps carry Python objects (templates, rules) into autograd Functions'
    # backward, which Dynamo cannot trace: with ``fullgraph=True`` it fails, and with graph
    # breaks it failed on an internal assertion (a wrong map was the risk). So lrp is
    # excluded from tracing: inside a compiled function it runs eagerly and gives the
    # eager maps; ``fullgraph=True`` reports the excluded call.
    return cast(_F, torch.compiler.disable(fn))  # type: ignore[no-untyped-call]  # (reason= needs torch 2.8)


def _tracked(t: Any) -> bool:
    functorch = torch._C._functorch
    while isinstance(t, torch.Tensor) and functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_gradtrackingtensor(t):
            return True
        t = functorch.get_unwrapped(t)
    return False


def _refuse_outer_differentiation(params: Any, inputs: Any) -> None:
    """Raise under a ``grad``/``vjp``/``jvp`` of lrp itself (``vmap`` is fine); see the NOTE."""
    # NOTE [lrp maps are not differentiable]
    # A rule's backward stands in for the module's derivative at *every* level of
    # differentiation, so an outer ``torch.func.grad`` of an LRP map would differentiate
    # through the rules as if they were the modules' derivatives: a plausible, wrong number.
    if torch._C._functorch.peek_interpreter_stack() is None:
        return  # no functorch level is active: nothing can be tracked by one
    for td in (params, inputs):
        if isinstance(td, TensorDictBase) and any(_tracked(v) for v in td.values(True, True)):
            raise NotImplementedError(
                "lrp: its maps cannot be differentiated (called under torch.func.grad, vjp, jvp or jacrev of "
                "params or inputs): the rules replace the modules' derivatives at every level, so the result "
                "would be wrong. vmap is fine; differentiate a gradient method instead")


def as_values(params: Any, inputs: TensorDictBase, values: Mapping[Any, Any] | None = None) -> TensorDictBase:
    """``inputs``, detached if they require grad; a refusal where the maps could be differentiated.

    Raises under a functorch ``grad``/``vjp``/``jvp`` of lrp (`_refuse_outer_differentiation`)
    and, under regular autograd, for params that require grad: the maps would carry a
    gradient in them, and a wrong one. Inputs that require grad are read as values.
    ``values``: the params' leaves, where the caller has them.
    """
    _refuse_outer_differentiation(params, inputs)
    if not torch.is_grad_enabled():
        return inputs
    if _requires_grad(params, values):
        raise NotImplementedError(
            "lrp: params require grad (e.g. TensorDict.from_module(model) holds the model's Parameters), so "
            "the maps would carry a gradient in them, and it would be wrong: the rules replace the modules' "
            "derivatives (NOTE [lrp maps are not differentiable]). Pass detached params "
            "(tdhook_fn.params(model) gives them), or call lrp under torch.no_grad()")
    return inputs.detach() if _inputs_require_grad(inputs) else inputs


def _inputs_require_grad(inputs: TensorDictBase) -> bool:
    """`_requires_grad` of the inputs: a plain TensorDict of tensors read from its own dict (its leaves cost a
    third of this check's time, on every call)."""
    own = inputs.__dict__.get("_tensordict") if type(inputs) is TensorDict else None
    if not isinstance(own, dict) or not all(type(v) is torch.Tensor for v in own.values()):
        return _requires_grad(inputs, leaves(inputs))
    return _requires_grad(inputs, own)


def _requires_grad(params: Any, values: Mapping[Any, Any] | None) -> bool:
    """`any_requires_grad` of ``params``; from their ``values`` where none is a functorch wrapper (one pass)."""
    if values is None:
        return any_requires_grad([params])
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    found = False
    for value in values.values():  # (a plain loop: a comprehension and a generator cost calls, on every call)
        if isinstance(value, torch.Tensor):
            if wrapped(value):
                return any_requires_grad([params])
            found = found or value.requires_grad
    return found


def refuse_level_zero_graph(maps: TensorDictBase) -> None:
    """Raise when a map carries a regular-autograd graph all the same (a closed-over tensor that requires grad)."""
    if any(t.requires_grad for t in maps.values(True, True)):
        raise NotImplementedError(
            "lrp: the maps require grad: a tensor that requires grad reached them through the target, the "
            "cotangents or a tap (a closed-over tensor), and their gradient would be wrong (NOTE [lrp maps are "
            "not differentiable]). Detach it, or call lrp under torch.no_grad()")


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


def check_module_call(path: str, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
    """Raise unless a ruled module took tensors as positional arguments only and returned one tensor."""
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"lrp: module {path!r} returns a {type(output).__name__}; a rule needs a module "
                        "returning one tensor (give the rule to its sublayers)")
    if not all(isinstance(a, torch.Tensor) for a in args) or any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        raise TypeError(f"lrp: module {path!r} is called with non-tensor positional or tensor keyword "
                        "arguments; rules need tensors as positional arguments only")


def check_pass(path: str, args: tuple[Any, ...], output: torch.Tensor) -> None:
    """Raise unless the module of a Pass rule maps one input to an output of its shape."""
    if len(args) != 1 or args[0].shape != output.shape:
        raise ValueError(f"lrp: Pass at {path!r} needs one input of the output's shape, got "
                         f"{[tuple(a.shape) for a in args]} and {tuple(output.shape)}")
