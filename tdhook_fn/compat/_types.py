"""``tdhook._types``: the key type tdhook's signatures name.

Examples:
    >>> isinstance(("attr", "input"), UnraveledKey), isinstance(("attr", 0), UnraveledKey)
    (True, False)
    >>> isinstance((), UnraveledKey)
    False
"""

from __future__ import annotations

from typing import Any

__all__ = ["UnraveledKey", "UnraveledMeta"]


class UnraveledMeta(type):
    """Makes ``isinstance(x, UnraveledKey)`` true for a str or a non-empty tuple of str."""

    def __instancecheck__(cls, instance: Any) -> bool:
        if isinstance(instance, str):
            return True
        return isinstance(instance, tuple) and bool(instance) and all(isinstance(part, str) for part in instance)


class UnraveledKey(metaclass=UnraveledMeta):
    """A TensorDict key: a str or a non-empty tuple of str (only for ``isinstance``)."""
