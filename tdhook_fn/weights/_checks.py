"""Checks shared by the weight methods: arguments that must be TensorDicts, parameter sets
that must line up key by key, and key names as messages print them."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

__all__ = ["check_same_structure", "check_tensordict", "key_name"]


def key_name(key: str | tuple[str, ...]) -> str:
    """``("0", "weight")`` -> ``"0.weight"``: a TensorDict key as the module tree names it."""
    return key if isinstance(key, str) else ".".join(key)


def check_tensordict(what: str, name: str, value: Any, hint: str = "e.g. tdhook_fn.params(model)") -> None:
    """TypeError naming ``what``'s argument ``name`` unless ``value`` is a TensorDict."""
    if isinstance(value, TensorDictBase):
        return
    if isinstance(value, nn.Module):
        got = f"the module {type(value).__name__}: pass tdhook_fn.params(module) instead"
    elif isinstance(value, dict):
        got = "a dict: wrap it as TensorDict(d, batch_size=[])"
    elif isinstance(value, torch.Tensor):
        got = f"a Tensor of shape {tuple(value.shape)}"
    else:
        got = f"{type(value).__name__} {value!r}"
    raise TypeError(f"{what}: {name} must be a TensorDict ({hint}), got {got}")


def check_same_structure(what: str, a: TensorDictBase, b: TensorDictBase) -> None:
    """ValueError naming the keys or shapes where ``a`` and ``b`` differ."""
    keys_a, keys_b = set(a.keys(True, True)), set(b.keys(True, True))
    if keys_a != keys_b:
        only_a = sorted(map(str, keys_a - keys_b))
        only_b = sorted(map(str, keys_b - keys_a))
        raise ValueError(
            f"{what}: parameter sets differ in keys: only in the first {only_a}, only in the second {only_b}"
        )
    shapes = [
        f"{key}: {tuple(a.get(key).shape)} vs {tuple(b.get(key).shape)}"
        for key in sorted(keys_a, key=str)
        if a.get(key).shape != b.get(key).shape
    ]
    if shapes:
        raise ValueError(f"{what}: parameter shapes differ: {shapes}")
