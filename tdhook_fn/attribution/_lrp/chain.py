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
# gradient as the unit): 1.16x-1.28x on the MLP and 1.06x-1.27x on the CNN in nine runs
# (2026-12-03, bound, NOTE [a bound walk]), where the taps take 2.5x and 2.4x. With
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
# over a tensor requiring grad; and what changes autograd's numbers (autocast, anomaly
# mode, forward AD, saved-tensor hooks: as the other walks,
# NOTE [a chain walked by hand]). A walk given up after the forward puts the random state
# back, so that dropout draws the same masks on the general path.

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from ..._functional import Functional, fresh_tensordict
from ..._params import Key, leaves
from ..._targets import Target
from ..._types import NestedKey, Pullback
from ..._vjp import RandomState, autograd_as_walked, reaches_other_leaves
from .._engine import Cotangents, seed_cotangents, unflatten
from .._inputs import check_call
from .._target_values import offered_targets
from .bound import run_bound
from .model_chain import reads_one_key, run_chain
from .plan import LrpPlan
from .records import NotAChain
from .rules import Rule
from .steps import Steps
from .walk import Planned, own_values, run_planned
from .walk_plan import Walk, walk_of

__all__ = ["chain_lrp"]


def _forward(f: Functional, params: TensorDictBase, flat: TensorDictBase, key: NestedKey, walk: Walk,
             by_module: dict[int, tuple[str, Rule]], backs: list[Pullback], values: Mapping[Key, Any] | None,
             one_hot: bool, caller: str) -> torch.Tensor:
    """The chain's output, each link's pullback put in ``backs``: from the params directly where it can (bound where
    the target is ``one_hot``, NOTE [a bound walk]), else on a shadow."""
    own = None if walk.planned is None else own_values(leaves(params) if values is None else values, walk.planned)
    if own is None or walk.planned is None:
        steps = Steps(by_module, caller)
        h = run_chain(f, params, flat, walk.links, steps).get(f.out_keys[0])
        backs.extend(record.back for record in steps.records)
    elif one_hot and walk.bound is not None:
        h = run_bound(walk.bound, flat.get(key), own, backs)
    else:
        steps = Steps(by_module, caller)

        def general(step: Planned, x: torch.Tensor, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, Pullback]:
            own = dict(zip((slot for slot, _ in step.slots), tensors, strict=True))
            out = steps(step.link, step.link[1], x, own)
            return out, steps.records.pop().back

        h = run_planned(walk.planned, flat.get(key), own, backs, general)
    if not (isinstance(h, torch.Tensor) and h.shape[:1] == flat.batch_size):
        raise NotAChain  # (an output without the batch: the general path says what is wrong)
    return h


def _one_hot(target: Target, cotangents: Cotangents | None) -> bool:
    """Whether an int ``target`` puts in a one-hot (where it selects a class: `_put_in`), running no code of the
    caller's."""
    return isinstance(target, int) and not isinstance(target, bool) and cotangents is None


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


def chain_lrp(caller: str, f: Functional, params: TensorDictBase, inputs: TensorDictBase, key: NestedKey,
              target: Target, plan: LrpPlan, cotangents: Cotangents | None, values: Mapping[Key, Any] | None = None,
              ) -> tuple[TensorDict, Callable[[], TensorDictBase]] | None:
    """LRP maps of input ``key`` by the walk of NOTE [lrp on a chain], and the target values (made when asked).

    ``None`` where the walk does not apply. Rules are looked up by module
    (``plan.ruled.by_module``): a module the chain runs twice has its rule both times.
    ``values``: the params' leaves, where the caller has them.
    """
    links = plan.links
    if links is None or not reads_one_key(f) or key != f.in_keys[0]:
        return None  # (a rule on the root: the taps run the whole model as one ruled module)
    check_call(caller, f, params, inputs, (key,), target, modes=False)
    plan.check_modes(f.model, caller)
    first = inputs.get(key)
    if isinstance(first, torch.Tensor) and not autograd_as_walked(first.device.type):
        return None
    by_module = plan.ruled.by_module
    walk = plan.walk
    if walk is None:
        walk = plan.walk = walk_of(f.model, links, by_module)
    batch = inputs.batch_size
    flat = inputs if len(batch) == 1 else inputs.reshape(-1)
    rng = RandomState() if walk.random else None
    backs: list[Pullback] = []
    # (the steps that need a graph turn it on for their module, and so does a target that needs one; the rules run
    # as in a backward. Grad mode set and put back by two calls: ``no_grad()`` as a context costs seven)
    grad_mode = torch.is_grad_enabled()
    torch.set_grad_enabled(False)
    try:
        y = _forward(f, params, flat, key, walk, by_module, backs, values, _one_hot(target, cotangents), caller)
        relevance, targets = _put_in(f, y, flat, key, batch, target, cotangents)
        for back in reversed(backs):
            relevance = back(relevance)
        if relevance.requires_grad:  # (never: the walk runs without a graph; the general path says what is wrong)
            raise NotAChain
    except NotAChain:
        if rng is not None:
            rng.restore()
        return None
    finally:
        torch.set_grad_enabled(grad_mode)
    maps = relevance if len(batch) == 1 else unflatten(relevance, 0, batch)
    return fresh_tensordict({key: maps}, batch), targets  # (one map of the inputs' batch)
