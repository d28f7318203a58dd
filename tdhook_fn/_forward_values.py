"""What a forward takes from a TensorDict (`get_input`) and what it gives back as entries (`output_leaves`: a
mapping by key, anything else by optree's leaves)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Any

import optree
from tensordict import TensorDictBase, is_non_tensor

from ._types import NestedKey

__all__ = ["OutputCountError", "get_input", "output_leaves"]

_NAMESPACE = "tdhook_fn"
_registered: set[type] = set()
_registering = threading.Lock()
_MISSING: Any = object()


def get_input(td: TensorDictBase, key: NestedKey) -> Any:
    """``td[key]`` as the forward takes it: a non-tensor entry as its one plain value; KeyError naming the keys."""
    value = td.get(key, _MISSING)
    if value is _MISSING:
        raise KeyError(f"functional: in_key {key!r} is not in the TensorDict (keys: {list(td.keys())})")
    if is_non_tensor(value):  # a string or number kwarg ("mode"): the forward gets the value, not its wrapper
        return _one_value(key, value)
    return value


def _one_value(key: NestedKey, value: Any) -> Any:
    """The plain value of a non-tensor entry; one value however often it was stacked (a batch, path points)."""
    values = value.tolist() if hasattr(value, "tolist") else [value.data]
    while isinstance(values, list) and values:
        first = values[0]
        if any(v != first for v in values[1:]):
            raise TypeError(f"functional: in_key {key!r} holds different non-tensor values across the batch "
                            f"({values[:3]}...); the forward takes one: call it on each group of samples alike")
        values = first
    return values


def _register_dataclass(cls: type) -> None:
    names = [f.name for f in dataclasses.fields(cls)]
    optree.register_pytree_node(
        cls,
        lambda obj: ([getattr(obj, n) for n in names], None, names),
        lambda _, children: cls(**dict(zip(names, children, strict=False))),
        namespace=_NAMESPACE,
    )
    _registered.add(cls)


def _is_new_dataclass(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type) and type(obj) not in _registered


def output_leaves(output: Any, out_keys: tuple[NestedKey, ...]) -> list[Any]:
    """The values for ``out_keys``: by key from a mapping, else the leaves in optree order."""
    # NOTE [outputs by key]
    # A forward returning a dict (or a ``Mapping`` such as transformers' ``ModelOutput``)
    # is read by key: ``out_keys=["logits"]`` takes ``output["logits"]``, a tuple key walks
    # nested mappings, and a key the output lacks is an error naming the keys it has.
    # optree would flatten a dict in *sorted* key order, so zipping its leaves with
    # ``out_keys`` would store values under the wrong names. Tuples, lists and
    # dataclasses have an order of their own and are flattened as before.
    if isinstance(output, Mapping):
        return [_by_key(output, key) for key in out_keys]
    # NOTE [dataclass outputs]: optree treats plain dataclasses as leaves; register each
    # dataclass type met in an output (in our own namespace) and flatten again.
    while True:
        leaves = optree.tree_leaves(output, is_leaf=_is_new_dataclass, namespace=_NAMESPACE)
        new = {type(leaf) for leaf in leaves if _is_new_dataclass(leaf)}
        if not new:
            break
        with _registering:
            for cls in new - _registered:
                _register_dataclass(cls)
    if len(leaves) != len(out_keys):
        raise OutputCountError(
            f"functional: the model returned {len(leaves)} leaves but out_keys names "
            f"{len(out_keys)}: {list(out_keys)}"
        )
    return leaves


class OutputCountError(ValueError, RuntimeError):
    """A model returned another number of tensors than ``out_keys`` names: a ValueError, as the core's other bad
    arguments, and a RuntimeError, as tensordict's `TensorDictModule` raises for it (and so tdhook)."""


def _by_key(output: Mapping[Any, Any], key: NestedKey) -> Any:
    value: Any = output
    for part in (key,) if isinstance(key, str) else key:
        if not isinstance(value, Mapping) or part not in value:
            have = list(value.keys()) if isinstance(value, Mapping) else type(value).__name__
            raise KeyError(
                f"functional: out_key {key!r}: the model's output has no {part!r} (it has {have}); out_keys "
                "name the entries of a dict output by key"
            )
        value = value[part]
    return value
