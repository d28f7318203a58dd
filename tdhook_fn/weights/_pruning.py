"""Pruning masks that select exactly what ``torch.nn.utils.prune`` selects.

A mask is a boolean TensorDict over the pruned parameters: ``True`` keeps a weight.
``apply_masks(params, masks)`` multiplies; nothing touches a model.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from ._checks import check_tensordict, key_name

__all__ = ["apply_masks", "default_skip", "global_unstructured_masks", "ln_structured_mask", "pruning_scores"]

Importance = Callable[..., torch.Tensor | None]
Norm = float | str
_MASK_HINT = "of bool keep-masks, e.g. from global_unstructured_masks or ln_structured_mask"


def _refuse_stacked(caller: str, what: str, td: TensorDictBase) -> None:
    """Masks belong to one parameter set: a stacked one ``[K]`` would be pruned as one pool."""
    if td.batch_size:
        raise ValueError(
            f"{caller}: {what} have batch size {list(td.batch_size)} (a stack of parameter sets); a mask belongs to "
            f"one set, and a stack would be pruned as one pool (whole members pruned). Prune each member: "
            f"[... for k in range({td.batch_size[0]})] with {what}[k]")


def _count_to_prune(amount: float | int, size: int, what: str) -> int:
    """Entries to prune: an int is a count, a float a fraction rounded as torch rounds it."""
    if isinstance(amount, bool) or not isinstance(amount, numbers.Real):
        raise TypeError(f"{what}: amount must be an int or a float, got {amount!r}")
    if isinstance(amount, numbers.Integral):
        if not 0 <= amount <= size:
            raise ValueError(f"{what}: amount={amount} must be between 0 and the {size} prunable entries")
        return int(amount)
    if not 0.0 <= float(amount) <= 1.0:
        raise ValueError(f"{what}: a fractional amount must lie in [0, 1], got {amount}; pass an int for a count")
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

    Raises:
        TypeError: ``scores`` is not a TensorDict, or ``amount`` is not a number.
        ValueError: ``amount`` is out of range.

    Examples:
        >>> import torch
        >>> s = TensorDict(a=torch.tensor([3.0, -1.0]), b=torch.tensor([[0.5, 2.0]]))
        >>> global_unstructured_masks(s, 2)["b"]
        tensor([[False,  True]])
    """
    check_tensordict("global_unstructured_masks", "scores", scores, "e.g. from pruning_scores")
    _refuse_stacked("global_unstructured_masks", "scores", scores)
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


# NOTE [norms of ln_structured_mask]
# torch.nn.utils.prune.ln_structured passes ``n`` straight to ``torch.norm(t, p=n, dim=...)``
# and documents ``n`` as int, float, inf, -inf, 'fro' or 'nuc': any real number (0 counts
# nonzeros, negative ones are harmonic-like), 'fro' and 'nuc' (a matrix norm: only when the
# slices are matrices, i.e. 3-d scores). We accept exactly those, with the same numbers.
# torch.norm computes 'fro' over at most two dims as ``vector_norm(t, 2)``, the kernel of
# n=2, and refuses it over more (4-d conv weights, from deep inside ``linalg``); the
# Frobenius norm of a slice is the 2-norm of its entries, so here 'fro' is n=2 everywhere:
# bitwise torch's mask where torch gives one. Anything else torch either rejects from inside
# ``linalg`` (other strings, 'nuc' on 2-d or 4-d scores) or takes silently (None as 'fro',
# True as 1, nan as a norm whose every value is nan): here it is refused up front.
_NORM_HINT = "pass a number (e.g. 1, 2, 0.5; 0 counts nonzeros), float('inf') or -inf, 'fro' (the same as 2) or 'nuc'"


def _check_norm(n: object) -> None:
    if isinstance(n, str):
        if n not in ("fro", "nuc"):
            raise ValueError(f"ln_structured_mask: n={n!r} is not a norm torch.nn.utils.prune accepts: {_NORM_HINT}")
        return
    if isinstance(n, bool) or not isinstance(n, numbers.Real):
        raise TypeError(f"ln_structured_mask: n={n!r} is not a norm: {_NORM_HINT}; use n=2 for the Frobenius norm")
    if math.isnan(n):
        raise ValueError(f"ln_structured_mask: n=nan is not a norm: {_NORM_HINT}")


