"""A chain of modules walked by hand: one forward without a graph, then each link's backward by a rule's step."""

# NOTE [a chain walked by hand]
# Where the model is a chain (NOTE [chains]) of modules whose forward is one known op
# (linear layers and convolutions, NOTE [affine modules]; ReLU, LeakyReLU, Sigmoid, Tanh;
# max pooling; a softmax; reshapes; dropout in eval mode), a method whose backward is a
# rule per module needs neither autograd nor the model's shadow: `walk` runs each link's
# op on the inputs' rows (and DeepLift's references) without a graph, keeps what the
# link's rule needs, then pulls one seed per target back, link by link, to the stops
# asked for. The rules are steps: DeepLift's multipliers (NOTE [deeplift on a chain]), a
# gradient with each ReLU's rule in place (NOTE [gradient rules on a chain]). The links
# are planned once per model (NOTE [plans per model]); anything the plan or a step does not
# know makes the walk decline, and the method takes its general path. So does a mode that
# changes what autograd gives there: autocast (other dtypes), anomaly mode (it raises on a
# NaN), forward AD (tangents), saved-tensor hooks (what a backward reads).

# NOTE [seed rows]
# A target class ``i`` puts in a one-hot at the output; where the last module is a linear
# layer, its pullback ``onehot @ W`` is row ``i`` of ``W`` for every sample (the same
# numbers where ``W`` is finite: each is ``1 * w`` plus zeros; a non-finite weight of
# another class would put its NaN there, which the row leaves out). So the walk starts
# from the row, a view broadcast over the batch, and skips the one-hot, its writes and a
# matrix product. The row is the weight's own memory, so only where the next pullback
# other than a reshape (a view) makes a new tensor of it (an activation's product):
# nothing of the walk writes to it, and no map aliases it. The last layer's output is then
# never read, so its forward is skipped too (where its input fits its weight and bias in
# shape, dtype and device: else it runs, and its own error says what is wrong).

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase
from torch import nn

from .._functional import fresh_tensordict
from .._model_plans import plan_for
from .._params import Key, leaves
from .._paths import path_to_name, resolve_path
from .._targets import Target
from .._types import NestedKey, Pullback
from .._vjp import autograd_as_walked, untransformed
from ._lrp.affine import Affine, affine_of
from ._lrp.max_pool import MAX_POOLS, max_pool_with_indices
from ._lrp.model_chain import model_chain, reads_one_key
from ._lrp.plan import ModesChecked
from ._lrp.walk import RESHAPES, own_values, slots_of

__all__ = ["ACTIVATIONS", "SEED_BACK", "Step", "WalkLink", "WalkPass", "WalkPlan", "chain_gradient_passes",
           "chain_gradients", "chain_links", "holds_only", "tensor_plan", "walk", "walk_plan", "walked_map"]

# each activation's function (called directly: a module call costs more than the op on small tensors) and
# derivative, from its module, input and output
ACTIVATIONS: dict[type[nn.Module], tuple[Callable[[nn.Module, torch.Tensor], torch.Tensor],
                                          Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]]] = {
    nn.ReLU: (lambda _m, x: torch.relu(x), lambda _m, _x, y: y > 0),  # (a bool: where promotes it)
    nn.LeakyReLU: (lambda m, x: F.leaky_relu(x, m.__dict__["negative_slope"]),
                   # (the slope in x's dtype: a Python float in torch.where would round it to the default dtype)
                   lambda m, x, _y: torch.full_like(x, m.__dict__["negative_slope"]).masked_fill_(x > 0, 1.0)),
    nn.Sigmoid: (lambda _m, x: torch.sigmoid(x), lambda _m, _x, y: y * (1 - y)),
    nn.Tanh: (lambda _m, x: torch.tanh(x), lambda _m, _x, y: 1 - y * y),
}

