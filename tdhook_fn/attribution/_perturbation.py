"""What every perturbation method shares: the checked call, the baselines, the batched evaluation."""

# NOTE [perturbation rows]
# A perturbation method evaluates the target on ``R`` *rows*: row 0 is its reference
# (the inputs themselves for ablation, occlusion and permutation; the baselines for
# Shapley sampling) and every further row is one perturbed copy of the whole batch. The
# inputs' batch ``[*B]`` is flattened to ``[N]``; a chunk of rows ``[lo, hi)`` is built
# once by the method (``build(lo, hi)`` returns the perturbed keys, ``[hi - lo, N, ...]``;
# the other inputs are broadcast views) and goes through ``f`` in one forward of
# ``(hi - lo) * N`` samples, flattened to one batch dim. ``chunk_size`` bounds ``hi - lo``
# (captum's ``perturbations_per_eval``); no Python loop runs per feature or per sample.
# Without a ``chunk_size`` the rows are split in equal chunks sized by the model's widest
# activation (NOTE [default chunk rows]): every row in one forward for a narrow model,
# forwards that stay in cache for a wide one. The target values come back as
# ``[R, N, T]``: ``T`` targets with ``per_target``, else ``T = 1``
# holding the targets' sum (tdhook's rule for several targets). The maps then come from
# differences of rows, so they are linear in the target values, as captum's.
#
# Nothing here asks for gradients. Eager, with no tensor of ``params``, the inputs or the
# baselines requiring grad, the forwards run under ``torch.no_grad`` (autograd's bookkeeping costs a
# few percent of a small model's forward); under ``torch.func.grad`` or with parameters
# that require grad they record as usual, so the maps differentiate with respect to
# ``params``.

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .._targets import Target
from .._types import NestedKey, PureFn
from .._vjp import any_requires_grad, untransformed
from ._baselines import Baselines, attributed_keys, starts_by_key
from ._chunk_rows import default_rows
from ._inputs import check_call
from ._metric_samples import check_count
from ._target_values import target_values

__all__ = ["Build", "as_maps", "check_no_extra", "checked_keys", "evaluate", "flat_baselines", "per_sample_view",
           "per_sample_views", "plain_tensors_now", "target_columns"]

Build = Callable[[int, int], dict[NestedKey, torch.Tensor]]


def checked_keys(caller: str, f: PureFn, params: TensorDictBase, inputs: TensorDictBase, target: Target,
                 input_keys: NestedKey | Sequence[NestedKey] | None, chunk_size: int | None,
                 ) -> tuple[NestedKey, ...]:
    """The checks every perturbation method runs first; the keys it perturbs.

    Unlike the gradient methods, integer inputs (token ids) may be perturbed: their
    baseline is an id.
    """
    check_count(caller, "chunk_size", chunk_size, optional=True)
    check_call(caller, f, params, inputs, (), target)
    keys = attributed_keys(caller, f, inputs, input_keys)
    present = inputs.keys(True, True)
    missing = [key for key in keys if key not in present]
    if missing:
        raise KeyError(f"{caller}: the inputs have no key {missing[0]!r} to perturb (keys: {list(present)})")
    return keys


def plain_tensors_now() -> bool:
    """Whether the tensors built now are plain ones that may serve later calls; NOTE [kept windows]."""
    return (untransformed() and not torch.is_inference_mode_enabled() and torch._C._get_tracing_state() is None
            and _get_current_dispatch_mode() is None)


def flat_baselines(caller: str, inputs: TensorDictBase, baselines: Baselines,
                   keys: Sequence[NestedKey]) -> dict[NestedKey, torch.Tensor]:
    """The baseline of each key, shaped like its flattened input ``[N, ...]`` (a broadcast view where possible)."""
    starts = starts_by_key(inputs, baselines, keys, caller)
    return {key: per_sample_view(start, inputs.batch_dims) for key, start in starts.items()}


def per_sample_views(td: TensorDictBase, keys: Sequence[NestedKey], batch_dims: int) -> dict[NestedKey, torch.Tensor]:
    """Each key's entry of ``td`` as `per_sample_view` gives it: ``[N, ...]``."""
    return {key: per_sample_view(td.get(key), batch_dims) for key in keys}


def per_sample_view(t: torch.Tensor, batch_dims: int) -> torch.Tensor:
    """``t`` ``[*B, ...]`` as ``[N, ...]`` (``[1, ...]`` for no batch dims)."""
    return t.reshape(-1, *t.shape[batch_dims:])


