"""``vjp``: `torch.func.vjp` with ``has_aux``, by plain autograd where that gives the same result; and the random
state that a forward run again replays."""

# NOTE [eager vjp]
# `torch.func.vjp` wraps every tensor at a new grad level, and each op of the forward
# and of the pullback then goes through functorch's dispatch: on small models that is most
# of the cost (measured on torch 2.13 CPU, saliency of a 3-layer MLP at batch 64: 2.1x a
# plain ``backward()`` under ``func.vjp``, 1.3x by autograd). Outside every functorch
# transform and torch.compile, and when no tensor of the call (params, inputs) requires
# grad, both give the same numbers, and `vjp` runs the forward on detached copies of
# the primals marked ``requires_grad`` and pulls back with `torch.autograd.grad`
# (the graph is kept, so the pullback may be called once per target).
#
# One case differs: a tensor the forward closes over (in a target, a tap, a rule) that
# requires grad. Under ``func.vjp`` the results stay differentiable in it; a plain
# pullback would drop that silently. So the forward's graph is walked once (measured:
# tens of µs for an MLP, 4 ms for a 6-layer GPT-2 whose forward and backward take 500
# ms), and if it reaches any leaf that is not one of the primals, the call is redone
# under ``func.vjp``.
#
# The pullback takes ``retain_graph`` as functorch's does (default ``True``: it may be
# called again). A caller that pulls back once passes ``False``: the forward's saved
# activations are then freed as the backward goes, and their memory is reused for the
# gradients it allocates, as in a plain ``backward()`` (measured: a few percent of a
# SmoothGrad call on an MLP, where the activations are larger than the cache). It takes
# ``wanted`` too, the positions of the flat primals whose gradients are needed: by
# autograd the others come back ``None`` and the backward stops where none is reached
# (a pull to a layer alone runs no backward below it); ``func.vjp`` computes them all.

# NOTE [a forward run again draws the same numbers]
# Some calls run a forward a second time on the same inputs: the layer pullbacks after a
# later module wrote a kept activation in place (NOTE [activations read without a copy]),
# or where the first run reaches a tensor that requires grad and `torch.func.vjp` must
# redo it, and the layer specs' retry after a stale spec. A model that draws (dropout in
# training mode, a forward calling ``torch.rand``) would draw other numbers the second
# time, so the result would be that of another call, and the caller's generator would
# advance twice. So the state is saved before the first run and put back before the
# second: the second draws what the first drew, and the generator ends where one forward
# leaves it. Saved: the CPU generator, and each GPU's where CUDA is initialised (a
# forward can draw on no GPU before CUDA is; ``get_rng_state_all`` reads a few bytes per
# device and never initialises one).

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch.autograd import forward_ad
from torch.autograd.graph import _engine_run_backward

from ._functional import fresh_tensordict
from ._params import leaf_values
from ._params import leaves as td_leaves

__all__ = ["RandomState", "any_requires_grad", "autograd_as_walked", "reaches_other_leaves", "untransformed", "vjp"]

_ACCUMULATE: Any = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]
# (untyped in torch: their signatures, stated once)
_cuda_initialized: Callable[[], bool] = torch.cuda.is_initialized
_cuda_rng_states: Callable[[], list[torch.Tensor]] = torch.cuda.get_rng_state_all
VjpFn = Callable[..., tuple[Any]]  # (cotangent, retain_graph=True, wanted=None)


