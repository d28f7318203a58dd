"""LRP on a chain of modules: relevance handed back module by module, no graph across modules."""

# NOTE [lrp on a chain]
# When ``f``'s model is a chain (a hook-free ``nn.Sequential``, NOTE [chains]), each
# module's output is the next module's input and nothing else. The relevance arriving at
# a module's output is then known when the walk back reaches it, and the module's rule can
# be applied to it directly, the modules taken last to first:
#
# - a gradient-form rule (NOTE [gradient-form rules]) and a module without a rule: the
#   module's own Jacobian, as a graph from a fresh leaf input to its output (one per
#   module), with the rule's output factor and input scaling as plain products;
# - Pass: the relevance as it is;
# - any other rule: ``rule.relevance`` on what the module saw, as in the backward of
#   `_RuleVJP`.
#
# Modules whose backward is known run without a graph: linear layers and convolutions
# (their adjoint is one op, NOTE [affine modules]; z+ and alpha-beta take every ``z`` from
# one op, NOTE [fused alpha-beta]), max pooling (its gradient is a scatter to the maxima,
# found by the kernel autograd uses, so ties go where they go there), and torch's own
# activations and reshapes (not in place: they never write their input).
#
# These are the taps' numbers (NOTE [lrp as modified vjps]) without what carries them
# through one autograd graph: no zero-valued carriers, no Function per rule, no taps.
# Measured on the benchmarks at batch 64 (EpsilonPlus, warm, one target, CPU time, input-only
# gradient as the unit): 1.24x-1.32x on the MLP and 1.25x-1.31x on the CNN (2026-12-02,
# planned, NOTE [a planned walk]), where the taps take 2.5x and 2.4x. With
# ``per_target`` the taps are faster (one pullback per target, where the walk would take
# one per module). An int target puts in its one-hot directly, without a graph.
# Every other module runs on a fresh leaf that requires grad, as on the taps' graph, so an
# unannounced in-place write to a module's input fails as it does there, and never writes
# the caller's tensors; modules with ``inplace=True`` get a copy, as with the taps. Rules
# are found by module identity: a module the chain runs twice has its rule both times.
#
# Anything else takes the general path, which gives the same maps: a functorch transform,
# ``per_target``, taps, layers, a rule inside a block that is not a ``Sequential`` (the
# walk cannot see it), a rule on the root, an input or output that is not one
# floating-point tensor, a step whose output does not depend on its input or that raises,
# a tensor the walk reads that a later module wrote in place, or a target that closes
# over a tensor requiring grad. A walk given up after the forward puts the random state
# back, so that dropout draws the same masks on the general path.

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from ..._functional import Functional, NestedKey
from ..._params import Key, leaves
from ..._targets import Target
from ..._vjp import reaches_other_leaves
from .._checks import check_call
from .._engine import Cotangents, offered_targets, seed_cotangents, unflatten
from .affine import Affine, affine_of
from .checks import check_module_call, check_pass
from .composites import ACTIVATIONS
from .gradient_form import gradient_form
from .max_pool import MAX_POOLS, max_pool_with_indices
from .model_chain import Link, reads_one_key, run_chain
from .module_call import ModuleCall, Template
from .plan import LrpPlan
from .records import Local, NotAChain, Passed, Pooled, Record, Reshaped, Ruled, affine_record
from .rules import AlphaBeta, Pass, Rule
from .walk import ACTIVATION_OPS, RESHAPES, Back, Planned, own_values, run_planned, slots_of

__all__ = ["chain_lrp"]


def _known(module: nn.Module, classes: tuple[type[nn.Module], ...]) -> bool:
    """Whether ``module`` is exactly one of torch's ``classes``, with their forward and not in place.

    Such a module never writes its input and its output depends on it, so it runs
    without the leaf and the graph that catch other modules doing so.
    """
    return type(module) in classes and "forward" not in module.__dict__ and not getattr(module, "inplace", False)


@dataclass(frozen=True)
class _Kind:
    """How the walk runs a module: ``"affine"``, ``"pool"``, ``"pass"``, ``"reshape"``, or with its own ``"graph"``."""

    name: str
    affine: Affine | None = None
    pool: tuple[int, Callable[..., Any]] | None = None


_PASS, _RESHAPE, _GRAPH = _Kind("pass"), _Kind("reshape"), _Kind("graph")


