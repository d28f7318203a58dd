"""What a pullback is fed at the target values: ones, one one-hot per target, or the caller's cotangents."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from .._functional import fresh_tensordict
from .._params import leaves

__all__ = ["Cotangents", "check_per_target_or_cotangents", "pull_each", "seed_cotangents"]

Cotangents = Callable[[TensorDictBase], TensorDictBase]


def check_per_target_or_cotangents(caller: str, per_target: bool, cotangents: Cotangents | None) -> None:
    """``per_target`` and ``cotangents`` both say what is put in at the targets: one of them."""
    if per_target and cotangents is not None:
        raise ValueError(f"{caller}: per_target and cotangents exclude each other (cotangents say what is put in at "
                         "the targets, per_target puts in one one-hot per target); give one of them")


def seed_cotangents(values: TensorDictBase, per_target: bool, cotangents: Cotangents | None,
                    ) -> tuple[TensorDictBase, int]:
    """What is put in at the target values, and its number of leading (target) dims.

    ``cotangents(values)``; or one-hots ``[T, *B, T]`` with ``per_target``; or ones.
    """
    if cotangents is not None:
        cot = cotangents(values)
        if not isinstance(cot, TensorDictBase):
            raise TypeError(f"cotangents must return a TensorDict, got {type(cot).__name__}")
        return cot, 0
    if per_target:
        return _one_hots(values), 1
    return _ones_like(values), 0


def _ones_like(values: TensorDictBase) -> TensorDictBase:
    """``values.apply(torch.ones_like)``, built directly for a plain TensorDict (``apply`` costs more)."""
    if type(values) is not TensorDict:
        return cast(TensorDictBase, values.apply(torch.ones_like))
    ones: dict[Any, Any] = {}
    for name, value in values.__dict__["_tensordict"].items():  # its own entries, read as `leaves` reads them
        if type(value) is not torch.Tensor:  # a nested TensorDict (or a tensor subclass): by key, levels made by set
            out = values.empty(recurse=True)
            for key, leaf in leaves(values).items():
                out.set(key, torch.ones_like(leaf))
            return out
        ones[name] = torch.ones_like(value)
    return fresh_tensordict(ones, values.batch_size, values.device)  # (shaped as the values)


def _one_hots(values: TensorDictBase) -> TensorDictBase:
    """Cotangents ``[T, *B, T]``: target ``t`` selected by a one-hot on the last dim."""
    batch = values.batch_size
    for key, v in values.items(True, True):
        if v.dim() > len(batch) + 1:
            raise ValueError(f"per_target needs target values shaped [*batch] or [*batch, T]; target {key!r} has shape "
                             f"{tuple(v.shape)} for batch {list(batch)}: flatten its target dims in the target")
    sizes = {v.shape[len(batch)] if v.dim() > len(batch) else 1 for v in values.values(True, True)}
    if len(sizes) != 1:
        raise ValueError(f"per_target needs the same number of targets in every target key, got {sizes}")
    (n,) = sizes

    def one_hot(v: torch.Tensor) -> torch.Tensor:
        eye = torch.eye(n, dtype=v.dtype, device=v.device)
        if v.dim() == len(batch):  # one target per sample: T = 1
            return torch.ones_like(v).unsqueeze(0)
        return eye.reshape(n, *([1] * len(batch)), n).expand(n, *v.shape)

    return cast(TensorDictBase, values.apply(one_hot, batch_size=[n, *batch]))


def pull_each(pullback: Callable[..., Any], cot: TensorDictBase) -> Any:
    """The pullback of every cotangent along ``cot``'s first dim, stacked (NOTE [attribution engine])."""
    leaf = next(iter(cot.values(True, True)))
    if isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu":
        return torch.func.vmap(pullback)(cot)[0]
    last = cot.batch_size[0] - 1
    pulled = [pullback(cot[t], retain_graph=t < last)[0] for t in range(last + 1)]  # (the last frees the graph)
    return [torch.stack([p[i] for p in pulled]) for i in range(len(pulled[0]))]  # (the primals are a flat list)
