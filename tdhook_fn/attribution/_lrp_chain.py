"""LRP on a chain of modules: relevance handed back module by module, no graph across modules.

# NOTE [lrp on a chain]
When ``f``'s model is a chain (a hook-free ``nn.Sequential``, NOTE [chains]), each
module's output is the next module's input and nothing else. The relevance arriving at
a module's output is then known when the walk back reaches it, and the module's rule can
be applied to it directly, the modules taken last to first:

- a gradient-form rule (NOTE [gradient-form rules]) and a module without a rule: the
  module's own Jacobian, as a graph from a fresh leaf input to its output (one per
  module), with the rule's output factor and input scaling as plain products;
- Pass: the relevance as it is;
- any other rule: ``rule.relevance`` on what the module saw, as in the backward of
  :class:`_RuleVJP`.

Modules whose backward is known run without a graph: linear layers and convolutions
(their adjoint is one op, NOTE [affine modules]; z+ and alpha-beta take every ``z`` from
one op, NOTE [fused alpha-beta]), max pooling (its gradient is a scatter to the maxima,
found by the kernel autograd uses, so ties go where they go there), and torch's own
activations and reshapes (not in place: they never write their input).

These are the taps' numbers (NOTE [lrp as modified vjps]) without what carries them
through one autograd graph: no zero-valued carriers, no Function per rule, no taps.
Measured on the benchmarks at batch 64 (EpsilonPlus, warm, one target): 1.2-1.4x a plain
gradient on the MLP and on the CNN, where the taps take 2.5x and 2.4x. With
``per_target`` the taps are faster (one pullback per target, where the walk would take
one per module). An int target puts in its one-hot directly, without a graph.
Every other module runs on a fresh leaf that requires grad, as on the taps' graph, so an
unannounced in-place write to a module's input fails as it does there, and never writes
the caller's tensors; modules with ``inplace=True`` get a copy, as with the taps. Rules
are found by module identity: a module the chain runs twice has its rule both times.

Anything else takes the general path, which gives the same maps: a functorch transform,
``per_target``, taps, layers, a rule inside a block that is not a ``Sequential`` (the
walk cannot see it), a rule on the root, an input or output that is not one
floating-point tensor, a step whose output does not depend on its input or that raises,
a tensor the walk reads that a later module wrote in place, or a target that closes
over a tensor requiring grad. A walk given up after the forward puts the random state
back, so that dropout draws the same masks on the general path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase
from torch import nn

from .._chain import Link, chain_of, run_chain
from .._functional import Functional, NestedKey
from .._targets import Target
from .._vjp import reaches_other_leaves
from ._checks import check_call
from ._engine import Cotangents, Gradients, offered_targets, seed_cotangents, unflatten
from ._lrp_affine import Adjoint, Affine, affine_of
from ._lrp_call import ModuleCall, Template
from ._lrp_checks import check_module_call, check_pass
from ._lrp_composites import ACTIVATIONS, Resolved
from ._lrp_fused import Pullback, fused
from ._lrp_rules import Pass, Rule

__all__ = ["chain_lrp"]


class _NotAChain(Exception):
    """This call takes the general path (NOTE [lrp on a chain])."""


def _unwritten(tensors: tuple[torch.Tensor, ...], versions: tuple[int, ...]) -> None:
    """Leave the walk for the general path if a later module wrote one of ``tensors`` in place."""
    if tuple(t._version for t in tensors) != versions:
        raise _NotAChain


@dataclass(frozen=True)
class _Local:
    """A module's own Jacobian from ``x`` to ``y``; the relevance scaled by ``factor`` before, by ``x`` after."""

    x: torch.Tensor
    y: torch.Tensor
    factor: torch.Tensor | None
    scales_inputs: bool
    version: int

    def back(self, relevance: torch.Tensor) -> torch.Tensor:
        _unwritten((self.y,), (self.version,))
        share = relevance if self.factor is None else relevance * self.factor
        (c,) = torch.autograd.grad(self.y, self.x, share, allow_unused=True, materialize_grads=True)
        return self.x.detach() * c if self.scales_inputs else c


