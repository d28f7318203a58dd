"""The compat integrated-gradients context call stays a short walk (benchmarks/count_calls.py measures it).

Python calls are counted with ``sys.setprofile`` (deterministic: no timing). What compat adds
to the pure `integrated_gradients` call it makes is bounded: at most 44 calls, in at most
4 files of compat's own (issue 24: the whole walk was 335 calls across 28 files; its goal
120 calls and 12 files; today 114 calls, 44 more than the pure call's 70, in 4 compat files, 12 in all: a
callable target, as compat's, is its own target and skips the target rules' file). Two of them switch the
context's own hooks on at entry and off at exit, so that ``disable_context_hooks`` can.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import integrated_gradients
from tdhook_fn.compat.attribution import IntegratedGradients

_PACKAGE = os.path.dirname(os.path.realpath(tdhook_fn.__file__)) + os.sep


def _walk(fn: Callable[[], Any]) -> tuple[int, set[str]]:
    """Python calls ``fn()`` makes into tdhook_fn's files, and those files."""
    fn()  # warm-up: first-time imports and caches
    calls, files = 0, set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(_PACKAGE):
            calls += 1
            files.add(frame.f_code.co_filename[len(_PACKAGE):])

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls, files


def _first(outputs: TensorDict, additional: Any = None) -> TensorDict:
    return outputs.apply(lambda value: value[..., 0])


def test_the_compat_ig_call_adds_at_most_44_calls_in_4_compat_files() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(2, 4)
    td = lambda: TensorDict(input=x, baseline=TensorDict(input=torch.zeros_like(x), batch_size=[2]),
                            batch_size=[2])
    f = tdhook_fn.functional(model)

    def compat() -> None:
        with IntegratedGradients(init_attr_targets=_first).prepare(model) as hooked:
            hooked(td())

    def pure() -> None:
        integrated_gradients(f, tdhook_fn.params(model), td().select("input"), td()["baseline"], target=_first,
                             multiply_by_inputs=False)

    compat_calls, compat_files = _walk(compat)
    pure_calls, _ = _walk(pure)
    own_files = sorted(name for name in compat_files if name.startswith("compat" + os.sep))
    assert compat_calls - pure_calls <= 44, (compat_calls, pure_calls)
    assert len(own_files) <= 4, own_files
    assert compat_calls <= 120 and len(compat_files) <= 12, (compat_calls, sorted(compat_files))
