"""Max-sensitivity (Yeh et al. 2019): the largest relative change of an explanation under small noise."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from .._types import NestedKey
from ._metric_samples import (
    check_count,
    chunks,
    perturbed_feed,
    repeated,
    repeated_target,
    uniform_perturbation,
    with_inputs_first,
)

__all__ = ["sensitivity_max"]

ExplainFn = Callable[..., Any]
PerturbFn = Callable[[Any, float], Any]
_CALLER = "sensitivity_max"


def sensitivity_max(
    explanation_func: ExplainFn,
    inputs: TensorDictBase | torch.Tensor,
    *,
    perturb_func: PerturbFn = uniform_perturbation,
    perturb_radius: float = 0.02,
    n_perturb_samples: int = 10,
    norm_ord: str | float = "fro",
    chunk_size: int | None = None,
    explanations: TensorDictBase | torch.Tensor | None = None,
    per_key: bool = False,
    **kwargs: Any,
) -> torch.Tensor | TensorDict:
    """Max-sensitivity: ``max_j ||expl(x + d_j) - expl(x)|| / ||expl(x)||`` per sample.

    Equal to captum's ``captum.metrics.sensitivity_max`` given the same perturbations.
    The ``n_perturb_samples`` perturbed copies of every sample go through
    ``explanation_func`` in one call per chunk (a tdhook_fn method takes any batch
    size), never one call per copy; the first call explains the
    inputs too (after the first perturbations are drawn: captum explains them first,
    which matters only to an ``explanation_func`` drawing random numbers). An
    explanation of norm zero is divided by one, as in captum.

    Args:
        explanation_func (Callable): ``explanation_func(inputs, **kwargs) -> explanations``,
            e.g. ``functools.partial(tdhook_fn.attribution.saliency, f, params)``. It is
            called on the inputs (batch ``[*B]``) and on the perturbed copies (``[*B, k]``;
            tensors ``[N * k, ...]`` for tensor inputs, as in captum).
        inputs (TensorDict | Tensor): the inputs, batch ``[*B]``, or a tensor whose first
            dim is the batch (then ``explanation_func`` and ``perturb_func`` get tensors).
        perturb_func (Callable): ``perturb_func(copies, perturb_radius) -> perturbed``;
            ``copies`` are the inputs repeated along a new last batch dim (read-only
            views); keys it leaves out stay as they are. It owns its randomness: give it
            a generator (``functools.partial(uniform_perturbation, generator=g)``) to make
            runs repeatable. Default: `uniform_perturbation`, captum's
            ``default_perturb_func``.
        perturb_radius (float): passed to ``perturb_func``. Default: ``0.02``.
        n_perturb_samples (int): perturbed copies per sample. Default: ``10``.
        norm_ord (str | float): the vector norm, ``"fro"`` or a number (``torch.norm``'s
            ``p``), over all explanation entries of a sample. Default: ``"fro"``.
        chunk_size (int | None): at most this many copies per sample in one call
            (captum's ``max_examples_per_batch`` is ``chunk_size * N``). Default: all.
        explanations (TensorDict | Tensor | None): the explanations at ``inputs`` if
            already computed. Default: ``None``, ``explanation_func(inputs, **kwargs)``.
        per_key (bool): one score per explanation key (each key's own norms) instead of
            one over all of them. Default: ``False``.
        **kwargs (Any): passed to ``explanation_func``. For the copies a ``target``
            tensor of one class per sample and ``baselines`` with one per sample are
            repeated like the inputs (captum's rule); everything else is passed as it is.

    Returns:
        Tensor | TensorDict: sensitivity per sample, ``[*B]`` (``[N]`` for tensor inputs);
        with ``per_key``, a TensorDict of them by explanation key.

    Examples:
        >>> import functools, torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> from tdhook_fn.attribution import saliency
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> f, p = tdhook_fn.pure(net)
        >>> x = TensorDict(input=torch.randn(5, 3), batch_size=[5])
        >>> explain = functools.partial(saliency, f, p, target=1)
        >>> sensitivity_max(explain, x, n_perturb_samples=4).shape
        torch.Size([5])
        >>> shift = lambda td, r: td.apply(lambda v: v + r)  # deterministic: composes with vmap
        >>> torch.vmap(lambda td: sensitivity_max(explain, td, perturb_func=shift))(x).shape
        torch.Size([5])
    """
    check_count(_CALLER, "n_perturb_samples", n_perturb_samples)
    check_count(_CALLER, "chunk_size", chunk_size, optional=True)
    if not callable(explanation_func):
        raise TypeError(f"{_CALLER}: explanation_func must be callable, got {type(explanation_func).__name__}")
    if not callable(perturb_func):
        raise TypeError(f"{_CALLER}: perturb_func must be callable, got {type(perturb_func).__name__}")
    if isinstance(norm_ord, bool) or not (norm_ord == "fro" or isinstance(norm_ord, (int, float))):
        raise ValueError(f"{_CALLER}: norm_ord must be 'fro' or a number (the p of a vector norm), got {norm_ord!r}")
    td, explain, perturb, expand = _as_tensordicts(explanation_func, perturb_func, inputs)
    batch, dims = td.batch_size, td.batch_dims
    expl = None if explanations is None else _given(explanations, inputs, batch)
    best: list[torch.Tensor] | None = None
    for k in chunks(n_perturb_samples, chunk_size):
        copies = repeated(td, k)
        feed = perturbed_feed(_CALLER, copies, perturb(copies.clone(False), perturb_radius))
        if expl is None:  # the inputs go first along the copies' dim: one call explains both
            feed = with_inputs_first(td, feed)
        moved = _explanations(explain(feed, **expand(kwargs, td, feed.batch_size[-1])), feed.batch_size,
                              "explanation_func")
        if expl is None:
            expl, moved = moved[(slice(None),) * dims + (0,)], moved[(slice(None),) * dims + (slice(1, None),)]
        top = _largest_changes(expl, moved, dims, per_key, norm_ord)
        best = top if best is None else [torch.maximum(a, b) for a, b in zip(best, top, strict=True)]
    assert best is not None and expl is not None
    if not per_key:
        return best[0]
    scores = TensorDict({}, batch_size=batch)
    for key, score in zip(expl.keys(True, True), best, strict=True):
        scores.set(key, score)
    return scores


def _largest_changes(expl: TensorDictBase, moved: TensorDictBase, dims: int, per_key: bool,
                     norm_ord: str | float) -> list[torch.Tensor]:
    """``max_j ||moved_j - expl|| / ||expl||`` per sample (``[*B]``), over all keys or per key."""
    if set(moved.keys(True, True)) != set(expl.keys(True, True)):
        raise ValueError(f"{_CALLER}: explanation_func gave keys {list(moved.keys(True, True))} for the perturbed "
                         f"inputs, {list(expl.keys(True, True))} for the inputs")
    keys = list(expl.keys(True, True))
    groups = [[key] for key in keys] if per_key else [keys]
    largest = []
    for group in groups:
        norm = _norm([expl.get(key) for key in group], expl.batch_size, norm_ord)
        norm = torch.where(norm == 0, torch.ones_like(norm), norm)
        change = _norm([expl.get(key).unsqueeze(dims) - moved.get(key) for key in group], moved.batch_size, norm_ord)
        largest.append((change / norm.unsqueeze(-1)).max(-1).values)
    return largest


def _given(explanations: Any, inputs: Any, batch: torch.Size) -> TensorDictBase:
    """Explanations passed in (a tensor for tensor inputs), as a TensorDict."""
    if isinstance(explanations, torch.Tensor) and isinstance(inputs, torch.Tensor):
        explanations = TensorDict({"input": explanations.reshape(inputs.shape)}, batch_size=batch)
    return _explanations(explanations, batch, "explanations")


def _norm(parts: list[torch.Tensor], batch: torch.Size, norm_ord: str | float) -> torch.Tensor:
    """The norm of every sample's entries, flattened and concatenated: ``[*batch]``."""
    flat = torch.cat([p.reshape(*batch, -1) for p in parts], dim=-1)
    norm: torch.Tensor = torch.norm(flat, p=norm_ord, dim=-1)
    return norm


def _explanations(given: Any, batch: torch.Size, source: str) -> TensorDictBase:
    if not isinstance(given, TensorDictBase):
        raise TypeError(f"{_CALLER}: {source} must give a TensorDict of explanations for TensorDict inputs (tensors "
                        f"for tensor inputs), got {type(given).__name__}")
    if given.batch_size != batch or given.is_empty():
        raise ValueError(f"{_CALLER}: {source} gave explanations of batch size {list(given.batch_size)} holding "
                         f"{list(given.keys(True, True))}; the inputs it was given have batch size {list(batch)}")
    return given


def _expand_kwargs(kwargs: dict[str, Any], td: TensorDictBase, k: int) -> dict[str, Any]:
    """``target`` and ``baselines`` with one entry per sample, repeated for the copies ``[*B, k]``."""
    out = dict(kwargs)
    if "target" in out:
        target = out["target"]
        if isinstance(target, torch.Tensor) and target.shape == td.batch_size and target.dim():
            out["target"] = repeated_target(target, td.batch_size, k)
    baselines = out.get("baselines")
    if isinstance(baselines, TensorDictBase) and baselines.batch_size == td.batch_size:
        out["baselines"] = repeated(baselines, k)
    return out


Expand = Callable[[dict[str, Any], TensorDictBase, int], dict[str, Any]]


def _as_tensordicts(explanation_func: ExplainFn, perturb_func: PerturbFn,
                    inputs: Any) -> tuple[TensorDictBase, ExplainFn, PerturbFn, Expand]:
    """Tensor inputs (captum's calls) as TensorDicts, the functions seeing tensors as in captum."""
    if isinstance(inputs, TensorDictBase):
        return inputs, explanation_func, perturb_func, _expand_kwargs
    if not isinstance(inputs, torch.Tensor) or inputs.dim() == 0:
        raise TypeError(f"{_CALLER}: inputs must be a TensorDict, or a tensor whose first dim is the batch, got "
                        f"{type(inputs).__name__ if not isinstance(inputs, torch.Tensor) else 'a 0-d tensor'}")
    key: NestedKey = "input"
    n = len(inputs)
    td = TensorDict({key: inputs}, batch_size=[n])

    def flat(copies: TensorDictBase) -> torch.Tensor:
        x: torch.Tensor = copies.get(key)
        return x.reshape(-1, *inputs.shape[1:])

    def as_td(t: Any, like: TensorDictBase, source: str) -> TensorDict:
        if isinstance(t, tuple) and len(t) == 1:  # (captum's default perturbation returns one-tuples)
            t = t[0]
        if not isinstance(t, torch.Tensor) or t.numel() != like.get(key).numel():
            raise ValueError(f"{_CALLER}: {source} must return a tensor shaped like the inputs it was given, "
                             f"{[like.numel(), *inputs.shape[1:]]}, got {getattr(t, 'shape', type(t).__name__)}")
        return TensorDict({key: t.reshape(like.get(key).shape)}, batch_size=like.batch_size)

    def explain(copies: TensorDictBase, **kw: Any) -> TensorDict:
        return as_td(explanation_func(flat(copies), **kw), copies, "explanation_func")

    def perturb(copies: TensorDictBase, radius: float) -> TensorDict:
        return as_td(perturb_func(flat(copies), radius), copies, "perturb_func")

    def expand(kw: dict[str, Any], _: TensorDictBase, k: int) -> dict[str, Any]:
        out = dict(kw)
        target = out.get("target")
        if isinstance(target, torch.Tensor) and target.numel() > 1:
            out["target"] = target.repeat_interleave(k, 0)
        baselines = out.get("baselines")
        if isinstance(baselines, torch.Tensor) and baselines.shape == inputs.shape:
            out["baselines"] = baselines.repeat_interleave(k, 0)
        return out

    return td, explain, perturb, expand
