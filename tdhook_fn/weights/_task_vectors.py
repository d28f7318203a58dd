"""Task vectors (Ilharco et al. 2022) as TensorDict arithmetic on parameter sets."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import cast

import torch
from tensordict import TensorDictBase

from ._checks import check_same_structure, check_tensordict

__all__ = ["HALF", "apply_vectors", "best_alpha", "forget_vector", "moves", "task_vector", "times"]


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
        return b + times(v, alpha) if moves(b) else b

    return cast(TensorDictBase, base.apply(shift, total))


HALF = (torch.float16, torch.bfloat16)


def moves(b: torch.Tensor) -> bool:
    """Whether a vector shifts this tensor: real and complex weights (spectral layers); not integer or bool buffers."""
    return b.is_floating_point() or b.is_complex()


def times(v: torch.Tensor, alpha: float | torch.Tensor) -> torch.Tensor:
    """``alpha * v`` rounded once, as with a Python-number alpha, whatever form alpha takes.

    A Python number multiplies a half-precision tensor in float32 and rounds the product;
    a tensor alpha would be rounded to the half dtype first (0.7 becomes 0.69921875 in
    bf16), so the same alpha gave other weights by another path (``sweep_alphas``' vmap).
    """
    if v.dtype in HALF:
        return (v.float() * (alpha.float() if isinstance(alpha, torch.Tensor) else alpha)).to(v.dtype)
    return alpha * v


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
