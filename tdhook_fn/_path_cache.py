"""The parse cache of submodule paths (least recently used, bounded in entries and bytes), and
the fresh copies of cached literals that calls receive."""

from __future__ import annotations

import copy
import sys
import threading
from collections import OrderedDict
from typing import Any, Generic, TypeVar

__all__ = ["ParseCache", "footprint", "fresh"]

V = TypeVar("V")


class ParseCache(Generic[V]):
    """``path -> parse`` for at most ``max_entries`` paths and ``max_bytes`` bytes.

    The bytes are those an entry keeps alive, as `footprint` estimates them; an
    entry larger than ``max_bytes`` is not kept. The least recently used entries leave
    first. Thread-safe; callers parse outside the lock.

    Examples:
        >>> cache = ParseCache[tuple[str, ...]](max_entries=2, max_bytes=10_000)
        >>> for path in ("a", "b", "c"):
        ...     cache.put(path, (path,))
        >>> cache.get("a"), cache.get("c"), len(cache)
        (None, ('c',), 2)
    """

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()

    def get(self, path: str) -> V | None:
        with self._lock:
            entry = self._entries.get(path)
            if entry is None:
                return None
            self._entries.move_to_end(path)
            return entry[0]

    def put(self, path: str, value: V) -> None:
        nbytes = footprint(path, value)
        if nbytes > self.max_bytes:
            return
        with self._lock:
            if path in self._entries:
                return
            self._entries[path] = (value, nbytes)
            self._nbytes += nbytes
            while len(self._entries) > self.max_entries or self._nbytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._nbytes -= dropped

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._nbytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes the cached entries keep alive (`footprint` summed)."""
        return self._nbytes

    def __len__(self) -> int:
        return len(self._entries)


def footprint(*objects: Any) -> int:
    """Bytes ``objects`` keep alive, over-estimated (shared objects count each time).

    Follows containers, slices and ``__slots__`` objects (the path steps), as literals
    read by ``ast.literal_eval`` are built from them.
    """
    size = 0
    stack = list(objects)
    while stack:
        obj = stack.pop()
        size += sys.getsizeof(obj)
        if isinstance(obj, tuple | list | set | frozenset):
            stack += obj
        elif isinstance(obj, dict):
            stack += [*obj.keys(), *obj.values()]
        elif isinstance(obj, slice):
            stack += (obj.start, obj.stop, obj.step)
        elif isinstance(slots := getattr(type(obj), "__slots__", None), tuple):
            stack += [getattr(obj, name, None) for name in slots]
    return size


_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), type(Ellipsis))


def fresh(value: Any) -> Any:
    """``value`` or, if it holds anything mutable, a deep copy: code that mutates its
    arguments or keys must not change the cached parse."""
    if isinstance(value, _IMMUTABLE):
        return value
    if isinstance(value, tuple) and all(isinstance(v, _IMMUTABLE) for v in value):
        return value
    if isinstance(value, slice) and all(isinstance(v, _IMMUTABLE) for v in (value.start, value.stop, value.step)):
        return value
    if isinstance(value, dict) and all(isinstance(v, _IMMUTABLE) for v in value.values()):
        return value  # a new dict each call (from step.kwargs); its keys are str
    return copy.deepcopy(value)