@dataclass(frozen=True)
class WalkLink:
    """One link of the chain as the walk runs it: ``kind`` ``"affine"``, ``"activation"``, ``"pool"``,
    ``"softmax"`` or ``"reshape"``; ``slots``: ``(slot, key)`` of its tensors in the params."""

    kind: str
    module: nn.Module
    affine: Affine | None = None
    slots: tuple[tuple[str, Key], ...] = ()


def _link(name: str, module: nn.Module) -> WalkLink | None:
    """How the walk runs ``module`` (``None``: not a module it knows), as far as the model alone says."""
    cls, state = type(module), module.__dict__
    if "forward" in state or state.get("inplace", False) or state["_buffers"]:
        return None
    affine = affine_of(cls, state, state["_parameters"])
    if affine is not None:
        return WalkLink("affine", module, affine, slots_of(name, module))
    if state["_parameters"]:
        return None
    if cls in ACTIVATIONS:
        return WalkLink("activation", module)
    if cls in MAX_POOLS and state.get("return_indices") is False:
        return WalkLink("pool", module)
    if cls is nn.Softmax:
        return WalkLink("softmax", module)
    if cls in RESHAPES or (cls is nn.Dropout and not module.training):
        return WalkLink("reshape", module)
    return None


@dataclass
class WalkPlan(ModesChecked):
    """The walk's links (``None``: not a chain the walk knows), planned once per model (NOTE [plans per model])."""

    links: list[WalkLink] | None
    names: list[str]  # each link's name in the model (its path as `path_to_name` writes it)
    stops: dict[str, int | None] = field(default_factory=dict)  # the link each layer path names, as found
    # what a method derives from the links once (a walk's step for its options), kept with the links it reads
    derived: dict[Hashable, Any] = field(default_factory=dict)


def _plan(model: nn.Module) -> WalkPlan:
    chain = model_chain(model)
    links = None if chain is None else [_link(name, module) for name, module in chain]
    return WalkPlan(None if links is None or None in links else cast(list[WalkLink], links),
                        [] if chain is None else [name for name, _ in chain])


def walk_plan(f: Any) -> WalkPlan | None:
    """The plan of ``f``'s model (``None`` where ``f`` is not a Functional reading one key into one output)."""
    if not reads_one_key(f):
        return None
    return plan_for(f.model, "chain walk", lambda: _plan(f.model))


# a link run forward on the rows ``both`` (``n`` inputs' first), with its backward on ``rows`` rows; ``None``: not a
# link the rule knows (args: the link, its tensors in the params, ``both``, ``n``, the rule's eps, ``rows``)
Step = Callable[[WalkLink, tuple[torch.Tensor, ...], torch.Tensor, int, float, int],
                tuple[torch.Tensor, Pullback] | None]
# A step whose backward of the last link is more than its pullback (guided backprop's relu at a linear layer's
# input) says so by a ``seed_back`` attribute: what it does after the pullback, applied to the seed rows, which
# stand for that pullback (NOTE [seed rows]).
SEED_BACK = "seed_back"


class WalkPass(NamedTuple):
    """One walk back of several from the walk's one forward: to ``stops``, after ``before()``."""

    stops: tuple[int, ...]
    before: Callable[[], None]


def _unused(_g: torch.Tensor) -> torch.Tensor:
    raise AssertionError("the walk stops above this link")


def _forward(link: WalkLink, own: tuple[torch.Tensor, ...], both: torch.Tensor) -> tuple[torch.Tensor, Pullback] | None:
    """One module's forward alone, by the ops a step runs (the same numbers); ``None``: a link no step runs so."""
    kind, module = link.kind, link.module
    if kind == "affine":
        assert link.affine is not None
        return link.affine.run(both, own[0], own[1] if len(own) > 1 else None), _unused
    if kind == "activation":
        return ACTIVATIONS[type(module)][0](module, both), _unused
    if kind == "pool":
        return max_pool_with_indices(MAX_POOLS[type(module)], both, module.__dict__)[0], _unused
    if kind == "softmax" and (isinstance(dim := module.__dict__.get("dim"), bool) or dim not in (-1, both.dim() - 1)):
        return None
    return module(both), _unused


