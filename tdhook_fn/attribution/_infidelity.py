"""Infidelity (Yeh et al. 2019): how far ``I . attr`` is from the output change ``f(x) - f(x - I)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from .._targets import Target, check_target
from .._types import NestedKey, PureFn
from ._flat_copies import flat_copies, flat_target
from ._inputs import check_call, tensor_inputs
from ._metric_samples import (
    check_count,
    checked_perturbed,
    chunks,
    input_leaves,
    repeated,
)
from ._target_values import target_values

__all__ = ["infidelity"]

PerturbFn = Callable[..., Any]
_CALLER = "infidelity"


def infidelity(
    f: PureFn,
    params: TensorDictBase,
    perturb_func: PerturbFn,
    inputs: TensorDictBase | torch.Tensor,
    attributions: TensorDictBase | torch.Tensor,
    *,
    target: Target,
    baselines: TensorDictBase | torch.Tensor | float | None = None,
    n_perturb_samples: int = 10,
    normalize: bool = False,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Explanation infidelity: ``E_I[(I . attr - (F(x) - F(x - I)))^2]`` per sample.

    Equal to captum's ``captum.metrics.infidelity`` given the same perturbations. ``F`` is
    the target value of ``f``, summed over several targets (what the gradient methods
    attribute). ``perturb_func`` draws the ``n_perturb_samples`` perturbations of all
    samples in one call per chunk, and the perturbed inputs of a chunk run through ``f``
    in one batched forward, the first with the inputs themselves (``F(x)``). Nothing is
    detached: the result is differentiable in ``attributions`` (and ``params``).

    Args:
        f (Callable): pure ``f(params, td) -> td``, e.g. from ``tdhook_fn.pure(model)``.
        params (TensorDict): parameters for ``f``.
        perturb_func (Callable): ``perturb_func(copies[, baselines]) -> (perturbations,
            perturbed_inputs)``, captum's contract. ``copies`` is the inputs repeated
            along a new last batch dim, ``[*B, k]`` (read-only views); it returns
            TensorDicts of that batch: the perturbations ``I`` of every attributed key
            and the perturbed inputs (keys it leaves out stay as they are). For tensor
            ``inputs`` it gets and returns tensors ``[N * k, ...]``, exactly as captum's
            does. It owns its randomness: pass it a ``generator`` to make runs repeatable
            (see `normal_perturbation`).
        inputs (TensorDict | Tensor): inputs ``x``, batch ``[*B]``; extra keys (labels)
            are repeated and offered to the target. A tensor (first dim the batch) for an
            ``f`` with one in_key.
        attributions (TensorDict | Tensor): the explanation, keyed and shaped like the
            inputs it explains (a subset of the keys); a tensor for tensor ``inputs``.
        target (int | tuple[int, ...] | Tensor | Callable): see `tdhook_fn.as_target`.
        baselines (TensorDict | Tensor | float | None): passed to ``perturb_func`` as its
            second argument: a TensorDict of the inputs' batch is repeated like them; for
            tensor inputs a tensor whose first dim is the batch is repeated (captum's
            rule). Default: ``None`` (``perturb_func(copies)``).
        n_perturb_samples (int): perturbations per sample. Default: ``10``.
        normalize (bool): rescale the attributions by captum's optimal ``beta =
            E[I.attr (F(x) - F(x - I))] / E[(I.attr)^2]`` first, so the score ignores
            their scale. Default: ``False``.
        chunk_size (int | None): at most this many perturbations per sample in one
            forward (captum's ``max_examples_per_batch`` is ``chunk_size * N``).
            Default: ``None``, all at once.

    Returns:
        Tensor: infidelity per sample, shape ``[*B]`` (``[N]`` for tensor inputs).

    Examples:
        >>> import functools, torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> from tdhook_fn.attribution import saliency
        >>> from tdhook_fn.attribution.metrics import normal_perturbation
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> f, p = tdhook_fn.pure(net)
        >>> x = TensorDict(input=torch.randn(5, 3), batch_size=[5])
        >>> attr = saliency(f, p, x, target=1)
        >>> noise = functools.partial(normal_perturbation, std=0.1, generator=torch.Generator().manual_seed(0))
        >>> infidelity(f, p, noise, x, attr, target=1).shape
        torch.Size([5])
        >>> per_sample = functools.partial(normal_perturbation, std=0.1, keys=["input"])
        >>> torch.vmap(lambda td, a: infidelity(f, p, per_sample, td, a, target=1),
        ...            randomness="different")(x, attr).shape
        torch.Size([5])
    """
    check_count(_CALLER, "n_perturb_samples", n_perturb_samples)
    check_count(_CALLER, "chunk_size", chunk_size, optional=True)
    td, attrs, perturb = _as_tensordicts(f, perturb_func, inputs, attributions, baselines)
    check_call(_CALLER, f, params, td, (), target)
    check_target(target, td.batch_size, _CALLER)
    _check_attributions(td, attrs)
    if baselines is not None and isinstance(baselines, TensorDictBase) and baselines.batch_size != td.batch_size:
        raise ValueError(f"{_CALLER}: baselines have batch size {list(baselines.batch_size)}, the inputs "
                         f"{list(td.batch_size)}; give one baseline per sample (or a number)")
    before: torch.Tensor | None = None
    sums: tuple[torch.Tensor, ...] | None = None
    for k in chunks(n_perturb_samples, chunk_size):
        terms, before = _chunk_terms(f, params, perturb, td, attrs, baselines, target, before, k, normalize)
        sums = terms if sums is None else tuple(a + b for a, b in zip(sums, terms, strict=True))
    assert sums is not None
    if normalize:
        dots_sq, cross, diffs_sq = sums
        beta = cross / torch.where(dots_sq != 0, dots_sq, torch.ones_like(dots_sq))
        return (beta * beta * dots_sq - 2 * beta * cross + diffs_sq) / n_perturb_samples
    return sums[0] / n_perturb_samples


