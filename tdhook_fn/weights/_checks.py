"""Checks shared by the weight methods: parameter sets that must line up key by key."""

from __future__ import annotations

from tensordict import TensorDictBase

__all__ = ["check_same_structure"]


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