def vjp(forward: Callable[[Any], tuple[Any, Any]], primals: Any, *, constants: Iterable[TensorDictBase] = ()) -> tuple[
        Any, VjpFn, Any]:
    """``torch.func.vjp(forward, primals, has_aux=True)``, by autograd where that is exact (see the NOTE).

    ``primals`` and the forward's output are tensors, TensorDicts, or tuples, lists and
    dicts of them. ``constants`` are the other TensorDicts the forward reads (params,
    inputs); if a tensor in one requires grad, ``func.vjp`` is used.
    """

    def by_functorch() -> tuple[Any, VjpFn, Any]:
        result: Any = torch.func.vjp(forward, primals, has_aux=True)
        pull = result[1]

        def pullback(cotangent: Any, retain_graph: bool = True, wanted: Sequence[int] | None = None) -> tuple[Any]:
            out: tuple[Any] = pull(cotangent, retain_graph=retain_graph)  # (every primal's: see the NOTE)
            return out

        return result[0], pullback, result[2]

    if not untransformed():  # functorch's vjp composes with the transform (and is what Dynamo traces)
        return by_functorch()
    tensors: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    aux_tensors: list[torch.Tensor] = []
    drawn = RandomState()  # NOTE [a forward run again draws the same numbers]
    try:
        rebuild = _flatten(primals, tensors)
        if any_requires_grad(constants, tensors):
            return by_functorch()
        mine = []
        for t in tensors:  # (loops here and below: a comprehension costs a Python call, on every call)
            mine.append(t.detach().requires_grad_())
        enabled = torch.is_grad_enabled()  # (torch.enable_grad(), without its context manager's calls)
        torch._C._set_grad_enabled(True)
        try:
            out, aux = forward(rebuild(iter(mine)))
        finally:
            torch._C._set_grad_enabled(enabled)
        rebuild_out, rebuild_aux = _flatten(out, outs), _flatten(aux, aux_tensors)
    except _Unsupported:  # a structure of something else than tensors: functorch knows those
        drawn.restore()  # (where the forward ran)
        return by_functorch()
    if reaches_other_leaves([*outs, *aux_tensors], mine):
        drawn.restore()
        return by_functorch()

    def pullback(cotangent: Any, retain_graph: bool = True, wanted: Sequence[int] | None = None) -> tuple[Any]:
        cots: list[torch.Tensor] = []
        _flatten_like(out, cotangent, cots)
        if len(cots) != len(outs):
            raise ValueError(f"vjp: the cotangent has {len(cots)} tensors, the output {len(outs)}")
        roots, fed = [], []
        for o, c in zip(outs, cots, strict=True):
            if o.requires_grad:
                roots.append(o)
                fed.append(c)
        if not roots:
            return (rebuild(map(torch.zeros_like, mine)),)
        if wanted is None:
            return (rebuild(iter(_grads(roots, mine, fed, retain_graph))),)
        grads: list[Any] = [None] * len(mine)
        for i, g in zip(wanted, _grads(roots, [mine[i] for i in wanted], fed, retain_graph), strict=True):
            grads[i] = g
        return (rebuild(iter(grads)),)

    return rebuild_out(map(torch.Tensor.detach, outs)), pullback, rebuild_aux(map(torch.Tensor.detach, aux_tensors))


class _Unsupported(Exception):
    pass


# NOTE [the engine called directly]
# `torch.autograd.grad` is a Python wrapper around autograd's engine: it normalises its
# arguments, checks every cotangent against its output (`_make_grads`) and handles tensor
# subclasses, about a fifth of a small model's backward (measured: 30 of 150 µs for an MLP
# at batch 1). Where every tensor is a plain tensor and each cotangent has its output's
# shape and is complex where it is, those steps change nothing, so `_grads` runs the
# engine as the wrapper does (`_engine_run_backward`, which keeps its logging and context);
# anything else goes through `torch.autograd.grad`, whose errors are then the user's.


def _grads(roots: list[torch.Tensor], mine: list[torch.Tensor], fed: list[torch.Tensor],
           retain_graph: bool) -> Sequence[torch.Tensor]:
    """``torch.autograd.grad(roots, mine, fed, retain_graph=..., allow_unused=True, materialize_grads=True)``
    (NOTE [the engine called directly])."""
    plain = bool(mine)
    for o, c in zip(roots, fed, strict=True):  # (a loop, the tests inline: on every call)
        if (type(o) is not torch.Tensor or type(c) is not torch.Tensor or o.shape != c.shape
                or o.dtype.is_complex != c.dtype.is_complex):
            plain = False
            break
    for t in mine if plain else ():
        if type(t) is not torch.Tensor:
            plain = False
            break
    if not plain:
        return torch.autograd.grad(roots, mine, fed, retain_graph=retain_graph, allow_unused=True,
                                   materialize_grads=True)
    grads = _engine_run_backward(tuple(roots), tuple(fed), retain_graph, False, tuple(mine), True,
                                 accumulate_grad=False)
    out = []
    for g, t in zip(grads, mine, strict=True):
        out.append(torch.zeros_like(t) if g is None else g)
    return out


