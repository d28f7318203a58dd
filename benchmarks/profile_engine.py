"""The fixed Python cost of one gradient-engine call, on a tiny MLP: calls per call and CPU time.

For each case, ``total_calls`` is cProfile's count of Python and builtin calls made by one
call after two warm-up calls (steady on a shared machine, unlike times); the times are
medians of 7 rounds of 50 calls, in CPU microseconds of this one-thread process, with a
plain ``torch.autograd.grad`` of the same target as the floor. ``--profile CASE`` prints
the cProfile table of 200 calls of one case. Run (from a worktree, with
``PYTHONPATH=<worktree>``): ``python benchmarks/profile_engine.py``.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import saliency
from tdhook_fn.attribution._engine import gradients
from tdhook_fn.attribution._smoothgrad import smoothgrad

TARGET = 3


def cases() -> dict[str, Callable[[], Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)).eval()
    f, p = tdhook_fn.pure(model)
    x = TensorDict(input=torch.randn(32, 64), batch_size=[32])
    classes = torch.randint(0, 10, (32,))
    frozen = nn.Sequential(*model).requires_grad_(False)

    def floor() -> torch.Tensor:
        leaf = x["input"].detach().requires_grad_()
        (grad,) = torch.autograd.grad(frozen(leaf)[:, TARGET].sum(), leaf)
        return grad

    return {
        "floor: autograd.grad": floor,
        "gradients, int target": lambda: gradients(f, p, x, TARGET, input_keys=("input",)),
        "gradients, class tensor": lambda: gradients(f, p, x, classes, input_keys=("input",)),
        "saliency": lambda: saliency(f, p, x, target=TARGET),
        "smoothgrad, 5 samples": lambda: smoothgrad(f, p, x, target=TARGET, nt_samples=5, stdevs=0.1),
    }


def calls_per_call(fn: Callable[[], Any]) -> int:
    fn()
    fn()
    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    return int(pstats.Stats(profile).total_calls)  # type: ignore[attr-defined]


def cpu_us(fn: Callable[[], Any], rounds: int = 7, number: int = 50) -> float:
    times = []
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(number):
            fn()
        times.append((time.process_time() - start) / number * 1e6)
    return sorted(times)[rounds // 2]


def main() -> None:
    torch.set_num_threads(1)
    table = cases()
    if len(sys.argv) > 2 and sys.argv[1] == "--profile":
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(200):
            table[sys.argv[2]]()
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(40)
        print(out.getvalue())
        return
    print(f"{'case':28s} {'calls/call':>10s} {'CPU us':>9s}")
    for name, fn in table.items():
        print(f"{name:28s} {calls_per_call(fn):10d} {cpu_us(fn):9.0f}")


if __name__ == "__main__":
    main()
