"""Checking and shaping what the probe functions are given: activations by site, labels, classes."""

# NOTE [probe sites in one op]
# A TensorDict of activations holds one ``(N, ...)`` tensor per site, flattened to ``(N, D)``.
# Sites with the same ``(N, D)``, dtype and device are stacked into one ``(S, N, D)`` tensor
# and go through the maths as the leading batch dim, so a model's layers of one width are
# one batched solve. A plain tensor ``(..., N, D)`` is its own group.

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

__all__ = [
    "Group",
    "Labels",
    "Task",
    "as_labels",
    "check_alpha",
    "check_finite",
    "check_tensor_acts",
    "groups",
    "site_name",
    "transformed",
]

Task = Literal["auto", "classification", "regression"]


def transformed() -> bool:
    """Whether a functorch transform (``vmap``, ``grad``) is running: value checks cannot read data then."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def site_name(key: NestedKey) -> str:
    """A site key as a string for messages."""
    return key if isinstance(key, str) else ".".join(str(part) for part in key)


@dataclass(frozen=True)
class Group:
    """Sites whose activations stack into one ``(S, N, D)`` tensor (NOTE [probe sites in one op])."""

    keys: list[NestedKey]
    stacked: torch.Tensor


def groups(caller: str, acts: TensorDictBase, name: str = "acts") -> list[Group]:
    """The sites of ``acts`` flattened to ``(N, D)`` and stacked by shape, dtype and device."""
    keys = list(acts.keys(include_nested=True, leaves_only=True))
    if not keys:
        raise ValueError(f"{caller}: {name} has no sites; give a TensorDict with one (N, D) tensor per site")
    by_kind: dict[tuple[torch.Size, torch.dtype, torch.device], list[tuple[NestedKey, torch.Tensor]]] = {}
    n_first: tuple[str, int] | None = None
    for key in keys:
        value = acts.get(key)
        if not isinstance(value, torch.Tensor) or value.ndim < 2:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{caller}: {name}[{site_name(key)!r}] is {shape}; each site must be (N, D) or (N, ...)")
        _check_float(caller, value, f"{name}[{site_name(key)!r}]")
        flat = value.reshape(value.shape[0], -1)
        if n_first is None:
            n_first = (site_name(key), flat.shape[0])
        elif flat.shape[0] != n_first[1]:
            raise ValueError(
                f"{caller}: {name}[{site_name(key)!r}] has N={flat.shape[0]} samples, {name}[{n_first[0]!r}] "
                f"has {n_first[1]}; every site needs the same samples"
            )
        by_kind.setdefault((flat.shape, flat.dtype, flat.device), []).append((key, flat))
    return [Group([k for k, _ in items], torch.stack([v for _, v in items])) for items in by_kind.values()]


def _check_float(caller: str, value: torch.Tensor, what: str) -> None:
    if not value.is_floating_point():
        raise TypeError(f"{caller}: {what} has dtype {value.dtype}; activations must be floating point (cast them)")


def check_tensor_acts(caller: str, acts: torch.Tensor, name: str = "acts") -> None:
    """A plain tensor of activations is ``(..., N, D)`` and floating point."""
    if acts.ndim < 2:
        raise ValueError(f"{caller}: {name} has shape {tuple(acts.shape)}; give (..., N, D) or a TensorDict of sites")
    _check_float(caller, acts, name)


def check_finite(caller: str, stacked: torch.Tensor, keys: list[str], name: str = "acts") -> None:
    """Refuse NaN or infinity, naming the first site holding one (skipped under a transform)."""
    if transformed():
        return
    if bool(torch.isfinite(stacked.sum(-2)).all()):  # NaN and infinity survive the sum: one read, no mask
        return
    finite = torch.isfinite(stacked).flatten(-2).all(-1).reshape(-1)
    if not bool(finite.all()):  # else a finite sum overflowed: values near the dtype's largest are still finite
        bad = int((~finite).nonzero()[0, 0])
        where = keys[bad] if len(keys) == finite.numel() else f"batch element {bad}"
        raise ValueError(f"{caller}: {name} {where!r} holds NaN or infinity; remove or impute those samples")


@dataclass(frozen=True)
class Labels:
    """Labels as training targets: ``classes`` (sorted) for a classifier, ``None`` for regression."""

    values: torch.Tensor  # (N,) or (N, K) as given
    classes: torch.Tensor | None
    index: torch.Tensor | None  # (N,) position of each label in classes

    @property
    def single_output(self) -> bool:
        """A regression on ``(N,)`` labels: weight ``(..., D)`` and bias ``(...)`` as scikit-learn's ``coef_``."""
        return self.classes is None and self.values.ndim == 1

    def targets(self, dtype: torch.dtype, *, signed: bool = True) -> torch.Tensor:
        """``(N, K)`` float targets: regression values, or +-1 one-vs-all (one column for two classes)."""
        if self.classes is None or self.index is None:
            values = self.values.to(dtype)
            return values[:, None] if values.ndim == 1 else values
        n_classes = self.classes.shape[-1]
        onehot = torch.nn.functional.one_hot(self.index, n_classes).to(dtype)
        onehot = onehot[:, 1:] if n_classes == 2 else onehot
        return 2 * onehot - 1 if signed else onehot


