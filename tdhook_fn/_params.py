"""Parameters and buffers of a model as one nested TensorDict."""

from __future__ import annotations

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
    out: dict[Key, Any] = {}
    _collect(params, (), out)
    return out


def _collect(td: TensorDictBase, prefix: Key, out: dict[Key, Any]) -> None:
    # a plain TensorDict's own dict is read directly: items(True, True) costs twice as much
    # on every call, and this runs on every call
    own = td.__dict__.get("_tensordict") if type(td) is TensorDict else None
    if not isinstance(own, dict):
        for key, value in td.items(include_nested=True, leaves_only=True):
            out[(*prefix, *key) if isinstance(key, tuple) else (*prefix, key)] = value
        return
    for key, value in own.items():
        # (the plain TensorDict and the tensor tested inline: this runs per entry)
        if type(value) is TensorDict or (not isinstance(value, torch.Tensor) and _is_branch(value)):
            _collect(value, (*prefix, key), out)
        else:
            out[(*prefix, key)] = value


def _is_branch(value: Any) -> bool:
    """Whether ``value``, neither a tensor nor a plain TensorDict, is a nested TensorDict (a non-tensor entry is a
    leaf)."""
    return isinstance(value, TensorDictBase) and not is_non_tensor(value)


def leaf_keys(td: TensorDictBase) -> list[str | Key]:
    """``list(td.keys(True, True))`` (a one-part key as its str), from `leaves`: a seventh of the calls."""
    return [key[0] if len(key) == 1 else key for key, value in leaves(td).items() if isinstance(value, torch.Tensor)]


def leaf_values(td: TensorDictBase) -> list[Any]:
    """The leaf values of a TensorDict, in `leaves` order, without building their keys (cheaper, on every call)."""
    own = td.__dict__.get("_tensordict") if type(td) is TensorDict else None
    if not isinstance(own, dict):
        return list(td.values(include_nested=True, leaves_only=True))
    out: list[Any] = []
    for value in own.values():
        if type(value) is TensorDict or (not isinstance(value, torch.Tensor) and _is_branch(value)):
            out.extend(leaf_values(value))
        else:
            out.append(value)
    return out