def _flatten_like(template: Any, tree: Any, tensors: list[torch.Tensor]) -> None:
    """Append ``tree``'s tensors to ``tensors`` in the order `_flatten` gives ``template``'s.

    A TensorDict's leaves are taken by ``template``'s keys: a cotangent built from the
    values handed out (whose nested keys may come in another order) pairs by key.
    """
    if type(template) is TensorDict and type(tree) is TensorDict and _tensors_only(template):
        own = tree.__dict__["_tensordict"]  # (both plain: their own dicts, by the template's names, on every call)
        for name in template.__dict__["_tensordict"]:
            value = own.get(name)
            if type(value) is not torch.Tensor and not isinstance(value, torch.Tensor):
                raise ValueError(f"vjp: the cotangent has no tensor at {(name,)!r}")
            tensors.append(value)
    elif isinstance(template, TensorDictBase) and isinstance(tree, TensorDictBase):
        # (a plain TensorDict's own dict read for a one-name key: ``get`` costs a few calls, on every call)
        own = tree.__dict__.get("_tensordict") if type(tree) is TensorDict else None
        for key in td_leaves(template):
            value = own.get(key[0]) if own is not None and len(key) == 1 else tree.get(key, None)
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"vjp: the cotangent has no tensor at {key!r}")
            tensors.append(value)
    elif isinstance(template, (tuple, list)) and isinstance(tree, (tuple, list)) and len(template) == len(tree):
        for part, item in zip(template, tree, strict=True):
            _flatten_like(part, item, tensors)
    elif isinstance(template, dict) and isinstance(tree, dict) and template.keys() == tree.keys():
        for key, part in template.items():
            _flatten_like(part, tree[key], tensors)
    else:
        _flatten(tree, tensors)


def _flatten(tree: Any, tensors: list[torch.Tensor]) -> Callable[[Any], Any]:
    """Append ``tree``'s tensors to ``tensors``; return the function that rebuilds it from an iterator.

    ``torch.utils._pytree`` does the same for TensorDicts at several times the cost, on every call.
    """
    if isinstance(tree, torch.Tensor):
        tensors.append(tree)
        return next
    if type(tree) is TensorDict and _tensors_only(tree):  # (its own dict, as `leaves` reads it: on every call)
        own = tree.__dict__["_tensordict"]
        tensors.extend(own.values())
        return _rebuild_plain(tree, list(own))
    if isinstance(tree, TensorDictBase):
        keyed = td_leaves(tree)
        flat = True  # (plain loops: generators in ``all`` cost a call per item, on every call)
        for key, value in keyed.items():
            if not isinstance(value, torch.Tensor):
                raise _Unsupported
            flat = flat and len(key) == 1
        tensors.extend(keyed.values())
        if flat and type(tree) is TensorDict:  # one-name keys: built unchecked (NOTE [unchecked TensorDicts])
            return _rebuild_plain(tree, [key[0] for key in keyed])

        def rebuild_td(values: Any) -> Any:
            out = tree.empty(recurse=not flat)  # the nested structure only where there is one: 4x faster
            for key in keyed:
                out.set(key, next(values))
            return out

        return rebuild_td
    # (plain loops, and a tensor's part taken inline: a comprehension, a lambda or a call per tensor each cost
    # a Python call, on every call)
    if isinstance(tree, (tuple, list)):
        parts: list[Callable[[Any], Any]] = []
        for item in tree:
            if isinstance(item, torch.Tensor):
                tensors.append(item)
                parts.append(next)
            else:
                parts.append(_flatten(item, tensors))
        kind = type(tree)

        def rebuild_sequence(values: Any) -> Any:
            items = []
            for part in parts:
                items.append(part(values))
            return kind(items)

        return rebuild_sequence
    if isinstance(tree, dict):
        named: dict[Any, Callable[[Any], Any]] = {}
        for key, item in tree.items():
            if isinstance(item, torch.Tensor):
                tensors.append(item)
                named[key] = next
            else:
                named[key] = _flatten(item, tensors)

        def rebuild_dict(values: Any) -> Any:
            out = {}
            for key, part in named.items():
                out[key] = part(values)
            return out

        return rebuild_dict
    raise _Unsupported