def _structured(score: torch.Tensor, amount: float | int, dim: int, n: Norm, what: str) -> torch.Tensor:
    shape = tuple(score.shape)
    if score.dim() < 2:
        raise ValueError(f"{what}: structured pruning needs at least 2 dims, got shape {shape}")
    if not -score.dim() <= dim < score.dim():
        raise ValueError(f"{what}: dim {dim} is out of range for shape {shape}")
    if n == "nuc" and score.dim() != 3:
        raise ValueError(
            f"{what}: n='nuc' is a matrix norm: it needs 3-d scores (a matrix per slice), got shape {shape}; "
            "use a number, e.g. n=2"
        )
    size = score.shape[dim]
    k = _count_to_prune(amount, size, what)
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
    scores: TensorDictBase | torch.Tensor, amount: float | int, dim: int, *, n: Norm = 1
) -> TensorDict | torch.Tensor:
    """Keep-masks pruning whole slices along ``dim`` with the smallest L``n`` norm.

    Equal to ``prune.ln_structured(module, name, amount, n=n, dim=dim,
    importance_scores=score)`` for each score, independently.

    Args:
        scores (TensorDict | Tensor): importance of each parameter (at least 2-d).
        amount (float | int): fraction of the slices along ``dim``, or their count.
        dim (int): the dim whose slices (e.g. output channels: 0) are pruned.
        n (float | str): the norm, keyword-only (torch's ``ln_structured`` takes
            ``amount, n, dim`` in that order): any real number, ``inf``, ``-inf``,
            ``"fro"`` (the same as 2) or ``"nuc"`` (3-d scores only), as
            ``torch.nn.utils.prune``. Default: 1.

    Returns:
        TensorDict | Tensor: boolean masks shaped like the scores.

    Raises:
        TypeError: ``scores`` is neither a Tensor nor a TensorDict, ``dim`` is not an int,
            ``n`` is not a number or norm name, or ``amount`` is not a number.
        ValueError: a score has fewer than 2 dims, ``dim`` or ``amount`` is out of range,
            ``n`` is nan or an unknown norm name (the score's key is named).
    """
    if not isinstance(scores, torch.Tensor):
        check_tensordict("ln_structured_mask", "scores", scores, "or a Tensor, e.g. from pruning_scores")
        _refuse_stacked("ln_structured_mask", "scores", scores)
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"ln_structured_mask: dim must be an int (the dim whose slices are pruned), got {dim!r}")
    _check_norm(n)
    n = 2 if n == "fro" else n  # NOTE [norms of ln_structured_mask]
    if isinstance(scores, torch.Tensor):
        return _structured(scores, amount, int(dim), n, "ln_structured_mask")

    def one(key: str | tuple[str, ...], score: torch.Tensor) -> torch.Tensor:
        return _structured(score, amount, int(dim), n, f"ln_structured_mask: scores {key_name(key)!r}")

    return cast(TensorDict, scores.named_apply(one, nested_keys=True))


def _check_not_swapped(params: TensorDictBase, masks: TensorDictBase) -> None:
    param_dtypes = {cast(torch.Tensor, t).dtype for t in params.values(True, True)}
    mask_dtypes = {cast(torch.Tensor, t).dtype for t in masks.values(True, True)}
    if param_dtypes == {torch.bool} and mask_dtypes - {torch.bool}:
        raise TypeError(
            f"apply_masks: the arguments look swapped: params holds only bool tensors and masks holds "
            f"{', '.join(sorted(map(str, mask_dtypes - {torch.bool})))} ones; call apply_masks(params, masks)"
        )


def apply_masks(params: TensorDictBase, masks: TensorDictBase) -> TensorDictBase:
    """``params`` with every masked entry zeroed; keys without a mask are unchanged.

    Args:
        params (TensorDict): parameters, e.g. `tdhook_fn.params` (not written).
        masks (TensorDict): bool keep-masks (``True`` keeps a weight) keyed like ``params``,
            e.g. from `global_unstructured_masks` or `ln_structured_mask`.

    Returns:
        TensorDict: a new params TensorDict.

    Raises:
        TypeError: an argument is not a TensorDict, a mask is not bool (its key is named),
            or the arguments look swapped (``params`` all bool, ``masks`` not).
        ValueError: a mask names a key ``params`` lacks, or its shape differs (both named).
    """
    check_tensordict("apply_masks", "params", params)
    check_tensordict("apply_masks", "masks", masks, _MASK_HINT)
    _check_not_swapped(params, masks)
    keys = set(params.keys(True, True))
    for key, mask in masks.items(True, True):
        name = key_name(key)
        if key not in keys:
            raise ValueError(
                f"apply_masks: masks has {name!r}, which params lacks: masks must be keyed like params "
                "(e.g. from pruning_scores(model, params, ...) and a mask function)"
            )
        if mask.dtype != torch.bool:
            raise TypeError(
                f"apply_masks: mask {name!r} has dtype {mask.dtype}; masks must be bool (True keeps a weight): "
                "use mask.bool() (or mask != 0), or build masks with global_unstructured_masks / ln_structured_mask"
            )
        shape = tuple(cast(torch.Tensor, params.get(key)).shape)
        if tuple(mask.shape) != shape:
            raise ValueError(
                f"apply_masks: mask {name!r} has shape {tuple(mask.shape)}, its parameter {shape}: "
                "build masks from scores of these params"
            )
    result = params.clone(False)  # a new tree holding the same tensors: the caller's is never written
    for key, mask in masks.items(True, True):
        value = cast(torch.Tensor, params.get(key))
        result.set(key, value * mask.to(value.dtype))
    return result


