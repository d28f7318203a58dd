"""Parameters and buffers of a model as one nested TensorDict."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase, is_non_tensor
from torch import nn

__all__ = ["Key", "leaf_keys", "leaf_values", "leaves", "params"]

Key = tuple[str, ...]


def params(model: nn.Module, *, detach: bool = True) -> TensorDict:
    """The parameters and buffers of ``model``, nested like its module tree.

    Parameters are detached and share storage with the model (no copy; do not modify
    them in place). Buffers are cloned, because modules in training mode update some
    buffers in place (BatchNorm running statistics) and that must not reach the model.
    Tied parameters appear once, under their first name, as in ``named_parameters``.

    Args:
        model (nn.Module): any module.
        detach (bool): ``False`` gives the model's own tensors instead, live: gradients
            reach ``model.weight.grad`` and in-place buffer updates reach the model (what
            the compat layer needs to behave as a plain forward). Default: ``True``.

    Returns:
        TensorDict: batch size ``[]``; ``params(model)["0", "weight"]`` is the weight of
        submodule ``"0"``. ``torch.stack`` several of them to get a batch ``[K]`` to
        ``vmap`` over.

    Examples:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
        >>> sorted(params(net).keys(include_nested=True, leaves_only=True))[:2]
        [('0', 'bias'), ('0', 'weight')]
    """
    td = TensorDict({}, batch_size=[])
    for name, p in model.named_parameters():
        td.set(tuple(name.split(".")), p.detach() if detach else p)
    for name, b in model.named_buffers():
        td.set(tuple(name.split(".")), b.detach().clone() if detach else b)
    return td


def leaves(params: TensorDictBase) -> dict[Key, Any]:
    """The leaf tensors of a params TensorDict by key tuple."""
    # Depth first with a stack of iterators, not by recursion (a Python call per TensorDict), and each level's
    # entries read in the loop (a plain TensorDict's dict directly: ``items(True, True)`` costs twice as much;
    # any other TensorDict's leaves under their nested keys): this runs on every call.
    out: dict[Key, Any] = {}
    stack: list[tuple[Key, Iterator[tuple[Any, Any]]]] = []
    td: TensorDictBase | None = params
    prefix: Key = ()
    while td is not None:  # (a TensorDict whose entries are to read: the params, then each nested one met)
        own = td.__dict__.get("_tensordict") if type(td) is TensorDict else None
        stack.append((prefix, iter(own.items()) if isinstance(own, dict) else iter(td.items(True, True))))
        td = None
        while stack and td is None:
            prefix, items = stack[-1]
            for key, value in items:
                if type(value) is torch.Tensor and type(key) is str:  # (the common leaf: two identity tests)
                    out[(*prefix, key)] = value
                elif isinstance(key, tuple):  # (a leaf of a TensorDict that is not a plain one, under its nested key)
                    out[(*prefix, *key)] = value
                elif type(value) is TensorDict or (not isinstance(value, torch.Tensor) and isinstance(
                        value, TensorDictBase) and not is_non_tensor(value)):  # (a plain nested one: never non-tensor)
                    td, prefix = value, (*prefix, key)  # its entries next, then the rest of this level's
                    break
                else:
                    out[(*prefix, key)] = value
            else:
                stack.pop()
    return out


def leaf_keys(td: TensorDictBase) -> list[str | Key]:
    """``list(td.keys(True, True))`` (a one-part key as its str), from `leaves`: a seventh of the calls."""
    keys: list[str | Key] = []
    for key, value in leaves(td).items():  # (a loop, not a comprehension: one Python call less, on every call)
        if isinstance(value, torch.Tensor):
            keys.append(key[0] if len(key) == 1 else key)
    return keys


def leaf_values(td: TensorDictBase) -> list[Any]:
    """The leaf values of a TensorDict, in `leaves` order, without building their keys (cheaper, on every call)."""
    out: list[Any] = []
    stack: list[Iterator[Any]] = []
    level: TensorDictBase | None = td
    while level is not None:  # depth first, as `leaves`: a loop, not recursion, each level read in it
        own = level.__dict__.get("_tensordict") if type(level) is TensorDict else None
        stack.append(iter(own.values()) if isinstance(own, dict) else iter(level.values(True, True)))
        level = None
        while stack and level is None:
            for value in stack[-1]:
                if type(value) is torch.Tensor:  # (the common leaf: one identity test)
                    out.append(value)
                elif type(value) is TensorDict or (not isinstance(value, torch.Tensor) and isinstance(
                        value, TensorDictBase) and not is_non_tensor(value)):
                    level = value  # (its values next, then the rest of this one's)
                    break
                else:
                    out.append(value)
            else:
                stack.pop()
    return out