def _chunk_terms(f: PureFn, params: TensorDictBase, perturb: PerturbFn, td: TensorDictBase, attrs: TensorDictBase,
                 baselines: Any, target: Target, before: torch.Tensor | None, k: int,
                 normalize: bool) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The sums over ``k`` perturbations per sample that the score is made of (``[*B]`` each), and ``F(x)``.

    ``F(x)`` not yet known (``before`` is ``None``) is computed in the same forward: the
    inputs go first along the copies' dim, so one call of ``f`` serves both.
    """
    batch = td.batch_size
    dims = td.batch_dims
    views = {key: value.unsqueeze(dims).expand(*batch, k, *value.shape[dims:]) for key, value in td.items(True, True)}
    copies = TensorDict(views, batch_size=[*batch, k])
    offered = TensorDict(views, batch_size=[*batch, k])  # (a perturb_func setting entries leaves the copies alone)
    given = perturb(offered) if baselines is None else perturb(offered, _repeated_baselines(baselines, k))
    if not isinstance(given, (tuple, list)) or len(given) != 2:
        raise TypeError(f"{_CALLER}: perturb_func must return (perturbations, perturbed_inputs), got "
                        f"{type(given).__name__}")
    perturbations, moved = given
    first = before is None
    runs = torch.Size([*batch, k + first])
    flat = not callable(target) or isinstance(target, torch.Tensor)
    feed = _feed(td, copies, moved, first)
    if not flat:  # (a callable target sees the runs' shape)
        feed = feed.reshape(runs)
    values = _scalar(target_values(f, params, feed, flat_target(target, batch, k + first)), runs)
    if before is None:
        before, values = values[..., 0], values[..., 1:]
    diffs = before.unsqueeze(-1) - values
    dots = _dots(attrs, perturbations, copies)
    if normalize:
        return ((dots * dots).sum(-1), (dots * diffs).sum(-1), (diffs * diffs).sum(-1)), before
    return (((dots - diffs) ** 2).sum(-1),), before


def _feed(td: TensorDictBase, copies: TensorDictBase, moved: Any, first: bool) -> TensorDictBase:
    """What ``f`` runs on, flat ``[N * (k (+ 1))]``: the copies with the perturbed entries in place, and the
    inputs themselves as copy 0 where ``first`` (NOTE [flat copies])."""
    replaced = dict(checked_perturbed(_CALLER, copies, moved))
    if first:
        dims = td.batch_dims
        replaced = {key: torch.cat([cast(torch.Tensor, td.get(key)).unsqueeze(dims), value], dims)
                    for key, value in replaced.items()}
    return flat_copies(td, copies.batch_size[-1] + first, replaced)


def _dots(attrs: TensorDictBase, perturbations: Any, copies: TensorDictBase) -> torch.Tensor:
    """``I . attr`` per (sample, copy), summed over every attributed key: ``[*B, k]``."""
    if not isinstance(perturbations, TensorDictBase):
        raise TypeError(f"{_CALLER}: perturb_func must return the perturbations as a TensorDict, got "
                        f"{type(perturbations).__name__}")
    batch = copies.batch_size
    total: torch.Tensor | None = None
    for key, attr in attrs.items(True, True):
        pert = perturbations.get(key, None)
        if pert is None:
            raise KeyError(f"{_CALLER}: perturb_func returned no perturbation of the attributed input {key!r} "
                           f"(it returned {list(perturbations.keys(True, True))})")
        if pert.shape != copies.get(key).shape:
            raise ValueError(f"{_CALLER}: perturb_func returned a perturbation of {key!r} of shape "
                             f"{list(pert.shape)}; the inputs it was given have shape {list(copies.get(key).shape)}")
        dot = (attr.unsqueeze(attrs.batch_dims) * pert).reshape(*batch, -1).sum(-1)
        total = dot if total is None else total + dot
    assert total is not None
    return total


def _scalar(values: TensorDictBase, batch: torch.Size) -> torch.Tensor:
    """One value per sample: every target value summed (several targets, several keys)."""
    total: torch.Tensor | None = None
    for value in values.values(True, True):
        one = cast(torch.Tensor, value).reshape(*batch, -1).sum(-1)
        total = one if total is None else total + one
    if total is None:
        raise ValueError(f"{_CALLER}: the target selected no value")
    return total


def _repeated_baselines(baselines: Any, k: int) -> Any:
    return repeated(baselines, k) if isinstance(baselines, TensorDictBase) else baselines


def _check_attributions(td: TensorDictBase, attrs: Any) -> None:
    if not isinstance(attrs, TensorDictBase):
        raise TypeError(f"{_CALLER}: attributions must be a TensorDict keyed like the inputs (a tensor for tensor "
                        f"inputs), got {type(attrs).__name__}")
    if attrs.is_empty():
        raise ValueError(f"{_CALLER}: attributions hold no entry; give the map of at least one input")
    if attrs.batch_size != td.batch_size:
        raise ValueError(f"{_CALLER}: attributions have batch size {list(attrs.batch_size)}, the inputs "
                         f"{list(td.batch_size)}; give the maps the inputs' batch size (what the attribution "
                         "methods return)")
    for key, attr, value in input_leaves(_CALLER, "attributions hold", attrs, td):
        if attr.shape != value.shape:
            raise ValueError(f"{_CALLER}: attributions {key!r} have shape {list(attr.shape)}, the input "
                             f"{list(value.shape)}; give one map per input, shaped like it (per_target maps: "
                             "one call per target)")


def _as_tensordicts(f: Any, perturb_func: PerturbFn, inputs: Any, attributions: Any,
                    baselines: Any) -> tuple[TensorDictBase, Any, PerturbFn]:
    """Tensor inputs (captum's calls) as TensorDicts, with ``perturb_func`` seeing tensors as in captum."""
    if not callable(perturb_func):
        raise TypeError(f"{_CALLER}: perturb_func must be callable, got {type(perturb_func).__name__}")
    if not isinstance(inputs, torch.Tensor):
        return inputs, attributions, perturb_func
    td = tensor_inputs(_CALLER, f, inputs)
    key = next(iter(td.keys(True, True)))
    if not isinstance(attributions, torch.Tensor):
        raise TypeError(f"{_CALLER}: inputs is a tensor, so attributions must be one too, got "
                        f"{type(attributions).__name__}")
    if isinstance(baselines, TensorDictBase):
        raise TypeError(f"{_CALLER}: inputs is a tensor, so baselines must be a tensor or a number, not a TensorDict")
    attrs = TensorDict({key: attributions}, batch_size=td.batch_size)
    return td, attrs, _on_tensors(perturb_func, key, len(inputs))


def _on_tensors(perturb_func: PerturbFn, key: NestedKey, n: int) -> PerturbFn:
    """``perturb_func`` of captum's tensors ``[N * k, ...]`` as one of repeated TensorDicts ``[N, k]``."""

    def perturb(copies: TensorDictBase, *baselines: Any) -> tuple[TensorDict, TensorDict]:
        x = copies.get(key)
        k = copies.batch_size[-1]
        rest = [b.repeat_interleave(k, 0) if isinstance(b, torch.Tensor) and b.dim() and b.shape[0] == n > 1 else b
                for b in baselines]
        given = perturb_func(x.reshape(n * k, *x.shape[2:]), *rest)
        if not isinstance(given, (tuple, list)) or len(given) != 2:
            raise TypeError(f"{_CALLER}: perturb_func must return (perturbations, perturbed_inputs), got "
                            f"{type(given).__name__}")
        out = []
        for name, t in zip(("perturbations", "perturbed inputs"), given, strict=True):
            if isinstance(t, tuple) and len(t) == 1:  # (captum's decorator returns one-tuples)
                t = t[0]
            if not isinstance(t, torch.Tensor) or t.numel() != x.numel():
                raise ValueError(f"{_CALLER}: perturb_func must return {name} shaped like the inputs it was given, "
                                 f"{[n * k, *x.shape[2:]]}, got {getattr(t, 'shape', type(t).__name__)}")
            out.append(TensorDict({key: t.reshape(x.shape)}, batch_size=copies.batch_size))
        return out[0], out[1]

    return perturb