def _seeds(target: Target, n: int, per_target: bool) -> list[int | torch.Tensor] | None:
    """What each map puts in at the output: a class index, or one class per row; ``None``: the general path's."""
    if isinstance(target, torch.Tensor):
        labels = target.reshape(-1)
        if per_target or target.is_floating_point() or target.is_complex() or labels.numel() not in (1, n):
            return None  # (a 0-d tensor or one index per sample; anything else is the general path's to judge)
        return [labels.long().expand(n)]  # (any integer dtype: index_select takes int64; uint8 would wrap below 0)
    given = target if isinstance(target, tuple) else (target,)
    indices: list[int | torch.Tensor] = [i for i in given if type(i) is int]
    if len(indices) != len(given) or (len(indices) > 1 and not per_target):
        return None
    return indices


def _seed_rows(links: list[WalkLink], own: list[tuple[torch.Tensor, ...]], stop: int) -> torch.Tensor | None:
    """The last linear layer's weight, whose rows are its pullbacks of one-hots (NOTE [seed rows]); ``None`` where
    the chain does not end in one, or no activation's product comes before a pullback other than a reshape, after
    the link ``stop`` (the last the walk reads a map at; ``-1``: the input)."""
    affine = links[-1].affine
    if affine is None or affine.conv is not None:
        return None
    for index in range(len(links) - 2, stop, -1):
        link = links[index]
        if link.kind == "activation":
            return own[-1][0]
        if link.kind != "reshape":
            return None
    return None


def walked_map(key: NestedKey, maps: torch.Tensor, batch: torch.Size, per_target: bool) -> TensorDict:
    """A walk's map of the input ``key``, with the inputs' batch dims ``batch`` again, as the methods return it:
    batch ``[*B]``, or ``[T, *B]`` per target."""
    return fresh_tensordict({key: maps}, torch.Size([*maps.shape[:1 if per_target else 0], *batch]))


def holds_only(inputs: TensorDictBase, key: NestedKey) -> bool:
    """Whether ``key`` is the inputs' one leaf (read from `leaves`: a third of ``set(inputs.keys(True, True))``)."""
    return list(leaves(inputs)) == [key if isinstance(key, tuple) else (key,)]


def tensor_plan(caller: str, f: Any, params: Any, x: torch.Tensor, eps: Any, input_keys: Any) -> WalkPlan | None:
    """The chain walk's plan for a call on the tensor ``x`` (NOTE [captum-style calls]), its modes checked; ``None``
    where anything is not as the walk takes it (the TensorDict's way then checks it all, and says what is wrong).

    What `check_call` and DeepLift's `checked_functional` ask, asked here: ``f`` a Functional (of a chain: the plan),
    the params a TensorDict, ``x`` floating point, ``eps`` (a rule's) a number >= 0; and no transform, no
    ``input_keys``.
    """
    if input_keys is not None or isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0 \
            or not isinstance(params, TensorDictBase) or not x.is_floating_point() or not untransformed():
        return None
    plan = walk_plan(f)
    if plan is None or plan.links is None:
        return None
    plan.check_modes(f.model, caller)
    return plan


def chain_gradients(plan: WalkPlan, params: TensorDictBase, x: torch.Tensor, target: Target, per_target: bool,
                    step: Step, *, as_autograd: bool = False) -> torch.Tensor | None:
    """The gradient of ``target`` at ``x`` (``[n, ...]``; ``[T, n, ...]`` per target) by the walk, each link's
    backward ``step``'s (NOTE [gradient rules on a chain]); ``None`` where the walk does not apply.
    ``as_autograd``: see `walk`."""
    walked = walk(plan, params, x, None, target, 0.0, per_target, (-1,), step, as_autograd=as_autograd)
    return None if walked is None else walked[0][0]