def _kind(module: nn.Module, rule: Rule | None) -> _Kind:
    """How the walk runs ``module`` with ``rule``: its backward known (no graph), or by its own graph."""
    state = module.__dict__
    if not isinstance(rule, Pass):
        affine = affine_of(type(module), state, state["_parameters"])
        if affine is not None:
            return _Kind("affine", affine)
    if rule is None and "forward" not in state:
        pool = MAX_POOLS.get(type(module))
        if pool is not None and state.get("return_indices") is False:
            return _Kind("pool", pool=pool)
    if isinstance(rule, Pass) and _known(module, ACTIVATIONS):
        return _PASS
    if rule is None and _known(module, RESHAPES):
        return _RESHAPE
    return _GRAPH


class _Steps:
    """The forward of the chain, one module at a time, recording how each hands relevance back.

    Modules of known backward run without a graph (NOTE [lrp on a chain]). Every other
    module runs on a fresh leaf that requires grad, as on the taps' graph: a module that
    writes its input in place without saying so (no ``inplace=True``) raises there as
    here, and never writes the caller's tensors.
    """

    def __init__(self, ruled: dict[int, tuple[str, Rule]]):  # by module identity
        self.ruled = ruled
        self.records: list[Record] = []

    def rule_of(self, link: Link) -> tuple[str, Rule | None]:
        return self.ruled.get(id(link[1]), ("", None))  # (the path only names ruled modules)

    def __call__(self, link: Link, module: nn.Module, h: Any, own: dict[str, torch.Tensor] | None = None,
                 kind: _Kind | None = None) -> torch.Tensor:
        """One module's forward, under ``no_grad``; ``own``: its parameters where ``module`` is the model's own."""
        if not (isinstance(h, torch.Tensor) and h.is_floating_point()):
            raise NotAChain
        path, rule = self.rule_of(link)
        kind = _kind(module, rule) if kind is None else kind
        state = module.__dict__
        if kind.affine is not None:
            tensors = state["_parameters"] if own is None else own
            return self._affine_step(path, rule, module, kind.affine, h.detach(), tensors)
        if kind.pool is not None:  # (the kernel autograd runs: ties go to the same input)
            out, indices = max_pool_with_indices(kind.pool[1], h, state)  # NOTE [max pooling in channels-last]
            self.records.append(Pooled(h.shape, indices, kind.pool[0]))
            return out
        if kind is _PASS or kind is _RESHAPE:
            # torch's own class, no instance forward, and the chain is hook-free: its forward is the call
            out = type(module).forward(module, h)
            if kind is _RESHAPE:
                self.records.append(Reshaped(h.shape))
            else:
                check_pass(path, (h,), out)
                self.records.append(Passed(out, out._version))
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
            raise NotAChain from e
        if rule is not None:
            check_module_call(path, (x,), {}, y)
        if not (isinstance(y, torch.Tensor) and y.requires_grad):
            raise NotAChain
        out = y.detach()
        output_factor = getattr(rule, "output_factor", None)  # the gradient form (NOTE [gradient-form rules])
        if rule is None or callable(output_factor):
            factor = None if output_factor is None else output_factor(path, 1, out)
            self.records.append(Local(x, y, factor, bool(getattr(rule, "scales_inputs", False)), y._version))
        elif isinstance(rule, Pass):
            check_pass(path, (x,), y)
            self.records.append(Passed(out, out._version))
        else:
            self._ruled(path, rule, module, x.detach(), out, None)
        return out

    def _affine_step(self, path: str, rule: Rule | None, module: nn.Module, affine: Affine, x: torch.Tensor,
                     own: Mapping[str, torch.Tensor | None]) -> torch.Tensor:
        """A linear layer or a convolution: run without a graph, its adjoint is one op (NOTE [affine modules])."""
        weight, bias = own["weight"], own.get("bias")
        assert weight is not None  # (affine_of asks for one)
        done = affine_record(affine, gradient_form(rule), rule, path, x, weight, bias)
        if done is not None:
            self.records.append(done[1])
            return done[0]
        y = affine.run(x, weight, bias)
        assert rule is not None  # (no rule is the gradient form's)
        self._ruled(path, rule, module, x, y, own)
        return y

    def _ruled(self, path: str, rule: Rule, module: nn.Module, x: torch.Tensor, y: torch.Tensor,
               own: Mapping[str, torch.Tensor | None] | None) -> None:
        """Record ``rule.relevance`` on what ``module`` saw; ``own``: its parameters, if not its own slots'."""
        tensors: list[torch.Tensor] = []
        template = Template.of(module, tensors)
        slots = module.__dict__["_parameters"]
        if own is not None and own is not slots:  # the model's own module (it holds no buffer): the call's tensors
            tensors = [cast(torch.Tensor, own[name]) for name, t in slots.items() if t is not None]
        call = ModuleCall(path, (x,), y, template, tuple(tensors), {})
        self.records.append(Ruled(rule, call, (x._version, y._version)))


