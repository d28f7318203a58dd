"""Maps whose backward replaces modules' derivatives are values: refused where they could be differentiated."""

# NOTE [replaced derivatives are not differentiated]
# LRP's rules, DeepLift's multipliers, guided backprop's and the deconvnet's ReLU rules,
# ``grad_fns`` and `map_grad` taps stand in for a module's derivative in the graph. A
# derivative of such a map would pass the same nodes again, on the module's value path
# too, and get the replacement where the module's own derivative belongs: under an outer
# ``torch.func.grad`` (or ``autograd.grad`` of a map that kept its graph) the result is a
# plausible, wrong number (tests/attribution/test_replaced_derivatives.py shows one
# against finite differences). So these maps are values:
# - under a functorch ``grad``/``vjp``/``jvp``/``jacrev`` of the params or the inputs the
#   call raises (``vmap`` is fine: it differentiates nothing);
# - params that require grad raise too (their maps would carry a graph in them), unless
#   grad mode is off; inputs that require grad are read as values (captum's maps carry no
#   graph either);
# - a map that carries a graph all the same (a closed-over tensor that requires grad, in a
#   target, a tap or cotangents) raises.

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from .._params import leaves
from .._taps import Tap
from .._vjp import any_requires_grad

__all__ = ["as_values", "refuse_level_zero_graph", "replaces_any", "values_where_replaced"]


def _tracked(t: Any) -> bool:
    functorch = torch._C._functorch
    while isinstance(t, torch.Tensor) and functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_gradtrackingtensor(t):
            return True
        t = functorch.get_unwrapped(t)
    return False


def _refuse_outer_differentiation(caller: str, params: Any, inputs: Any) -> None:
    """Raise under a ``grad``/``vjp``/``jvp`` of the call itself (``vmap`` is fine)."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return  # no functorch level is active: nothing can be tracked by one
    for td in (params, inputs):
        if isinstance(td, TensorDictBase) and any(_tracked(v) for v in td.values(True, True)):
            raise NotImplementedError(
                f"{caller}: its maps cannot be differentiated (called under torch.func.grad, vjp, jvp or jacrev of "
                "params or inputs): its backward replaces modules' derivatives at every level, so the result would "
                "be wrong (NOTE [replaced derivatives are not differentiated]). vmap is fine; differentiate a "
                "plain gradient method (saliency, integrated_gradients without grad_fns) instead")


def as_values(caller: str, params: Any, inputs: TensorDictBase,
              values: Mapping[Any, Any] | None = None) -> TensorDictBase:
    """``inputs``, detached if they require grad; a refusal where the maps could be differentiated.

    ``values``: the params' leaves, where the caller has them.

    Raises:
        NotImplementedError: under a functorch ``grad``/``vjp``/``jvp`` of the call, or for
            params that require grad while grad mode is on
            (NOTE [replaced derivatives are not differentiated]).
    """
    compiling = torch.compiler.is_compiling()  # (tracing: no functorch level to inspect, plain flags read)
    if not compiling:
        _refuse_outer_differentiation(caller, params, inputs)
    if not torch.is_grad_enabled():
        return inputs
    if _traced_requires_grad(params) if compiling else _requires_grad(params, values):
        raise NotImplementedError(
            f"{caller}: params require grad (e.g. TensorDict.from_module(model) holds the model's Parameters), so "
            "the maps would carry a gradient in them, and it would be wrong: the backward replaces modules' "
            "derivatives (NOTE [replaced derivatives are not differentiated]). Pass detached params "
            f"(tdhook_fn.params(model) gives them), or call {caller} under torch.no_grad()")
    needs_grad = _traced_requires_grad(inputs) if compiling else _inputs_require_grad(inputs)
    return inputs.detach() if needs_grad else inputs


def _traced_requires_grad(td: Any) -> bool:
    """Whether a tensor of ``td`` requires grad, read as torch.compile traces it (no functorch wrapper test)."""
    return isinstance(td, TensorDictBase) and any(
        isinstance(v, torch.Tensor) and v.requires_grad for v in td.values(True, True))


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


def refuse_level_zero_graph(caller: str, maps: TensorDictBase) -> None:
    """Raise when a map carries a regular-autograd graph all the same (a closed-over tensor that requires grad)."""
    if any(t.requires_grad for t in maps.values(True, True)):
        raise NotImplementedError(
            f"{caller}: the maps require grad: a tensor that requires grad reached them through the target, the "
            "cotangents or a tap (a closed-over tensor), and their gradient would be wrong (a replaced derivative "
            f"would be differentiated again). Detach it, or call {caller} under torch.no_grad()")


def replaces_any(taps: Sequence[Tap]) -> bool:
    """Whether one of ``taps`` stands in for a module's derivative (callers with no taps need not ask)."""
    for tap in taps:  # (a loop: a generator in ``any`` costs a call per tap)
        if tap.replaces_derivative:
            return True
    return False


def values_where_replaced(caller: str, params: Any, inputs: TensorDictBase, taps: Sequence[Tap]) -> TensorDictBase:
    """``inputs`` as `as_values` gives them where one of ``taps`` replaces a derivative; as they are elsewhere.

    For a method that multiplies its maps by the inputs after the engine: the product must
    carry no graph either (NOTE [replaced derivatives are not differentiated]).
    """
    return as_values(caller, params, inputs) if taps and replaces_any(taps) else inputs