def _tensors_only(td: TensorDict) -> bool:
    """Whether a plain TensorDict holds plain tensors only (no nested TensorDict), read from its own dict."""
    for value in td.__dict__["_tensordict"].values():
        if type(value) is not torch.Tensor:
            return False
    return True


def _rebuild_plain(tree: TensorDict, names: list[str]) -> Callable[[Any], Any]:
    """What rebuilds a plain TensorDict of one-name keys ``names``, built unchecked: the tensors are shaped as its
    own (NOTE [unchecked TensorDicts])."""

    def rebuild_plain(values: Any) -> Any:
        entries: dict[Any, Any] = {}
        for name in names:
            entries[name] = next(values)
        return fresh_tensordict(entries, tree.batch_size, tree.device, tree._maybe_names())

    return rebuild_plain


def untransformed() -> bool:
    """Whether this runs outside every functorch transform (``vmap``, ``grad``, ...) and outside Dynamo's trace.

    Only there may the data decide the control flow, and plain autograd stand in for ``func.vjp``.
    """
    return not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is None


def autograd_as_walked(device: str) -> bool:
    """Whether autograd would compute as a walk by hand does (the chain walks; else the general path runs, and
    does what these ask): no autocast on ``device`` (it runs the ops in another dtype and casts the maps back), no
    anomaly mode (it raises on a NaN a backward returns), no forward-AD level (a dual input's map carries a
    tangent), no saved-tensor hooks (they may change what a backward reads)."""
    return not torch.is_autocast_enabled(device) and not torch.is_anomaly_enabled() \
        and forward_ad._current_level < 0 and torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def any_requires_grad(tds: Iterable[Any], tensors: Iterable[torch.Tensor] = ()) -> bool:
    """Whether a tensor of ``tensors`` or of the TensorDicts ``tds`` requires grad (regular autograd).

    Looked for below any functorch wrapper: under ``vmap`` a batched tensor reads
    ``requires_grad=False`` whatever it wraps.
    """
    functorch = torch._C._functorch
    wrapped = functorch.is_functorch_wrapped_tensor
    values = [*tensors]
    for td in tds:
        if type(td) is TensorDict or isinstance(td, TensorDictBase):  # (the identity test first: on every call)
            values += leaf_values(td)
    for value in values:
        if type(value) is not torch.Tensor and not isinstance(value, torch.Tensor):
            continue
        while wrapped(value):
            value = functorch.get_unwrapped(value)
        if value.requires_grad:
            return True
    return False


def reaches_other_leaves(roots: list[torch.Tensor], mine: list[torch.Tensor]) -> bool:
    """Whether the graph behind ``roots`` accumulates into any leaf other than ``mine``."""
    own = set(map(id, mine))
    stack: list[Any] = []
    for t in roots:  # (plain loops: a comprehension costs a Python call, per node of the graph)
        stack.append(t.grad_fn)
    seen: dict[int, Any] = {}  # holds the nodes, so that no id is reused during the walk
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        if type(node) is _ACCUMULATE:  # the edge into a leaf (a type test: getattr of a missing name costs more)
            if id(node.variable) not in own:
                return True
            continue
        for next_node, _ in node.next_functions:
            stack.append(next_node)
    return False


class RandomState:
    """torch's generators as they are now (NOTE [a forward run again draws the same numbers])."""

    __slots__ = ("cpu", "cuda")

    def __init__(self) -> None:
        self.cpu = torch.default_generator.get_state()  # (torch.get_rng_state, without its Python call)
        self.cuda = _cuda_rng_states() if _cuda_initialized() else None

    def restore(self) -> None:
        """Put the generators back as they were when this was made."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