@dataclass(frozen=True)
class _Passed:
    """Pass: the relevance as it is, unless a later module wrote the output in place (the taps differ then)."""

    y: torch.Tensor
    version: int

    def back(self, relevance: torch.Tensor) -> torch.Tensor:
        _unwritten((self.y,), (self.version,))
        return relevance


@dataclass(frozen=True)
class _Ruled:
    """A rule's relevance on what its module saw; the tensors' versions as they were then."""

    rule: Rule
    call: ModuleCall
    versions: tuple[int, ...]

    def back(self, relevance: torch.Tensor) -> torch.Tensor:
        (x,), y = self.call.inputs, self.call.output
        _unwritten((x, y), self.versions)
        relevances = list(self.rule.relevance(self.call, relevance))
        if len(relevances) != 1:
            raise ValueError(f"lrp: the rule at {self.call.path!r} returned {len(relevances)} relevances for 1 input")
        return torch.zeros_like(x) if relevances[0] is None else relevances[0]


@dataclass(frozen=True)
class _AffineLocal:
    """:class:`_Local` for a linear layer or a convolution: ``J^T`` is one op (NOTE [affine modules])."""

    x: torch.Tensor
    adjoint: Adjoint
    share: tuple[bool, torch.Tensor] | None  # (divides, by): the rule's output factor, or its divisor
    scales_inputs: bool
    version: int

    def back(self, relevance: torch.Tensor) -> torch.Tensor:
        _unwritten((self.x,), (self.version,))
        if self.share is not None:
            divides, by = self.share
            relevance = relevance / by if divides else relevance * by
        c = self.adjoint(relevance, self.x.shape)
        return self.x * c if self.scales_inputs else c


@dataclass(frozen=True)
class _Fused:
    """A rule's relevance by a pullback prepared in the forward (NOTE [fused alpha-beta])."""

    pull: Pullback
    x: torch.Tensor
    y: torch.Tensor
    versions: tuple[int, ...]

    def back(self, relevance: torch.Tensor) -> torch.Tensor:
        _unwritten((self.x, self.y), self.versions)
        return self.pull(relevance)


@dataclass(frozen=True)
class _Reshaped:
    """A flatten, unflatten or identity: the relevance reshaped back to the input's shape."""

    shape: torch.Size

    def back(self, relevance: torch.Tensor) -> torch.Tensor:
        return relevance.reshape(self.shape)


@dataclass(frozen=True)
class _Pooled:
    """Max pooling: each window's relevance goes to the input its maximum came from, as its gradient does."""

    shape: torch.Size
    indices: torch.Tensor  # of each maximum, flat within its channel's input plane
    dims: int  # of the plane

    def back(self, relevance: torch.Tensor) -> torch.Tensor:
        plane = relevance.new_zeros(self.shape).flatten(-self.dims)
        return plane.scatter_add_(-1, self.indices.flatten(-self.dims), relevance.flatten(-self.dims)).view(self.shape)


_Record = _Local | _AffineLocal | _Passed | _Ruled | _Fused | _Reshaped | _Pooled

_RESHAPES = (nn.Flatten, nn.Unflatten, nn.Identity)
_MAX_POOLS: dict[type[nn.Module], tuple[int, Callable[..., Any]]] = {
    nn.MaxPool1d: (1, F.max_pool1d), nn.MaxPool2d: (2, F.max_pool2d), nn.MaxPool3d: (3, F.max_pool3d)}


def _known(module: nn.Module, classes: tuple[type[nn.Module], ...]) -> bool:
    """Whether ``module`` is exactly one of torch's ``classes``, with their forward and not in place.

    Such a module never writes its input and its output depends on it, so it runs
    without the leaf and the graph that catch other modules doing so.
    """
    return type(module) in classes and "forward" not in module.__dict__ and not getattr(module, "inplace", False)


