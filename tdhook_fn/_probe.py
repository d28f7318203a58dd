"""Running a forward on meta tensors to learn shapes and run counts, without compute."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from tensordict import TensorDictBase

from ._functional import with_copied_inputs

__all__ = ["on_meta"]

T = TypeVar("T")


def on_meta(run: Callable[[TensorDictBase, TensorDictBase], T], params: TensorDictBase, td: TensorDictBase,
            reset: Callable[[], Any] = lambda: None) -> T:
    """``run(params, td)`` with every tensor on the ``meta`` device (shapes only, no compute).

    A forward that meta tensors cannot run (data-dependent control flow) is run for real,
    without grad, on copies of the inputs (it may write them in place), after ``reset()``
    clears whatever the failed attempt recorded.
    """
    if torch.compiler.is_compiling():  # tracing already runs on fake tensors; the unused probe is dead code
        return run(params, td)       # in the graph (meta copies would be new guards on every call)
    meta = lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")
    try:
        return run(cast(TensorDictBase, params.apply(meta)), cast(TensorDictBase, td.apply(meta)))
    except Exception:
        reset()
        with torch.no_grad():
            return run(params, with_copied_inputs(td))