def evaluate(f: PureFn, params: TensorDictBase, flat: TensorDictBase, target: Target, *, rows: int, build: Build,
             chunk_size: int | None, per_target: bool, caller: str,
             baselines: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """The target values of ``rows`` rows made by ``build``, chunk by chunk, ``[R, N, T]``; NOTE [perturbation rows].

    ``baselines`` are the tensors ``build`` reads besides the inputs (for the no-grad check).
    """
    # nothing to differentiate (eager, no tensor asking for a gradient): skip autograd's bookkeeping
    quiet = untransformed() and not any_requires_grad((params, flat), baselines)
    with torch.no_grad() if quiet else contextlib.nullcontext():
        size = min(chunk_size, rows) if chunk_size else default_rows(f, params, flat, rows)
        return _chunks(f, params, flat, _repeated_target(target, size), rows, size, build, per_target, caller)


def _repeated_target(target: Target, rows: int) -> Target:
    """A tensor of class indices ``[*B]`` as ``[rows * N]``, row after row (NOTE [tensor targets]): slice it."""
    if isinstance(target, torch.Tensor) and target.dim():
        flat = target.reshape(-1)
        return flat.expand(rows, flat.shape[0]).reshape(-1)
    return target


def _chunks(f: PureFn, params: TensorDictBase, flat: TensorDictBase, target: Target, rows: int, size: int,
            build: Build, per_target: bool, caller: str) -> torch.Tensor:
    n = flat.batch_size[0]
    parts = []
    for lo in range(0, rows, size):
        k = min(lo + size, rows) - lo
        perturbed = build(lo, lo + k)
        feed = TensorDict({}, batch_size=[k * n])
        for key, value in flat.items(True, True):
            new = perturbed.get(key)
            whole = new if new is not None else value.unsqueeze(0).expand(k, *value.shape)
            feed.set(key, whole.reshape(k * n, *value.shape[1:]))
        chunk_target = target[: k * n] if isinstance(target, torch.Tensor) and target.dim() else target
        values = target_columns(caller, target_values(f, params, feed, chunk_target), feed.batch_size, per_target)
        parts.append(values.reshape(k, n, -1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def target_columns(caller: str, values: TensorDictBase, batch: torch.Size, per_target: bool) -> torch.Tensor:
    """Target values ``[*batch, T]``: one column per target with ``per_target``, else their sum (``T = 1``)."""
    total: torch.Tensor | None = None
    for key, value in values.items(True, True):
        value = cast(torch.Tensor, value)
        if not value.is_floating_point():
            raise TypeError(f"{caller}: target {key!r} is {value.dtype}; the target values must be floating point")
        if per_target:
            if value.dim() > len(batch) + 1:
                raise ValueError(f"{caller}: per_target needs target values shaped [*batch] or [*batch, T]; target "
                                 f"{key!r} has shape {tuple(value.shape[len(batch):])} per sample: flatten its target "
                                 "dims in the target")
            one = value if value.dim() == len(batch) + 1 else value.unsqueeze(-1)
        elif value.dim() == len(batch):  # (one value per sample: nothing to sum)
            one = value.unsqueeze(-1)
        else:
            one = value.reshape(*batch, -1).sum(-1, keepdim=True)
        if total is not None and total.shape != one.shape:
            raise ValueError(f"{caller}: per_target needs the same number of targets in every target key, got "
                             f"{total.shape[-1]} and {one.shape[-1]}")
        total = one if total is None else total + one
    if total is None:
        raise ValueError(f"{caller}: the target selected no value")
    return total


def as_maps(maps: dict[NestedKey, torch.Tensor], batch: torch.Size, per_target: bool) -> TensorDict:
    """Maps ``[T, N, ...]`` by key as the result: batch ``[T, *B]`` with ``per_target``, else ``[*B]``."""
    t = next(iter(maps.values())).shape[0]
    out = TensorDict({}, batch_size=[t, *batch] if per_target else batch)
    for key, value in maps.items():
        shaped = value.reshape(t, *batch, *value.shape[2:])
        out.set(key, shaped if per_target else shaped[0])
    return out


def check_no_extra(caller: str, name: str, given: Any, keys: Sequence[NestedKey]) -> None:
    """A per-key option given as a mapping must name only perturbed keys."""
    extra = [k for k in given if k not in keys]
    if extra:
        raise KeyError(f"{caller}: {name} names {extra}, which are not among the perturbed inputs {list(keys)}")