def as_labels(
    caller: str, labels: torch.Tensor, n: int, *, task: Task, classes: torch.Tensor | None, min_classes: int = 2
) -> Labels:
    """Check ``labels`` against ``n`` samples and read their classes (sorted unique, or ``classes`` given)."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{caller}: labels must be a tensor, got {type(labels).__name__}")
    if labels.ndim not in (1, 2) or labels.shape[0] != n:
        raise ValueError(
            f"{caller}: labels has shape {tuple(labels.shape)} but acts has N={n} samples; give labels (N,) "
            "(classes or one regression target) or (N, K) (regression targets)"
        )
    if task not in ("auto", "classification", "regression"):
        raise ValueError(f"{caller}: task must be 'auto', 'classification' or 'regression', got {task!r}")
    classify = task == "classification" or (task == "auto" and not labels.is_floating_point())
    if not classify:
        if not labels.is_floating_point():
            labels = labels.to(torch.get_default_dtype())
        if not transformed() and not bool(torch.isfinite(labels).all()):
            raise ValueError(f"{caller}: labels hold NaN or infinity; remove those samples")
        return Labels(labels, None, None)
    if labels.ndim != 1:
        raise ValueError(f"{caller}: labels for a classifier must be (N,), got {tuple(labels.shape)}")
    return _classes(caller, labels, classes, min_classes)


def _classes(caller: str, labels: torch.Tensor, classes: torch.Tensor | None, min_classes: int) -> Labels:
    if classes is None:
        if transformed():
            raise ValueError(f"{caller}: under vmap the classes cannot be read from the labels; give classes=")
        classes = torch.unique(labels)
    elif classes.ndim != 1 or (not transformed() and not bool((classes[1:] > classes[:-1]).all())):
        raise ValueError(f"{caller}: classes must be a 1-d tensor of sorted distinct values")
    if classes.shape[0] < min_classes:
        raise ValueError(
            f"{caller}: labels hold {classes.shape[0]} class(es) {classes.tolist()}; a classifier needs at least "
            f"{min_classes}"
        )
    equal = labels[:, None] == classes.to(labels.dtype)
    if not transformed() and not bool(equal.any(-1).all()):
        missing = labels[~equal.any(-1)][:3].tolist()
        raise ValueError(f"{caller}: labels {missing} are not in classes {classes.tolist()}")
    return Labels(labels, classes, equal.to(torch.int64).argmax(-1))


def check_alpha(caller: str, alpha: float | torch.Tensor, sites: bool) -> None:
    """Raise unless ``alpha`` is a penalty ``>= 0``, or a tensor of them over a tensor's leading dims (not ``sites``:
    sites are fitted in stacks of alike widths, so which penalty a site took would depend on the stacking)."""
    if not isinstance(alpha, torch.Tensor):
        if not alpha >= 0:
            raise ValueError(f"{caller}: alpha must be >= 0, got {alpha}")
    elif sites and alpha.dim():
        raise ValueError(
            f"{caller}: alpha is a tensor of shape {list(alpha.shape)}, which sweeps the leading dims of one tensor of "
            "activations; with a TensorDict of sites give one float (or a 0-d tensor), or fit each alpha in turn")
