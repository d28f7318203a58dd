"""Which runs of a causal sweep share a chunk: bands of neighbouring modules, cut by position."""

# NOTE [causal chunks]
# A chunk runs its runs from its first run's start ``a`` on (NOTE [causal sweeps]): what
# comes before its lowest patched module ``m`` once (the part ``vmap`` shares, a share
# ``q`` of the forward, `share_before`) and the rest once per run. With ``T`` positions and
# ``F`` a forward's fixed cost in positions (NOTE [sweep chunks]), a chunk of ``n`` runs
# costs about ``F + q (T - a) + n (1 - q) (T - a)``. Two things are traded against ``F``:
#
# - runs of one module at later positions than ``a`` run positions ``[a, p)`` that only
#   repeat the corrupted run's;
# - runs patching a module above ``m`` run the modules between ``m`` and theirs once each,
#   where alone they would share them.
#
# The plan puts the modules, in the order of the forward, into bands of ``h`` neighbours
# (for each ``h`` in turn), cuts each band's runs, ordered by start, into the chunks of
# least total cost (dynamic programming over the distinct starts), and keeps the cheapest
# ``h``. On a default GPT-2's 12 layers x 16 positions the model's cost is 15% below one
# module per chunk. ``chunk_size`` and the memory of NOTE [sweep chunks] cap a chunk's
# runs (a longer one is split evenly); the numbers never depend on the plan.

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["causal_chunks"]

_WINDOW = 64  # the most distinct starts one chunk spans (the plan's cost stays linear in the positions)
_HEIGHTS = (1, 2, 3, 4, 6, 8, 12, 16)  # band heights tried when there are many modules


def causal_chunks(modules: Sequence[Sequence[int]], shares: Sequence[float], starts: Sequence[int],
                  length: int, fixed: float, most: int) -> list[list[int]]:
    """The runs (indices into ``starts``) in chunks, each ordered by start (NOTE [causal chunks]).

    ``modules`` holds the runs of each patched module, in the order of the forward,
    ``shares[i]`` the share of the forward before module ``i``; ``fixed`` is ``F`` in
    positions and ``most`` the most runs of a chunk.
    """
    heights = range(1, len(modules) + 1) if len(modules) <= _HEIGHTS[-1] else (*_HEIGHTS, len(modules))
    best: tuple[float, list[list[int]]] | None = None
    for height in heights:
        cost, chunks = 0.0, []
        for lo in range(0, len(modules), height):
            band = sorted((k for runs in modules[lo : lo + height] for k in runs), key=starts.__getitem__)
            band_cost, band_chunks = _cut(band, starts, shares[lo], length, fixed, most)
            cost += band_cost
            chunks += band_chunks
        if best is None or cost < best[0]:
            best = (cost, chunks)
    return best[1] if best is not None else []


def _cut(band: list[int], starts: Sequence[int], share: float, length: int, fixed: float, most: int,
         ) -> tuple[float, list[list[int]]]:
    """The least cost of ``band`` (runs ordered by start) in chunks cut between distinct starts, and the chunks."""
    firsts = [i for i, k in enumerate(band) if i == 0 or starts[k] != starts[band[i - 1]]] + [len(band)]
    points = len(firsts) - 1
    best = [0.0] * (points + 1)
    cut_at = [points] * (points + 1)
    for i in range(points - 1, -1, -1):
        left = length - starts[band[firsts[i]]]
        best[i] = math.inf
        for j in range(i + 1, min(points, i + _WINDOW) + 1):
            n = firsts[j] - firsts[i]
            cost = math.ceil(n / most) * (fixed + share * left) + n * (1 - share) * left + best[j]
            if cost < best[i]:
                best[i], cut_at[i] = cost, j
    chunks, i = [], 0
    while i < points:
        j = cut_at[i]
        runs = band[firsts[i] : firsts[j]]
        pieces = math.ceil(len(runs) / most)
        size = math.ceil(len(runs) / pieces)
        chunks += [runs[p : p + size] for p in range(0, len(runs), size)]
        i = j
    return best[0], chunks
