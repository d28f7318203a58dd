"""``sweep_alphas``: a score of ``base + alpha * vector`` for each of many alphas, by ``vmap`` or a loop."""

from __future__ import annotations

import numbers
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeAlias, cast

import torch
from tensordict import TensorDict, TensorDictBase

from .._largest_tensor import LargestTensor
from .._params import leaves
from ._checks import check_same_structure, check_tensordict
from ._task_vectors import HALF, moves, times

__all__ = ["sweep_alphas"]

# NOTE [vmap or loop]
# One ``vmap`` over the alphas saves the per-call overhead of every alpha but one (on
# the benchmark's MLP, 16 alphas run 2.3x faster than the loop with 16 samples, 1.5x
# with 64); it also computes every op on the alphas of its chunk at once. While
# ``chunk`` copies of the largest tensor one evaluation creates (weights shifted by
# alpha included) stay within a cache-sized budget, that is free; beyond it each
# vmapped op streams its operands from memory (and fresh large buffers page fault),
# where a loop reuses the same warm buffers: with 2048 samples a vmap of 16 alphas is
# 1.5-2.5x slower than the loop. So the first alpha is evaluated alone while a dispatch
# mode records the largest tensor it creates (a count, not a timing: the same call
# always decides the same way), and the others run in vmapped chunks of
# ``_CACHE_BYTES // largest`` alphas, or in a loop where fewer than ``_MIN_VMAP`` would
# fit (vmap's own overhead is then not paid back). Both budgets were measured on the
# benchmark's MLP (benchmarks/bench_weights.py, one thread, 16 alphas; the loop's time
# over vmap's): vmap 1.5x faster at 8 x 64 KiB, even at 4-8 x 128 KiB, 1.2x slower at
# 4 x 256 KiB; chunks of 2 are 1.3-1.5x slower everywhere.
# The mode costs about one more evaluation; the size is recorded per fn (held weakly)
# and parameter shapes, so a later sweep of the same fn chunks every alpha at once,
# without the lone first evaluation or the mode. A fn whose closure changes size
# between sweeps keeps its first decision: slower at worst, never other numbers.
_CACHE_BYTES = 768 * 1024
_MIN_VMAP = 4
_LARGEST: weakref.WeakKeyDictionary[Any, dict[Hashable, int | None]] = weakref.WeakKeyDictionary()

Alpha: TypeAlias = float | dict[torch.dtype, torch.Tensor]


