"""Pruning masks that select exactly what ``torch.nn.utils.prune`` selects.

A mask is a boolean TensorDict over the pruned parameters: ``True`` keeps a weight.
``apply_masks(params, masks)`` multiplies; nothing touches a model.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

__all__ = ["apply_masks", "default_skip", "global_unstructured_masks", "ln_structured_mask", "pruning_scores"]

Importance = Callable[..., torch.Tensor | None]


def _count_to_prune(amount: float | int, size: int, what: str) -> int:
    """Entries to prune: an int is a count, a float a fraction rounded as torch rounds it."""
    if isinstance(amount, bool) or not isinstance(amount, numbers.Real):
        raise TypeError(f"{what}: amount must be an int or a float, got {amount!r}")
    if isinstance(amount, numbers.Integral):
        if not 0 <= amount <= size:
            raise ValueError(f"{what}: amount={amount} must be between 0 and the {size} prunable entries")
        return int(amount)
    if not 0.0 <= float(amount) <= 1.0:
        raise ValueError(f"{what}: a fractional amount must lie in [0, 1], got {amount}")
    return round(float(amount) * size)


def global_unstructured_masks(scores: TensorDictBase, amount: float | int) -> TensorDict:
    """Keep-masks pruning the ``amount`` entries of smallest ``|score|`` across all scores.

    Equal to ``prune.global_unstructured(..., pruning_method=prune.L1Unstructured,
    importance_scores=...)`` with the parameters in the TensorDict's key order: the scores
    are concatenated in that order and the same ``torch.topk`` picks the same entries,
    ties included.

    Args:
        scores (TensorDict): importance of each parameter to prune (any shapes).
        amount (float | int): fraction in ``[0, 1]`` (``round(amount * n)`` entries) or a
            count ``<= n``.

    Returns:
        TensorDict: boolean masks keyed like ``scores``.

    >>> import torch
    >>> s = TensorDict(a=torch.tensor([3.0, -1.0]), b=torch.tensor([[0.5, 2.0]]))
    >>> global_unstructured_masks(s, 2)["b"]
    tensor([[False,  True]])
    """
    keys = list(scores.keys(True, True))
    tensors = [cast(torch.Tensor, scores.get(k)) for k in keys]
    flat = torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else torch.zeros(0)
    k = _count_to_prune(amount, flat.numel(), "global_unstructured_masks")
    keep = torch.ones(flat.shape, dtype=torch.bool, device=flat.device)
    if k:
        keep[torch.topk(flat.abs(), k=k, largest=False).indices] = False
    masks = TensorDict({}, batch_size=[])
    start = 0
    for key, t in zip(keys, tensors, strict=True):
        masks.set(key, keep[start : start + t.numel()].reshape(t.shape))
        start += t.numel()
    return masks


def _structured(score: torch.Tensor, amount: float | int, dim: int, n: float) -> torch.Tensor:
    if score.dim() < 2:
        shape = tuple(score.shape)
        raise ValueError(f"ln_structured_mask: structured pruning needs at least 2 dims, got shape {shape}")
    if not -score.dim() <= dim < score.dim():
        raise ValueError(f"ln_structured_mask: dim {dim} is out of range for shape {tuple(score.shape)}")
    size = score.shape[dim]
    k = _count_to_prune(amount, size, "ln_structured_mask")
    if k == 0:
        return torch.ones(score.shape, dtype=torch.bool, device=score.device)
    others = [d for d in range(score.dim()) if d != dim % score.dim()]
    norms = torch.norm(score.detach(), p=n, dim=others)
    kept = torch.topk(norms, k=size - k, largest=True).indices
    keep = torch.zeros(score.shape, dtype=torch.bool, device=score.device)
    index: list[Any] = [slice(None)] * score.dim()
    index[dim] = kept
    keep[tuple(index)] = True
    return keep


def ln_structured_mask(
    scores: TensorDictBase | torch.Tensor, amount: float | int, dim: int, n: float = 1
) -> TensorDict | torch.Tensor:
    """Keep-masks pruning whole slices along ``dim`` with the smallest L``n`` norm.

    Equal to ``prune.ln_structured(module, name, amount, n=n, dim=dim,
    importance_scores=score)`` for each score, independently.

    Args:
        scores (TensorDict | Tensor): importance of each parameter (at least 2-d).
        amount (float | int): fraction of the slices along ``dim``, or their count.
        dim (int): the dim whose slices (e.g. output channels: 0) are pruned.
        n (float): the norm. Default: 1.

    Returns:
        TensorDict | Tensor: boolean masks shaped like the scores.
    """
    if isinstance(scores, torch.Tensor):
        return _structured(scores, amount, dim, n)
    return cast(TensorDict, scores.apply(lambda s: _structured(s, amount, dim, n)))


def apply_masks(params: TensorDictBase, masks: TensorDictBase) -> TensorDictBase:
    """``params`` with every masked entry zeroed; keys without a mask are unchanged.

    Raises:
        ValueError: a mask names a key ``params`` lacks, or its shape differs.
    """
    result = params.clone(False)
    for key, mask in masks.items(True, True):
        if key not in params.keys(True, True):
            raise ValueError(f"apply_masks: mask {key!r} has no parameter")
        value = cast(torch.Tensor, params.get(key))
        if mask.shape != value.shape:
            raise ValueError(f"apply_masks: mask {key!r} has shape {tuple(mask.shape)}, parameter {tuple(value.shape)}")
        result.set(key, value * mask.to(value.dtype))
    return result


def default_skip(name: str, module: nn.Module) -> bool:
    """tdhook's rule: skip the root and containers (their parameters belong to children)."""
    return name in ("", "td_module", "module") or isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict))


def pruning_scores(
    model: nn.Module,
    params: TensorDictBase,
    importance: Importance,
    *,
    skip: Callable[[str, nn.Module], bool] | None = None,
) -> TensorDict:
    """Importance scores of the parameters to prune, keyed like ``params``.

    As tdhook's ``Pruning``, ``importance(module_key=..., parameter_name=...,
    parameter=...)`` is called for every direct parameter of every submodule not skipped
    by ``skip(name, module)``; returning ``None`` leaves that parameter unpruned. The
    parameter passed is the one in ``params`` (the model is not read for values).

    >>> import torch, tdhook_fn
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> s = pruning_scores(net, tdhook_fn.params(net), lambda module_key, parameter_name, parameter:
    ...                    parameter.abs() if parameter_name == "weight" else None)
    >>> sorted(s.keys(True, True))
    [('0', 'weight'), ('1', 'weight')]
    """
    scores = TensorDict({}, batch_size=[])
    seen: set[int] = set()  # a tied parameter is scored once, under its first name, as in params()
    for name, module in model.named_modules():
        if skip is not None and skip(name, module):
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            key = (*name.split("."), param_name) if name else (param_name,)
            if key not in params.keys(True, True):
                raise KeyError(f"pruning_scores: params have no {'.'.join(key)!r}")
            score = importance(module_key=name, parameter_name=param_name, parameter=params.get(key))
            if score is not None:
                scores.set(key, score)
    return scores