def default_skip(name: str, module: nn.Module) -> bool:
    """tdhook's rule: skip the root and containers (their parameters belong to children).

    Args:
        name (str): the submodule's name (``""`` for the root).
        module (nn.Module): the submodule.
    """
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

    Args:
        model (nn.Module): the model whose submodules are visited.
        params (TensorDict): its parameters (as `tdhook_fn.params` returns them); the scores
            are computed from these.
        importance (Callable): ``importance(module_key=..., parameter_name=..., parameter=...)``
            returns a score tensor shaped like the parameter, or ``None`` to leave it unpruned.
        skip (Callable | None): ``skip(name, module)`` is true for submodules to leave out.
            Default: ``None``, none is skipped (`default_skip` is tdhook's rule).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``params`` not a TensorDict,
            ``importance`` or ``skip`` not callable, or a score is not a tensor.
        ValueError: a score's shape differs from its parameter's (the key is named).
        KeyError: ``params`` lacks a parameter of ``model`` (named).

    Examples:
        >>> import torch, tdhook_fn
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> s = pruning_scores(net, tdhook_fn.params(net), lambda module_key, parameter_name, parameter:
        ...                    parameter.abs() if parameter_name == "weight" else None)
        >>> sorted(s.keys(True, True))
        [('0', 'weight'), ('1', 'weight')]
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"pruning_scores: model must be an nn.Module, got {type(model).__name__}: "
            "call pruning_scores(model, params, importance)"
        )
    check_tensordict("pruning_scores", "params", params)
    if not callable(importance):
        raise TypeError(
            f"pruning_scores: importance must be callable as importance(module_key=..., parameter_name=..., "
            f"parameter=...), got {importance!r}"
        )
    if skip is not None and not callable(skip):
        raise TypeError(f"pruning_scores: skip must be None or callable as skip(name, module), got {skip!r}")
    _refuse_stacked("pruning_scores", "params", params)
    scores = TensorDict({}, batch_size=[])
    seen: set[int] = set()  # a tied parameter is scored once, under its first name, as in params()
    first = {id(p): tuple(n.split(".")) for n, p in model.named_parameters()}  # (also where that module is skipped)
    for name, module in model.named_modules():
        if skip is not None and skip(name, module):
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            key = first[id(param)]
            if key not in params.keys(True, True):
                raise KeyError(
                    f"pruning_scores: params have no {key_name(key)!r}, a parameter of model: "
                    "pass this model's params, e.g. tdhook_fn.params(model)"
                )
            parameter = cast(torch.Tensor, params.get(key))
            score = importance(module_key=name, parameter_name=param_name, parameter=parameter)
            if score is not None:
                scores.set(key, _checked_score(key, score, parameter))
    return scores


def _checked_score(key: tuple[str, ...], score: object, parameter: torch.Tensor) -> torch.Tensor:
    """``score`` if it is a tensor shaped like ``parameter`` (as ``torch.nn.utils.prune`` requires)."""
    name = key_name(key)
    if not isinstance(score, torch.Tensor):
        raise TypeError(
            f"pruning_scores: importance returned {type(score).__name__} for {name!r}: return a tensor shaped "
            "like the parameter, or None to leave it unpruned"
        )
    if score.shape != parameter.shape:
        raise ValueError(
            f"pruning_scores: importance returned shape {tuple(score.shape)} for {name!r}, whose parameter has "
            f"shape {tuple(parameter.shape)}: return one score per entry (torch.nn.utils.prune requires it)"
        )
    return score
