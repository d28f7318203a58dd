"""Shared benchmark helpers: medians over repeated runs, ratio tables, and the input-gradient floor."""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _digits import fastest_pooling

# the checkout these benchmarks sit in, before an installed tdhook_fn (an editable install of another
# worktree would be measured otherwise); the benchmarks import this module before tdhook_fn
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Why the allocator is pinned. On glibc, a buffer above malloc's mmap threshold is mapped
# fresh and page faults on first touch, and freed heap memory past the trim threshold goes
# back to the system, to fault again on the next call. Both thresholds move with the
# process's history: freeing a large mapped buffer raises them. So a variant's page faults
# depend on which variants ran before it, and the shuffled rounds turn that into noise of
# up to 2.3x on one row (measured on the perturbation methods: 0 to 64,000 minor faults a
# call by chunk size and history, 3-5 us each on this VM). Pinning both thresholds
# (``mallopt``, as ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` would) runs
# every variant on a warm heap whatever ran before it: the tables then time the code, not
# the allocator's history. ``TDHOOK_FN_BENCH_MALLOC=default`` leaves glibc as it is.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    libc = ctypes.CDLL(name) if name else None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()  # (None: not glibc, nothing pinned or trimmed)
if _LIBC is not None and os.environ.get("TDHOOK_FN_BENCH_MALLOC") != "default":
    _LIBC.mallopt(_M_MMAP_THRESHOLD, 64 << 20)
    _LIBC.mallopt(_M_TRIM_THRESHOLD, 1 << 30)


def median_seconds(fn: Callable[[], object], *, repeat: int = 7, min_time: float = 0.05) -> float:
    """Median time of one ``fn()`` call; each sample averages enough calls to last ``min_time / 4``."""
    fn()  # warm up caches (shadow copies, kernels)
    number = 1
    while True:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        if time.perf_counter() - start >= min_time / 4 or number >= 1 << 16:
            break
        number *= 4
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - start) / number)
    return statistics.median(samples)


def print_table(title: str, rows: list[tuple[str, float]], baselines: dict[str, float]) -> None:
    """Print medians and the ratio of each row against each named baseline time."""
    names = list(baselines)
    print(f"\n{title}")
    header = f"  {'variant':<34}{'median':>12}" + "".join(f"{'/ ' + n:>20}" for n in names)
    print(header)
    for label, seconds in rows:
        ratios = "".join(f"{seconds / baselines[n]:>19.2f}x" for n in names)
        print(f"  {label:<34}{seconds * 1e6:>10.1f}us{ratios}")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_rss_growth_mib(fn: Callable[[], object]) -> float:
    """Peak resident memory ``fn()`` adds, in MiB (Linux: ``VmHWM`` after resetting it).

    ``ru_maxrss`` cannot be reset, and import-time peaks hide smaller ones after them.
    """
    if _LIBC is not None:  # (the pinned heap keeps freed pages resident: they would hide the call's peak)
        _LIBC.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current RSS
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) / 1024


def interleaved_medians(impls: dict[str, Callable[[], object]], *, rounds: int = 9, number: int = 1,
                        clock: Callable[[], float] = time.perf_counter, shuffle: bool = True) -> dict[str, float]:
    """Median seconds per call of each implementation, measured in alternating rounds.

    On a shared machine the speed drifts over seconds; timing the implementations one
    after the other in every round exposes them all to the same drift. Each sample
    averages ``number`` calls in a row (one call of a millisecond moves by 20% from one
    sample to the next on this machine; ten in a row, by a few percent). The rows run in a
    new order each round (drawn from a fixed seed): where a row sits in a round moves its
    time, by up to 7-9% right after the plain gradient or a large floor (measured on
    ``bench_lrp``, rows swapped, three runs each); shuffled, each row takes each place.
    ``shuffle=False`` keeps the given order, for a benchmark that chose it (``bench_perturbation``).
    ``clock``: wall time by default; ``time.thread_time`` (the CPU time of this thread)
    for single-threaded code on a machine shared with other jobs, where wall time counts
    their turns too.
    """
    for fn in impls.values():
        fn()  # warm up
    samples: dict[str, list[float]] = {name: [] for name in impls}
    order, draw = list(impls), random.Random(0)
    for _ in range(rounds):
        if shuffle:
            draw.shuffle(order)
        for name in order:
            fn = impls[name]
            start = clock()
            for _ in range(number):
                fn()
            samples[name].append((clock() - start) / number)
    return {name: statistics.median(values) for name, values in samples.items()}


def cpu_medians(impls: dict[str, Callable[[], object]], *, rounds: int = 9, number: int = 1,
                shuffle: bool = True) -> dict[str, float]:
    """`interleaved_medians` in CPU seconds of this process (``time.process_time``).

    For one-thread runs: their wall time on an idle machine, and steadier on a shared one.
    """
    return interleaved_medians(impls, rounds=rounds, number=number, clock=time.process_time, shuffle=shuffle)


def in_our_units(mine: dict[str, float], theirs: dict[str, float], unit: str) -> dict[str, float]:
    """Both runs' medians together, theirs rescaled so the ``unit`` row both timed takes our time.

    For oracles timed in a round of their own (after which ours may run slower): the
    plain gradient timed in both rounds converts their times into ours.
    """
    scale = mine[unit] / theirs[unit]
    return {**mine, **{name: seconds * scale for name, seconds in theirs.items() if name != unit}}


def input_gradient(model: torch.nn.Module, x: torch.Tensor, target: int) -> Callable[[], torch.Tensor]:
    """The floor of the gradient methods: the gradient of ``model(x)[..., target]`` in ``x`` only.

    On a copy of the model whose weights do not require grad (no weight gradients built), a
    ``Sequential``'s max pooling on channels-last copies (`_digits.fastest_pooling`, as the
    gradient methods of tdhook_fn run it).
    """
    frozen = copy.deepcopy(model).requires_grad_(False)
    if isinstance(frozen, torch.nn.Sequential):
        frozen = fastest_pooling(frozen)

    def gradient() -> torch.Tensor:
        inputs = x.detach().requires_grad_()
        (grad,) = torch.autograd.grad(frozen(inputs)[..., target].sum(), inputs)
        return grad

    return gradient
