"""Task vectors (Ilharco et al. 2022) as TensorDict arithmetic on parameter sets."""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from tensordict import TensorDictBase

from ._checks import check_same_structure, check_tensordict

__all__ = ["apply_vectors", "best_alpha", "forget_vector", "sweep_alphas", "task_vector"]


def task_vector(base: TensorDictBase, finetuned: TensorDictBase) -> TensorDictBase:
    """``finetuned - base``: what fine-tuning changed.

    Args:
        base (TensorDict): parameters before fine-tuning (e.g. `tdhook_fn.params`).
        finetuned (TensorDict): parameters after, with the same keys and shapes.

    Raises:
        TypeError: an argument is not a TensorDict (e.g. a module: pass ``tdhook_fn.params(it)``).
        ValueError: the keys or shapes differ (they are named).

    Examples:
        >>> import torch, tdhook_fn
        >>> net = torch.nn.Linear(2, 2)
        >>> base = tdhook_fn.params(net)
        >>> tuned = base.apply(lambda t: t + 1)
        >>> torch.equal(apply_vectors(base, task_vector(base, tuned))["weight"], tuned["weight"])
        True
    """
    check_tensordict("task_vector", "base", base)
    check_tensordict("task_vector", "finetuned", finetuned)
    check_same_structure("task_vector", base, finetuned)
    return _minus(finetuned, base)


def _minus(a: TensorDictBase, b: TensorDictBase) -> TensorDictBase:
    """``a - b`` leaf by leaf; bool buffers (no subtraction) hold where they differ (apply_vectors keeps base's)."""
    return cast(TensorDictBase, a.apply(lambda x, y: x != y if x.dtype == torch.bool else x - y, b))


def forget_vector(base: TensorDictBase, finetuned: TensorDictBase) -> TensorDictBase:
    """``base - finetuned``: the negated task vector, to unlearn the task.

    Args:
        base (TensorDict): the base model's parameters.
        finetuned (TensorDict): the fine-tuned model's parameters, same keys and shapes.

    Raises:
        TypeError: an argument is not a TensorDict.
        ValueError: the keys or shapes differ (they are named).
    """
    check_tensordict("forget_vector", "base", base)
    check_tensordict("forget_vector", "finetuned", finetuned)
    check_same_structure("forget_vector", base, finetuned)
    return _minus(base, finetuned)


def _check_alpha(alpha: object) -> None:
    if isinstance(alpha, torch.Tensor):
        if alpha.dim() != 0:
            raise ValueError(f"apply_vectors: alpha must be a number or a 0-d tensor, got shape {tuple(alpha.shape)}")
        return
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(f"apply_vectors: alpha must be a number (or a 0-d tensor), e.g. alpha=0.5, got {alpha!r}")
    if not math.isfinite(alpha):
        raise ValueError(f"apply_vectors: alpha must be finite, got {alpha!r}")