class _Steps:
    """The forward of the chain, one module at a time, recording how each hands relevance back.

    Every module runs on a fresh leaf that requires grad, as on the taps' graph: a module
    that writes its input in place without saying so (no ``inplace=True``) raises there
    as here, and never writes the caller's tensors.
    """

    def __init__(self, ruled: dict[int, tuple[str, Rule]]):  # by module identity
        self.ruled = ruled
        self.records: list[_Record] = []

    def __call__(self, link: Link, module: nn.Module, h: Any) -> torch.Tensor:
        """One module's forward (run under ``no_grad``: only modules of unknown backward get a graph)."""
        if not (isinstance(h, torch.Tensor) and h.is_floating_point()):
            raise _NotAChain
        path, rule = self.ruled.get(id(link[1]), ("", None))  # (the path only names ruled modules)
        state = module.__dict__
        affine = None if isinstance(rule, Pass) else affine_of(type(module), state, state["_parameters"])
        if affine is not None:
            return self._affine_step(path, rule, module, affine, h.detach())
        pool = _MAX_POOLS.get(type(module)) if rule is None and "forward" not in state else None
        if pool is not None and state.get("return_indices") is False:
            # (the kernel autograd runs: ties go to the same input)
            out, indices = pool[1](h, state["kernel_size"], state["stride"], state["padding"], state["dilation"],
                                   ceil_mode=state["ceil_mode"], return_indices=True)
            self.records.append(_Pooled(h.shape, indices, pool[0]))
            return cast(torch.Tensor, out)
        if (isinstance(rule, Pass) and _known(module, ACTIVATIONS)) or (rule is None and _known(module, _RESHAPES)):
            out = module(h)
            if rule is None:
                self.records.append(_Reshaped(h.shape))
            else:
                check_pass(path, (h,), out)
                self.records.append(_Passed(out, out._version))
            return cast(torch.Tensor, out)
        return self._step_with_graph(path, rule, module, h)

    def _step_with_graph(self, path: str, rule: Rule | None, module: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """Any other module: on a fresh leaf that requires grad, its own graph for its backward."""
        writes = getattr(module, "inplace", False) is True  # it gets a copy (NOTE [lrp on a chain])
        x = h.detach().requires_grad_()
        try:
            with torch.enable_grad():
                y = module(x.clone() if writes else x)
        except RuntimeError as e:  # e.g. an unannounced in-place write to the leaf; a real error comes again
            raise _NotAChain from e
        if rule is not None:
            check_module_call(path, (x,), {}, y)
        if not (isinstance(y, torch.Tensor) and y.requires_grad):
            raise _NotAChain
        out = y.detach()
        output_factor = getattr(rule, "output_factor", None)  # the gradient form (NOTE [gradient-form rules])
        if rule is None or callable(output_factor):
            factor = None if output_factor is None else output_factor(path, 1, out)
            self.records.append(_Local(x, y, factor, bool(getattr(rule, "scales_inputs", False)), y._version))
        elif isinstance(rule, Pass):
            check_pass(path, (x,), y)
            self.records.append(_Passed(out, out._version))
        else:
            tensors: list[torch.Tensor] = []
            template = Template.of(module, tensors)
            seen = x.detach()
            call = ModuleCall(path, (seen,), out, template, tuple(tensors), {})
            self.records.append(_Ruled(rule, call, (seen._version, out._version)))
        return out

    def _affine_step(self, path: str, rule: Rule | None, module: nn.Module, affine: Affine,
                     x: torch.Tensor) -> torch.Tensor:
        """A linear layer or a convolution: run without a graph, its adjoint is one op (NOTE [affine modules])."""
        weight, bias = module._parameters["weight"], module._parameters.get("bias")
        assert weight is not None  # (affine_of asks for one)
        done = None if rule is None else fused(rule, affine, x, weight, bias)
        y = affine.run(x, weight, bias) if done is None else done[0]
        if done is not None:
            self.records.append(_Fused(done[1], x, y, (x._version, y._version)))
            return y
        output_factor = getattr(rule, "output_factor", None)
        if rule is None or callable(output_factor):
            divisor = getattr(rule, "output_divisor", None)  # one division in the walk, not 1 / d and a product
            share = (None if output_factor is None else
                     (True, divisor(path, 1, y)) if callable(divisor) else (False, output_factor(path, 1, y)))
            scales = bool(getattr(rule, "scales_inputs", False))
            self.records.append(_AffineLocal(x, affine.adjoint(weight, fast=True), share, scales, x._version))
        else:
            tensors: list[torch.Tensor] = []
            call = ModuleCall(path, (x,), y, Template.of(module, tensors), tuple(tensors), {})
            self.records.append(_Ruled(rule, call, (x._version, y._version)))
        return y


class _RandomState:
    """The CPU generator's state, and the CUDA one of the inputs' device where they are on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.device = device

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


def _rule_below(links: list[Link], ruled: dict[int, tuple[str, Rule]]) -> bool:
    """Whether a rule sits inside a link (a non-Sequential block), where the walk would not see it."""
    return any(id(m) in ruled for _, link in links for m in link.modules() if m is not link)


def _put_in(f: Functional, out: TensorDictBase, flat: TensorDictBase, key: NestedKey, batch: torch.Size,
            target: Target, cotangents: Cotangents | None) -> tuple[torch.Tensor, TensorDictBase]:
    """The relevance put in at the chain's output, and the target values.

    An int target selects one class of the output: what it puts in there is a one-hot,
    with no graph (saves the target's TensorDicts and a backward, ~0.2 ms a call). Others
    as the engine offers them, and a pullback to the output.
    """
    y = out.get(f.out_keys[0]).detach()
    if (isinstance(target, int) and not isinstance(target, bool) and cotangents is None and y.dim() == 2
            and -y.shape[1] <= target < y.shape[1]):  # (else the engine's selection says what is wrong)
        seed = torch.zeros_like(y)
        seed[:, target] = 1.0
        return seed, TensorDict({f.out_keys[0]: y[:, target].reshape(batch)}, batch_size=batch)
    with torch.enable_grad():
        y.requires_grad_()
        out.set(f.out_keys[0], y)
        values = offered_targets(f, out, flat, (key,), batch, target)
    keys = list(values.keys(True, True))
    leaves = [values.get(k) for k in keys]
    if reaches_other_leaves(leaves, [y]):
        raise _NotAChain  # a closed-over tensor that requires grad: the taps refuse it
    cot, _ = seed_cotangents(values, False, cotangents)
    (relevance,) = torch.autograd.grad(leaves, y, [cot.get(k) for k in keys], allow_unused=True,
                                       materialize_grads=True)
    return relevance, values


def chain_lrp(f: Functional, params: TensorDictBase, inputs: TensorDictBase, key: NestedKey, target: Target,
              ruled: Resolved, cotangents: Cotangents | None) -> Gradients | None:
    """LRP maps of input ``key`` by the walk of NOTE [lrp on a chain]; ``None`` where it does not apply.

    Rules are looked up by module (``ruled.by_module``): a module the chain runs twice has
    its rule both times.
    """
    by_module = ruled.by_module
    links = chain_of(f, lambda _name, module: id(module) in by_module)
    if links is None or key != f.in_keys[0] or id(f.model) in by_module or _rule_below(links, by_module):
        return None  # (a rule on the root: the taps run the whole model as one ruled module)
    check_call("lrp", f, params, inputs, (key,))
    batch, flat = inputs.batch_size, inputs.reshape(-1)
    rng = _RandomState(flat.get(key).device)  # a walk given up gives the taps the random state it found (dropout)
    steps = _Steps(by_module)
    try:
        with torch.no_grad():  # (the steps that need a graph turn it on for their module)
            out = run_chain(f, params, flat, links, steps)
        relevance, values = _put_in(f, out, flat, key, batch, target, cotangents)
        with torch.no_grad():  # rules run as in a backward
            for record in reversed(steps.records):
                relevance = record.back(relevance)
    except _NotAChain:
        rng.restore()
        return None
    grads = TensorDict({key: unflatten(relevance, 0, batch)}, batch_size=batch)
    return Gradients(grads, TensorDict({}, batch_size=batch), values)
