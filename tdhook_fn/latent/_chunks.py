"""How many runs of a patching sweep go through the model at once."""

# NOTE [sweep chunks]
# A chunk of ``n`` runs under ``vmap`` costs one forward's fixed part ``F`` (every weight
# read once, the Python of one forward: on the CPU about as much as 16 rows, a row being
# one sample at one position), the part below its first patched module once (``q W``,
# with ``W`` one run's work and ``q`` the share of the forward before that module,
# `share_before`) and the rest once per run: per run ``(F + q W) / n + (1 - q) W``.
# The default ``n`` is the least that brings the shared part under a tenth of the rest,
# ``n >= (F + q W) / (0.1 (1 - q) W)`` (a folded chunk shares nothing: ``q = 0``), capped
# by memory: ``n`` runs' outputs (from the meta forward) and eight times their largest
# activation at the sites (for what the modules make on the way) within 1 GiB.
# A ``chunk_size`` given is ``n``. The runs go in the order of their modules in the
# model (so a chunk's runs share the most), the rest split evenly at that size. One run's
# rows are the elements of its largest site activation over its last dim (samples x
# positions of a ``[N, T, D]`` residual stream).

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ._causal import share_before
from ._sites import Site
from ._sweep_groups import Group, group

__all__ = ["FIXED_ROWS", "RunSize", "by_memory", "chunked", "run_size"]

FIXED_ROWS = 16  # one forward's fixed cost, in rows of work (NOTE [sweep chunks])
_MEMORY = 1 << 30  # bytes a chunk's runs may take
_SHARED_LEFT = 0.1  # the shared part's most, per run, against the rest
_SCRATCH = 8  # a module's intermediates, in units of the largest site activation


@dataclass(frozen=True)
class RunSize:
    """One patched run's work and memory."""

    rows: int  # samples x positions
    bytes: int


def run_size(shapes: Iterable[tuple[torch.Size, torch.dtype]], out_bytes: int) -> RunSize:
    """A run's size from its site activations' shapes (batch first) and its outputs' bytes."""
    sizes = list(shapes)
    shape, dtype = max(sizes, key=lambda s: s[0].numel())
    rows = shape.numel() // shape[-1] if len(shape) > 1 and shape[-1] else shape[0] if shape else 1
    largest = shape.numel() * torch.empty((), dtype=dtype).element_size()
    return RunSize(max(rows, 1), out_bytes + _SCRATCH * largest)


def by_memory(size: RunSize) -> int:
    """The most runs of ``size`` whose memory fits a chunk."""
    return max(1, _MEMORY // max(size.bytes, 1))


def _runs_per_chunk(size: RunSize, before: float) -> int:
    q = min(max(before, 0.0), 0.95)
    return math.ceil((FIXED_ROWS + q * size.rows) / (_SHARED_LEFT * (1 - q) * size.rows))


def chunked(model: nn.Module, runs: Sequence[Site], size: RunSize, cap: int | None, share: bool) -> list[list[int]]:
    """The runs' indices in chunks (NOTE [sweep chunks]); ``share``: under ``vmap``, which shares the part below."""
    shares: dict[Group, float] = {}
    for site in runs:
        if group(site) not in shares:
            shares[group(site)] = share_before(model, site) if share else 0.0
    before = [shares[group(site)] for site in runs]
    order = sorted(range(len(runs)), key=before.__getitem__)
    chunks, at = [], 0
    while at < len(order):
        left = len(order) - at
        if cap is not None:  # the caller's size, as given
            n = min(cap, left)
        else:
            n = min(_runs_per_chunk(size, before[order[at]]), by_memory(size), left)
            n = math.ceil(left / math.ceil(left / n))  # the rest in even chunks of at most n
        chunks.append(order[at : at + n])
        at += n
    return chunks