def _planned(model: nn.Module, links: list[Link], kinds: list[_Kind],
             by_module: dict[int, tuple[str, Rule]]) -> list[Planned] | None:
    """Each link as the walk from the params runs it, where it needs no shadow (NOTE [walks without a shadow])."""
    # NOTE [walks without a shadow]
    # The call's shadow (NOTE [shadow modules]) puts the params in private copies of the
    # modules, so that a module's forward computes with them and never with the model's.
    # On the walk a linear layer or a convolution is computed from its tensors directly,
    # and the other modules of known backward (pooling, torch's activations and reshapes)
    # hold no tensor at all: their forward reads plain attributes only, and runs on the
    # model's own module without changing it. Where every link is such a module, and the
    # params hold exactly those layers' tensors in the model's shapes, the walk takes the
    # tensors from the params and needs no shadow (~0.1 ms a call on the benchmarks'
    # MLP). Anything else (a buffer, a parameter elsewhere, a module of another kind, a
    # key or shape that differs: the shadow names what is wrong) takes the shadow.
    if any(m.__dict__["_parameters"] or m.__dict__["_buffers"] for m in _containers(model)):
        return None
    planned = []
    for link, kind in zip(links, kinds, strict=True):
        name, module = link
        state = module.__dict__
        if kind is _GRAPH or state["_buffers"] or (kind.affine is None and state["_parameters"]):
            return None
        slots = slots_of(name, module)
        path, rule = by_module.get(id(module), ("", None))
        if kind.affine is not None:
            planned.append(_plan_affine(link, path, rule, kind.affine, slots))
        elif kind is _PASS:
            op = ACTIVATION_OPS.get(type(module)) or functools.partial(type(module).forward, module)
            planned.append(Planned("pass", link, path, rule, op=op))
        else:
            planned.append(Planned(kind.name, link, path, rule, pool=kind.pool))
    return planned


def _plan_affine(link: Link, path: str, rule: Rule | None, affine: Affine,
                 slots: tuple[tuple[str, Key], ...]) -> Planned:
    """As `_Steps._affine_step` runs it: a gradient-form rule (or none), fused alpha-beta, or the rule's own."""
    form = gradient_form(rule)
    if form is None and not (type(rule) is AlphaBeta and affine.groups == 1):
        return Planned("general", link, path, rule, slots)
    return Planned("affine", link, path, rule, slots, affine, form)


def _containers(model: nn.Module) -> list[nn.Module]:
    """The nested ``Sequential`` s of a chain, the root first."""
    found = [model]
    for module in found:
        found.extend(m for m in module._modules.values() if isinstance(m, nn.Sequential))
    return found


@dataclass(frozen=True)
class _Walk:
    """The walk's plan of a chain: each link's kind, whether it draws at random, and the walk from the params."""

    links: list[Link]
    kinds: list[_Kind]
    random: bool  # a walk given up gives the taps the random state it found (dropout); known modules draw none
    planned: list[Planned] | None  # None: on a shadow


def _walk_of(model: nn.Module, links: list[Link], by_module: dict[int, tuple[str, Rule]]) -> _Walk:
    kinds = [_kind(module, by_module.get(id(module), ("", None))[1]) for _, module in links]
    random = any(kind is _GRAPH or isinstance(link[1], nn.RReLU) for link, kind in zip(links, kinds, strict=True))
    return _Walk(links, kinds, random, _planned(model, links, kinds, by_module))