def apply_vectors(base: TensorDictBase, *vectors: TensorDictBase, alpha: float | torch.Tensor = 1.0) -> TensorDictBase:
    """``base + alpha * sum(vectors)`` on floating and complex tensors; integer and bool buffers stay ``base``'s.

    Args:
        base (TensorDict): parameters to start from.
        *vectors (TensorDict): task or forget vectors keyed and shaped like ``base``.
        alpha (float | Tensor): keyword-only scale of their sum; a 0-d tensor can be
            differentiated. Default: 1.0.

    Raises:
        TypeError: ``base`` or a vector is not a TensorDict (a number among the vectors is
            taken for a positional alpha: pass ``alpha=...``), or ``alpha`` is not a number.
        ValueError: a vector's keys or shapes differ from ``base``'s, or ``alpha`` is not finite.

    Examples:
        >>> import torch, tdhook_fn
        >>> base = tdhook_fn.params(torch.nn.Linear(2, 2))
        >>> doubled = apply_vectors(base, base, base, alpha=0.5)
        >>> torch.allclose(doubled["weight"], 2 * base["weight"])
        True
    """
    check_tensordict("apply_vectors", "base", base)
    for i, vector in enumerate(vectors):
        if isinstance(vector, numbers.Number) or (isinstance(vector, torch.Tensor) and vector.dim() == 0):
            shown = vector.item() if isinstance(vector, torch.Tensor) else vector
            raise TypeError(
                f"apply_vectors: positional argument {i + 2} is {vector!r}, not a vector TensorDict: "
                f"alpha is keyword-only, pass alpha={shown!r}"
            )
        check_tensordict("apply_vectors", f"vectors[{i}]", vector, "e.g. from task_vector or forget_vector")
        check_same_structure("apply_vectors", base, vector)
    _check_alpha(alpha)
    if not vectors:
        return base.clone()
    total = vectors[0] if len(vectors) == 1 else cast(TensorDictBase, sum(vectors[1:], vectors[0]))

    def shift(b: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return b + _times(v, alpha) if _moves(b) else b

    return cast(TensorDictBase, base.apply(shift, total))


_HALF = (torch.float16, torch.bfloat16)


def _moves(b: torch.Tensor) -> bool:
    """Whether a vector shifts this tensor: real and complex weights (spectral layers); not integer or bool buffers."""
    return b.is_floating_point() or b.is_complex()


def _times(v: torch.Tensor, alpha: float | torch.Tensor) -> torch.Tensor:
    """``alpha * v`` rounded once, as with a Python-number alpha, whatever form alpha takes.

    A Python number multiplies a half-precision tensor in float32 and rounds the product;
    a tensor alpha would be rounded to the half dtype first (0.7 becomes 0.69921875 in
    bf16), so the same alpha gave other weights by another path (``sweep_alphas``' vmap).
    """
    if v.dtype in _HALF:
        return (v.float() * (alpha.float() if isinstance(alpha, torch.Tensor) else alpha)).to(v.dtype)
    return alpha * v


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


def _stacked(base: TensorDictBase, vector: TensorDictBase, alphas: torch.Tensor) -> TensorDictBase:
    """``base + alpha * vector`` for each alpha, batch ``[len(alphas)]``."""

    def shift(b: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not _moves(b):
            return b.expand(len(alphas), *b.shape)
        a = alphas.to(torch.float32 if b.dtype in _HALF else b.dtype).reshape(-1, *[1] * b.dim())
        return b + _times(v, a)

    return cast(TensorDictBase, base.apply(shift, vector, batch_size=[len(alphas), *base.batch_size]))


def sweep_alphas(
    fn: Callable[[TensorDictBase], torch.Tensor],
    base: TensorDictBase,
    vector: TensorDictBase,
    alphas: Sequence[float] | torch.Tensor,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``fn(base + alpha * vector)`` for every alpha, stacked.

    **vmap or loop.** One ``vmap`` over the alphas wins when ``fn`` evaluates little data
    (per-call overhead dominates); a loop wins on large evaluation sets, where a vmapped matmul over K
    weight sets is slower than K plain ones and holds K copies of the parameters. With
    ``chunk_size=None`` the choice is measured: two alphas run alone, the second timed.
    Under a millisecond per evaluation the rest run in ``vmap`` chunks of 16 (overhead
    dominates there; vmap of two alphas is not yet faster per alpha than the loop, of
    sixteen it is 2.5x faster on a 64-sample MLP). Slower evaluations time ``vmap`` on
    the next two alphas and evaluate the rest the cheaper way. ``fn`` that cannot be
    vmapped (``.item()``, data-dependent control flow) falls back to the loop.

    Args:
        fn (Callable[[TensorDict], Tensor]): a score of one parameter set, e.g. accuracy
            of ``tdhook_fn.call(model, p, x)``.
        base (TensorDict): parameters at ``alpha = 0``.
        vector (TensorDict): direction, e.g. a task or forget vector.
        alphas (Sequence[float] | Tensor): the scalings to evaluate.
        chunk_size (int | None): ``1`` forces the loop; ``k > 1`` vmaps ``k`` alphas at a
            time; ``None`` measures. Default: ``None``.

    Returns:
        Tensor: ``[len(alphas), *fn_output_shape]``.

    Raises:
        TypeError: ``fn`` is not callable, ``base`` or ``vector`` is not a TensorDict, or
            ``alphas`` is not a sequence of numbers or a 1-d tensor (a single number included:
            pass ``[a]``).
        ValueError: the structures differ, ``alphas`` is empty, not 1-d or not finite, or
            ``chunk_size`` is not ``None`` or an int > 0.
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
    def one(a: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(fn(apply_vectors(base, vector, alpha=float(a))))

    def many(chunk: torch.Tensor) -> torch.Tensor:
        return torch.func.vmap(fn)(_stacked(base, vector, chunk))

    if chunk_size == 1:
        return torch.stack([one(a) for a in values])
    if chunk_size is not None:
        return torch.cat([many(values[i : i + chunk_size]) for i in range(0, len(values), chunk_size)])
    return _measured(one, many, values)


_OVERHEAD_BOUND_S = 1e-3  # below this per evaluation, per-call overhead dominates: vmap wins
_VMAP_CHUNK = 16


def _measured(one: Callable[[Any], torch.Tensor], many: Callable[[torch.Tensor], torch.Tensor],
              values: torch.Tensor) -> torch.Tensor:
    results = [one(values[0])]  # also warms up caches, so the next one is timed fairly
    if len(values) == 1:
        return torch.stack(results)
    start = time.perf_counter()
    results.append(one(values[1]))
    per_alpha_loop = time.perf_counter() - start
    rest = values[2:]
    try:
        if per_alpha_loop >= _OVERHEAD_BOUND_S and len(rest) > 2:
            start = time.perf_counter()
            results += list(many(rest[:2]))
            if (time.perf_counter() - start) / 2 >= per_alpha_loop:
                return torch.stack(results + [one(a) for a in rest[2:]])
            rest = rest[2:]
        chunks = [rest[i : i + _VMAP_CHUNK] for i in range(0, len(rest), _VMAP_CHUNK)]
        results += [r for chunk in chunks for r in many(chunk)]
    except Exception:  # fn is not vmappable: the loop it is
        results = results[:2] + [one(a) for a in values[2:]]
    return torch.stack(results)


def best_alpha(alphas: Sequence[float], scores: Sequence[float] | torch.Tensor,
               adequate: Sequence[bool] | torch.Tensor) -> float:
    """The alpha with the highest score among the adequate ones, as tdhook picks it.

    Ties go to the earliest alpha; the alpha is returned as given.

    Args:
        alphas (Sequence[float]): the alphas tried.
        scores (Sequence[float] | Tensor): the score of each.
        adequate (Sequence[bool] | Tensor): whether each is acceptable.

    Raises:
        ValueError: ``alphas``, ``scores`` and ``adequate`` differ in length.
        RuntimeError: no alpha is adequate (tdhook's error).

    Examples:
        >>> best_alpha([0.5, 1.0, 1.5], [0.9, 0.95, 0.97], [True, True, False])
        1.0
    """
    lengths = len(alphas), len(scores), len(adequate)
    if len(set(lengths)) != 1:
        raise ValueError(
            f"best_alpha: got {lengths[0]} alphas, {lengths[1]} scores and {lengths[2]} adequacy flags: pass one "
            "score and one flag per alpha (e.g. both from sweep_alphas over the same alphas)"
        )
    candidates = [(a, float(s)) for a, s, ok in zip(alphas, scores, adequate, strict=True) if bool(ok)]
    if not candidates:
        raise RuntimeError("No value satisfies the control adequacy criterion")
    return max(candidates, key=lambda pair: pair[1])[0]