def chain_gradient_passes(plan: WalkPlan, params: TensorDictBase, x: torch.Tensor, target: Target,
                          per_target: bool, step: Step, passes: Sequence[WalkPass],
                          ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """`chain_gradients` walked back in ``passes`` from one forward: at each pass's stops in turn, the gradient
    and the activation there (``-1``: the input); ``None`` where the walk does not apply."""
    stops = tuple(stop for walk_pass in passes for stop in walk_pass.stops)
    return walk(plan, params, x, None, target, 0.0, per_target, stops, step, passes=passes)


def chain_links(plan: WalkPlan, model: nn.Module, paths: Sequence[str]) -> tuple[int, ...] | None:
    """The index of the link each path names (NOTE [layers on the chain]); ``None`` where one names none, or a
    module in the chain twice (the general path says what is wrong)."""
    found = []
    for path in paths:
        index = plan.stops.get(path, -2)  # (read once: another thread may clear the memo between two reads)
        if index == -2:
            index = _link_named(plan, model, path)
            if len(plan.stops) >= _PATHS_KEPT:
                plan.stops.clear()
            plan.stops[path] = index
        if index is None:
            return None
        found.append(index)
    return tuple(found)


_PATHS_KEPT = 64  # (paths a plan remembers: a loop over many layers starts over rather than grow)


def _link_named(plan: WalkPlan, model: nn.Module, path: str) -> int | None:
    links, name = plan.links, path_to_name(path)
    if links is None or "(" in path or name not in plan.names:  # (a path that calls a method: the general path's)
        return None
    index = plan.names.index(name)
    try:
        named = resolve_path(model, path)  # (a name's path: no call runs; the plan's snapshot holds the model)
    except Exception:  # (the general path resolves it again and names the error)
        return None
    if named is not links[index].module or sum(link.module is named for link in links) != 1:
        return None
    return index


def walk(plan: WalkPlan, params: TensorDictBase, x: torch.Tensor, reference: torch.Tensor | None,
         target: Target, eps: float, per_target: bool, stops: tuple[int, ...], step: Step, pairs: bool = False,
         passes: Sequence[WalkPass] = (), as_autograd: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The multipliers at each stop (a link's output; ``-1``: the input), with the stacked activation there; of
    every pair with ``pairs`` (NOTE [pairs on the chain]).

    ``step`` runs a link both ways (DeepLift's rules, a gradient's); without a ``reference``, the
    inputs' rows alone go forward (a gradient's walk, NOTE [gradient rules on a chain]). ``passes``: the
    walk back split in several from the one forward, each to its own stops (``stops`` holds them all)
    after its ``before()`` (which may switch what the backward does); default, one to all ``stops``.
    ``as_autograd``: the plain gradient's walk (NOTE [plain gradients on a chain]): a seed row declines where it
    would differ from autograd's one-hot product (a non-finite weight: NOTE [seed rows]).
    """
    links = plan.links
    n = x.shape[0]
    rows = n * reference.shape[0] if pairs and reference is not None else n  # (the backward's rows)
    seeds = _seeds(target, n, per_target)
    if not links or not x.is_floating_point() or seeds is None:
        return None  # (an empty chain, an identity: the general path's, rare enough to leave it)
    if not autograd_as_walked(x.device.type):
        return None
    if rows != n:  # (each input's label for each of its pairs)
        assert reference is not None
        seeds = [i if isinstance(i, int) else i.repeat_interleave(reference.shape[0]) for i in seeds]
    # (where they do not fit, the general path names the mismatch; params that require grad are its to refuse,
    # or, grad mode off, values as there)
    enabled = torch.is_grad_enabled()
    own = own_values(leaves(params), links, frozen=enabled)
    if own is None:
        return None
    for tensors in own if as_autograd else ():  # (a loop, not a generator in ``any``: on every call)
        for t in tensors:
            if t.is_inference():
                return None  # (inference params: autograd refuses them, so the general path raises)
    torch._C._set_grad_enabled(False)  # (torch.no_grad() without its context manager's calls: on every call)
    try:
        return _walked(links, own, x, reference, seeds, rows, eps, per_target, stops, step, passes, as_autograd)
    finally:
        torch._C._set_grad_enabled(enabled)


def _walked(links: list[WalkLink], own: list[tuple[torch.Tensor, ...]], x: torch.Tensor,
            reference: torch.Tensor | None, seeds: list[int | torch.Tensor], rows: int, eps: float, per_target: bool,
            stops: tuple[int, ...], step: Step, passes: Sequence[WalkPass], as_autograd: bool,
            ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """`walk`'s forward and walks back, without a graph."""
    n = x.shape[0]
    backs: list[Pullback] = []
    seen: dict[int, torch.Tensor] = {}
    # one op per module for both (the references' rows after the inputs'): half the calls of two runs
    both = x if reference is None else torch.cat([x, reference])
    seen[-1] = both
    lowest, last = min(stops), len(links) - 1
    weight = _seed_rows(links, own, max(stops))
    for index, (link, tensors) in enumerate(zip(links, own, strict=True)):
        if index == last and weight is not None and both.dim() == 2 and both.shape[1] == weight.shape[1] and all(
                t.dtype == both.dtype and t.device == both.device for t in tensors):
            break  # (the last linear layer's output is never read: NOTE [seed rows]; where it would raise, it runs)
        # at and below the lowest stop the walk never comes back: the forward alone, no multipliers
        ran = step(link, tensors, both, n, eps, rows) if index > lowest else _forward(link, tensors, both)
        if ran is None or ran[0].dim() == 0 or ran[0].shape[0] != both.shape[0]:
            return None  # (a module that moves the batch from the first dim: the general path refuses it)
        both, back = ran
        if index in stops:  # (only the stops' activations kept: the rules' backs hold what they need)
            seen[index] = both
        backs.append(back)
    if len(backs) == last:  # (the last layer skipped: the walk starts from its weight's rows)
        assert weight is not None
        if as_autograd and not bool(torch.isfinite(weight).all()):
            return None  # (autograd's one-hot product puts another class's NaN in: the general path's numbers)
        classes = weight.shape[0]
    else:  # (the last module ran: from a one-hot at its output)
        weight, classes = None, (both.shape[1] if both.dim() == 2 else 0)
    for i in seeds:  # (a loop, not a generator in ``all``: on every call)
        if not (-classes <= i < classes if isinstance(i, int) else bool(((i >= -classes) & (i < classes)).all())):
            return None  # (the general path says what is wrong)
    seed_back = getattr(step, SEED_BACK, None)
    if not passes:
        maps = _pulled(backs, seeds, weight, classes, rows, both, len(links), stops, seed_back)
    else:
        maps = {}
        for walk_pass in passes:
            walk_pass.before()
            maps.update(_pulled(backs, seeds, weight, classes, rows, both, len(links), walk_pass.stops, seed_back))
    return [(torch.stack(maps[stop]) if per_target else maps[stop][0], seen[stop]) for stop in stops]


def _pulled(backs: list[Pullback], seeds: list[int | torch.Tensor], weight: torch.Tensor | None, classes: int,
            rows: int, top: torch.Tensor, count: int, targets: tuple[int, ...], seed_back: Pullback | None,
            ) -> dict[int, list[torch.Tensor]]:
    """Each seed walked back from the top (the last link's output ``top``, or, ``weight`` given, its weight's rows,
    then the step's ``seed_back``) to the lowest of ``targets``, the map at each of them kept."""
    bottom = min(targets)
    maps: dict[int, list[torch.Tensor]] = {stop: [] for stop in targets}
    for i in seeds:
        if weight is not None:
            g = weight[i] if isinstance(i, int) else weight.index_select(0, i % classes)
            g = g if seed_back is None else seed_back(g)
            g = g.expand(rows, -1) if isinstance(i, int) else g
            at = count - 2  # (g is at the output of the link before the last)
        else:
            g = top.new_zeros((rows, classes))
            if isinstance(i, int):
                g[:, i] = 1.0
            else:
                g.scatter_(1, (i % classes).unsqueeze(1), 1.0)
            at = count - 1
        while True:
            if at in maps:
                maps[at].append(g)
            if at == bottom:
                break
            g = backs[at](g)
            at -= 1
    return maps