def _forward(f: Functional, params: TensorDictBase, flat: TensorDictBase, key: NestedKey, walk: _Walk,
             by_module: dict[int, tuple[str, Rule]], backs: list[Back],
             values: Mapping[Key, Any] | None) -> torch.Tensor:
    """The chain's output, each link's pullback put in ``backs``: from the params directly where it can, else on a
    shadow."""
    steps = _Steps(by_module)
    own = None if walk.planned is None else own_values(leaves(params) if values is None else values, walk.planned)
    if own is None or walk.planned is None:
        h = run_chain(f, params, flat, walk.links, steps).get(f.out_keys[0])
        backs.extend(record.back for record in steps.records)
    else:

        def general(step: Planned, x: torch.Tensor, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, Back]:
            own = dict(zip((slot for slot, _ in step.slots), tensors, strict=True))
            out = steps(step.link, step.link[1], x, own)
            return out, steps.records.pop().back

        h = run_planned(walk.planned, flat.get(key), own, backs, general)
    if not (isinstance(h, torch.Tensor) and h.shape[:1] == flat.batch_size):
        raise NotAChain  # (an output without the batch: the general path says what is wrong)
    return h


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


def _put_in(f: Functional, y: torch.Tensor, flat: TensorDictBase, key: NestedKey, batch: torch.Size,
            target: Target, cotangents: Cotangents | None) -> tuple[torch.Tensor, Callable[[], TensorDictBase]]:
    """The relevance put in at the chain's output ``y``, and the target values (made when asked).

    An int target selects one class of the output: what it puts in there is a one-hot,
    with no graph (saves the target's TensorDicts and a backward, ~0.2 ms a call). Others
    as the engine offers them, and a pullback to the output.
    """
    if (isinstance(target, int) and not isinstance(target, bool) and cotangents is None and y.dim() == 2
            and -y.shape[1] <= target < y.shape[1]):  # (else the engine's selection says what is wrong)
        seed = torch.zeros_like(y)
        seed.select(1, target).fill_(1.0)
        return seed, lambda: TensorDict({f.out_keys[0]: y.detach()[:, target].reshape(batch)}, batch_size=batch)
    y = y.detach()  # (a new alias: the chain's output may be the caller's tensor, an identity's)
    with torch.enable_grad():
        y.requires_grad_()
        out = TensorDict({f.out_keys[0]: y}, batch_size=flat.batch_size)
        values = offered_targets(f, out, flat, (key,), batch, target)
    keys = list(values.keys(True, True))
    tensors = [values.get(k) for k in keys]
    if reaches_other_leaves(tensors, [y]):
        raise NotAChain  # a closed-over tensor that requires grad: the taps refuse it
    cot, _ = seed_cotangents(values, False, cotangents)
    (relevance,) = torch.autograd.grad(tensors, y, [cot.get(k) for k in keys], allow_unused=True,
                                       materialize_grads=True)
    return relevance, lambda: values


def chain_lrp(f: Functional, params: TensorDictBase, inputs: TensorDictBase, key: NestedKey, target: Target,
              plan: LrpPlan, cotangents: Cotangents | None, values: Mapping[Key, Any] | None = None,
              ) -> tuple[TensorDict, Callable[[], TensorDictBase]] | None:
    """LRP maps of input ``key`` by the walk of NOTE [lrp on a chain], and the target values (made when asked).

    ``None`` where the walk does not apply. Rules are looked up by module
    (``plan.ruled.by_module``): a module the chain runs twice has its rule both times.
    ``values``: the params' leaves, where the caller has them.
    """
    links = plan.links
    if links is None or not reads_one_key(f) or key != f.in_keys[0]:
        return None  # (a rule on the root: the taps run the whole model as one ruled module)
    check_call("lrp", f, params, inputs, (key,), target, modes=False)
    plan.check_modes(f.model, "lrp")
    by_module = plan.ruled.by_module
    walk = plan.walk
    if walk is None:
        walk = plan.walk = _walk_of(f.model, links, by_module)
    batch = inputs.batch_size
    flat = inputs if len(batch) == 1 else inputs.reshape(-1)
    rng = _RandomState(flat.get(key).device) if walk.random else None
    backs: list[Back] = []
    try:
        # (the steps that need a graph turn it on for their module, and so does a target that needs one;
        # the rules run as in a backward)
        with torch.no_grad():
            y = _forward(f, params, flat, key, walk, by_module, backs, values)
            relevance, targets = _put_in(f, y, flat, key, batch, target, cotangents)
            for back in reversed(backs):
                relevance = back(relevance)
        if relevance.requires_grad:  # (never: the walk runs without a graph; the general path says what is wrong)
            raise NotAChain
    except NotAChain:
        if rng is not None:
            rng.restore()
        return None
    maps = relevance if len(batch) == 1 else unflatten(relevance, 0, batch)
    return TensorDict({key: maps}, batch_size=batch), targets
