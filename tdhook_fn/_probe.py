"""Running a forward on meta tensors to learn shapes and run counts, without compute; and whether the forward
running now is such a probe (`measuring`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any, TypeVar, cast

import torch
from tensordict import TensorDictBase

from ._functional import with_copied_inputs

__all__ = ["measuring", "measuring_only", "on_meta"]

T = TypeVar("T")

_MEASURING: ContextVar[bool] = ContextVar("tdhook_fn_measuring", default=False)

# NOTE [taps in probes]
# Before its real forwards a method may run probes: layer shapes and run counts on meta
# tensors, the widest activation of one sample to size chunks. A custom tap with side effects
# (a counter, a cache, a user's hook in compat) may leave them alone (`measuring`), so that it
# sees only the forwards the method computes with. A tap that changes an activation's shape
# then goes unmeasured, and the real forward contradicts the probe: the layer attributions
# (`with_specs`) then probe once more with every tap running (``every_tap``), and only a
# forward contradicting that one too is a model that runs differently from one forward to the
# next. Such a tap thus runs once in a probe, on the first call of a model and input shape.


def measuring() -> bool:
    """Whether the forward running now only measures (shapes, run counts, the widest activation): its numbers
    are not the method's. A custom tap with side effects (one counting its calls, or a user's hook in
    `tdhook_fn.compat`) may leave such a forward alone (NOTE [taps in probes])."""
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
            reset: Callable[[], Any] = lambda: None, *, every_tap: bool = False) -> T:
    """``run(params, td)`` with every tensor on the ``meta`` device (shapes only, no compute), `measuring`
    (``every_tap``: not, so that the taps which leave probes alone run too: NOTE [taps in probes]).

    A forward that meta tensors cannot run (data-dependent control flow) is run for real,
    without grad, on copies of the inputs (it may write them in place), after ``reset()``
    clears whatever the failed attempt recorded.
    """
    if torch.compiler.is_compiling():  # tracing already runs on fake tensors; the unused probe is dead code
        return run(params, td)       # in the graph (meta copies would be new guards on every call)
    meta = lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")
    with nullcontext() if every_tap else measuring_only():
        try:
            return run(cast(TensorDictBase, params.apply(meta)), cast(TensorDictBase, td.apply(meta)))
        except Exception:
            reset()
            with torch.no_grad():
                return run(params, with_copied_inputs(td))
