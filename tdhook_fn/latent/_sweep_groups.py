"""Sites grouped by the module they read, and the runs of a sweep that patch nothing."""

# NOTE [unchanged sites]
# A run whose clean selection equals the corrupted one bit for bit (``-0.0`` is not
# ``0.0``) patches nothing: it *is* the corrupted run, and its metric is the corrupted
# run's. In a causal model every position before the first corrupted token is such a
# site, at every layer (half the grid for a corruption in the middle of the prompt). With
# ``skip_unchanged`` (default), one forward of the corrupted inputs reads the activations
# and the metric (of all of ``f``'s outputs, its own taps' included), and only the other
# runs go through the model. The data decide which runs run, so this is done only
# outside transforms and where no gradient is asked for (there a no-op patch is not the
# corrupted run: its patched value depends on the params through the clean run).

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

from .._functional import Functional
from .._vjp import any_requires_grad, untransformed
from ._run import Metric, Reads, forward, metric_values
from ._sites import Site, as_indices

__all__ = ["Group", "group", "may_skip", "selection", "unchanged", "whole_sites"]


def selection(site: Site) -> tuple[Any, ...]:
    return (slice(None), *as_indices(site.index))


def may_skip(*tds: TensorDictBase) -> bool:
    """Whether the data may decide which runs run: eager, and no gradient asked for (NOTE [unchanged sites])."""
    return untransformed() and not (torch.is_grad_enabled() and any_requires_grad(tds))


def unchanged(f: Functional, params: TensorDictBase, corrupted: TensorDictBase, chosen: Sequence[Site],
               modules: dict[Group, Site], full: dict[str, Any], metric: Metric, batch: torch.Size,
               ) -> tuple[list[int], torch.Tensor, TensorDictBase]:
    """The runs that patch something, every run's value with the unchanged ones filled in, and the corrupted
    run's outputs (``f``'s keys)."""
    wholes = list(modules.values())
    reads = Reads("patching_sweep", wholes)
    out = forward(f, params, corrupted.reshape(-1), reads.taps())  # all of f's outputs, as a patched run's
    base = metric_values("patching_sweep", metric, out, batch)
    mine = {whole.key: reads.get(whole) for whole in wholes}
    todo = []
    for k, site in enumerate(chosen):
        key, where = modules[group(site)].key, selection(site)
        if not _same_bits(full[key][where], mine[key][where]):
            todo.append(k)
    return todo, base.expand(len(chosen), *base.shape).clone(), out.select(*f.out_keys)


_AS_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit: ``-0.0`` and ``0.0`` differ (a patch that flips a zero's sign patches something)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point() and a.element_size() in _AS_INTEGERS:
        as_int = _AS_INTEGERS[a.element_size()]
        return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))
    return torch.equal(a, b)


Group = tuple[str, str, int | None, int]


def group(site: Site) -> Group:
    return (site.path, site.site, site.call, site.element)


def whole_sites(sites: Sequence[Site]) -> dict[Group, Site]:
    """A whole-activation site for each module (and element) the sites read, keyed as the user would name it.

    Its key (the path, with ``:input``, ``#element``, ``@call``) is what an error about it names.
    """
    out: dict[Group, Site] = {}
    for site in sites:
        key = group(site)
        if key not in out:
            out[key] = Site(site.path, element=site.element, site=site.site, call=site.call)
    return out