def sweep_alphas(
    fn: Callable[[TensorDictBase], torch.Tensor],
    base: TensorDictBase,
    vector: TensorDictBase,
    alphas: Sequence[float] | torch.Tensor,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``fn(base + alpha * vector)`` for every alpha, stacked.

    With ``chunk_size=None`` the alphas run in ``vmap`` chunks when one evaluation is small
    (per-call overhead dominates) and in a loop when it is large (a vmapped chunk's copies
    of every activation no longer fit in cache): the size of the largest tensor one
    evaluation creates decides, recorded at the first sweep of ``fn`` with parameters of
    these shapes. ``fn`` that cannot be vmapped
    (``.item()``, data-dependent control flow) falls back to the loop. Both ways give the
    same numbers up to the rounding of batched matmuls, except where ``fn`` draws random
    numbers outside torch (``numpy.random``, ``random``): a vmapped chunk runs ``fn`` once,
    so its alphas share one draw. Pass ``chunk_size=1`` for such a ``fn``, or draw with
    torch (vmap then refuses ``fn``'s randomness and the loop runs).

    Args:
        fn (Callable[[TensorDict], Tensor]): a score of one parameter set, e.g. accuracy
            of ``tdhook_fn.call(model, p, x)``.
        base (TensorDict): parameters at ``alpha = 0``.
        vector (TensorDict): direction, e.g. a task or forget vector.
        alphas (Sequence[float] | Tensor): the scalings to evaluate.
        chunk_size (int | None): ``1`` forces the loop; ``k > 1`` vmaps ``k`` alphas at a
            time; ``None`` chooses by the size of one evaluation. Default: ``None``.

    Returns:
        Tensor: ``[len(alphas), *fn_output_shape]``.

    Raises:
        TypeError: ``fn`` is not callable, ``base`` or ``vector`` is not a TensorDict, or
            ``alphas`` is not a sequence of numbers or a 1-d tensor (a single number included:
            pass ``[a]``).
        ValueError: the structures differ, ``alphas`` is empty, not 1-d or not finite, or
            ``chunk_size`` is not ``None`` or an int > 0.

    Examples:
        >>> import torch, tdhook_fn
        >>> from tdhook_fn.weights import task_vector
        >>> net = torch.nn.Linear(2, 1)
        >>> base = tdhook_fn.params(net)
        >>> vector = task_vector(base, base.apply(lambda t: t + 1))
        >>> sweep_alphas(lambda p: p["bias"].sum() - base["bias"].sum(), base, vector, [0.0, 0.5, 2.0])
        tensor([0.0000, 0.5000, 2.0000])
    """
    if not callable(fn):
        raise TypeError(
            f"sweep_alphas: fn must be callable (a score of one parameter set), got {type(fn).__name__}: "
            "call sweep_alphas(fn, base, vector, alphas)"
        )
    check_tensordict("sweep_alphas", "base", base)
    check_tensordict("sweep_alphas", "vector", vector, "e.g. from task_vector or forget_vector")
    check_same_structure("sweep_alphas", base, vector)
    values = _alpha_values(alphas)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"sweep_alphas: chunk_size should be None or an int > 0, got {chunk_size!r}")
    shifted = _Shifted(base, vector)

    def one(alpha: float) -> torch.Tensor:
        return torch.as_tensor(fn(shifted(alpha)))

    def many(chunk: torch.Tensor) -> torch.Tensor:
        by_dtype = {dtype: chunk.to(dtype) for dtype in shifted.alpha_dtypes}
        return torch.func.vmap(lambda alpha: fn(shifted(alpha)))(by_dtype)

    floats = values.tolist()
    if chunk_size == 1:
        return torch.stack([one(a) for a in floats])
    if chunk_size is not None:
        return torch.cat([many(values[i : i + chunk_size]) for i in range(0, len(values), chunk_size)])
    sizes, done = _sizes_of(fn), []
    if shifted.shapes not in sizes:
        first, sizes[shifted.shapes] = _evaluated_with_largest(lambda: one(floats[0]))
        done = [first]
    largest, start = sizes[shifted.shapes], len(done)
    chunk = 1 if largest is None else _chunk_for(largest, len(values) - start)
    if chunk > 1:
        try:
            rest = [many(values[i : i + chunk]) for i in range(start, len(values), chunk)]
            return torch.cat([*(d.unsqueeze(0) for d in done), *rest])
        except Exception:  # fn is not vmappable: the loop it is, now and next time
            sizes[shifted.shapes] = None
    return torch.stack(done + [one(a) for a in floats[start:]])


def _sizes_of(fn: Callable[..., Any]) -> dict[Hashable, int | None]:
    """The largest tensor ``fn`` created, by parameter shapes; a fresh dict for a fn that cannot be a weak key."""
    try:
        return _LARGEST.setdefault(fn, {})
    except TypeError:  # unhashable, or no weak reference (a bound method's goes at once: no harm)
        return {}


def _chunk_for(largest: int, count: int) -> int:
    """Alphas per vmap for ``count`` alphas whose evaluation creates tensors of up to ``largest`` bytes (1: loop).

    The chunks are made even (15 alphas that fit 12 at a time run as 8 + 7, not 12 + 3).
    """
    fits = min(_CACHE_BYTES // max(largest, 1), count)
    if fits < _MIN_VMAP:
        return 1
    chunks = -(-count // fits)
    return -(-count // chunks)


def _evaluated_with_largest(evaluate: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int | None]:
    """``evaluate()`` and the size of the largest tensor it creates (``None``: fn cannot run under the mode)."""
    mode = LargestTensor()
    try:
        with mode:
            return evaluate(), mode.bytes
    except Exception:  # fn's own error comes again from the plain call; else fn runs, unmeasured, in the loop
        return evaluate(), None


# NOTE [sweep params]
# Leaves are paired once per sweep; each alpha's parameter set is then put together as one
# nested dict of its leaves. ``TensorDict.apply`` (what ``apply_vectors`` does) costs
# about 150 us on the benchmark's 6-leaf MLP, more than its forward on 64 samples costs.
# A ``base`` that is not a tree of plain TensorDicts of one batch size and device, without
# dim names (a tensorclass, say), is built by ``apply``.
class _Shifted:
    """``base + alpha * vector`` for one alpha: a number, or under ``vmap`` the batched alpha in each dtype."""

    def __init__(self, base: TensorDictBase, vector: TensorDictBase) -> None:
        self.base, self.vector = base, vector
        bases, vectors = leaves(base), leaves(vector)
        self.keys = list(bases)
        self.pairs = [(bases[k], vectors[k]) for k in self.keys]
        # the dtype alpha multiplies each moving leaf in: half precision in float32 (as times)
        self.leaf_alpha_dtypes = [_alpha_dtype(b) if moves(b) else None for b, _ in self.pairs]
        # vmap needs one batched input even where nothing moves (integer buffers only)
        self.alpha_dtypes = list(dict.fromkeys(d for d in self.leaf_alpha_dtypes if d is not None)) or [torch.float64]
        self.plain = _plain_tree(base, base.batch_size, base.device)
        self.shapes = (tuple(self.keys), tuple((b.shape, b.dtype, b.device) for b, _ in self.pairs))

    def __call__(self, alpha: Alpha) -> TensorDictBase:
        if not self.plain:
            shift = lambda b, v: b + times(v, _in(alpha, _alpha_dtype(b))) if moves(b) else b
            return cast(TensorDictBase, self.base.apply(shift, self.vector))
        source: dict[str, Any] = {}
        for key, (b, v), dtype in zip(self.keys, self.pairs, self.leaf_alpha_dtypes, strict=True):
            node = source
            for part in key[:-1]:
                node = node.setdefault(part, {})
            node[key[-1]] = b if dtype is None else b + times(v, _in(alpha, dtype))
        return TensorDict._new_unsafe(cast(Any, source), batch_size=self.base.batch_size, device=self.base.device)


def _alpha_dtype(b: torch.Tensor) -> torch.dtype:
    return torch.float32 if b.dtype in HALF else b.dtype


def _in(alpha: Alpha, dtype: torch.dtype) -> float | torch.Tensor:
    return alpha if isinstance(alpha, float) else alpha[dtype]


def _plain_tree(td: TensorDictBase, batch_size: torch.Size, device: torch.device | None) -> bool:
    """Whether ``td`` and its nested TensorDicts are plain TensorDicts of this batch size and device, without names."""
    if type(td) is not TensorDict or td.batch_size != batch_size or td.device != device:
        return False
    if td.batch_dims and any(td.names):
        return False
    return all(
        _plain_tree(value, batch_size, device) if isinstance(value, TensorDictBase) else isinstance(value, torch.Tensor)
        for value in td.values()
    )


def _alpha_values(alphas: object) -> torch.Tensor:
    """``alphas`` as a 1-d float64 tensor, or the error saying what they should be."""
    if isinstance(alphas, torch.Tensor) or hasattr(alphas, "__array__"):
        values = torch.as_tensor(alphas).detach()
        if values.dim() != 1:
            fix = "for one alpha pass [a]" if values.dim() == 0 else "pass alphas.flatten()"
            raise ValueError(f"sweep_alphas: alphas must be 1-d, got shape {tuple(values.shape)}: {fix}")
        if values.is_complex() or values.dtype == torch.bool:
            raise TypeError(f"sweep_alphas: alphas must hold real numbers, got dtype {values.dtype}")
        values = values.to(torch.float64)
    elif isinstance(alphas, numbers.Real):
        raise TypeError(
            f"sweep_alphas: alphas must be a sequence of numbers, got the number {alphas!r}: pass alphas=[{alphas!r}], "
            f"or apply_vectors(base, vector, alpha={alphas!r}) for the one parameter set"
        )
    elif isinstance(alphas, (str, bytes)) or not isinstance(alphas, Sequence):
        got = "None" if alphas is None else f"{type(alphas).__name__} {alphas!r}"
        raise TypeError(
            f"sweep_alphas: alphas must be a sequence of numbers or a 1-d tensor, e.g. [0.0, 0.5, 1.0], got {got}"
        )
    else:
        for i, a in enumerate(alphas):
            if type(a) is float or type(a) is int:  # the usual case, without abc checks
                continue
            number = isinstance(a, numbers.Real) or (isinstance(a, torch.Tensor) and a.dim() == 0)
            if isinstance(a, bool) or not number:
                raise TypeError(f"sweep_alphas: alphas[{i}] is {a!r}, not a number")
        values = torch.tensor([float(a) for a in alphas], dtype=torch.float64)
    if len(values) == 0:
        raise ValueError("sweep_alphas: alphas is empty: pass at least one alpha, e.g. alphas=[0.0, 0.5, 1.0]")
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        i = int((~finite).nonzero()[0])
        raise ValueError(f"sweep_alphas: alphas[{i}] is {float(values[i])}: every alpha must be a finite number")
    return values
