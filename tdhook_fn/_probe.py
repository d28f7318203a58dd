"""Running a forward on meta tensors to learn shapes and run counts, without compute; and whether the forward
running now is such a probe (`measuring`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar, cast

import torch
from tensordict import TensorDictBase

from ._functional import with_copied_inputs

__all__ = ["measuring", "measuring_only", "on_meta"]

T = TypeVar("T")

_MEASURING: ContextVar[bool] = ContextVar("tdhook_fn_measuring", default=False)


def measuring() -> bool:
    """Whether the forward running now only measures (shapes, run counts, the widest activation): its numbers
    are not the method's. A custom tap with side effects (one counting its calls, or a user's hook in
    `tdhook_fn.compat`) may leave such a forward alone."""
    return _MEASURING.get()


@contextmanager
def measuring_only() -> Iterator[None]:
    """The forwards run inside are probes (`measuring`)."""
    token = _MEASURING.set(True)
    try:
        yield
    finally:
        _MEASURING.reset(token)


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
    with measuring_only():
        try:
            return run(cast(TensorDictBase, params.apply(meta)), cast(TensorDictBase, td.apply(meta)))
        except Exception:
            reset()
            with torch.no_grad():
                return run(params, with_copied_inputs(td))
