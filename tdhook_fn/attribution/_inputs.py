"""Plain tensors as a method's inputs, and tensors as its targets: the captum-style calls."""

# NOTE [captum-style calls]
# What a captum user passes is normalised here, once, for every method (`accepts_tensors`
# wraps each of them): a plain tensor ``x`` as ``inputs`` of an ``f`` with one in_key is
# ``TensorDict({key: x}, batch_size=[len(x)])`` (dim 0 is the batch, as in captum, also
# under ``vmap``: per sample, pass a TensorDict with ``batch_size=[]``) and the one
# resulting map comes back as a tensor; a tensor ``target`` of class indices is checked
# against the inputs' batch before anything runs (then read by `tdhook_fn.as_target`);
# a callable target may return a tensor (`_as_target_values`). ``f`` stays a pure
# function: ``f, params = tdhook_fn.pure(model)`` is the one-line path from a module.
#
# A method may also name a *tensor path* (`accepts_tensors_via`): given the tensor itself
# (its key and the target checked as above), it gives the one map as a tensor, or ``None``
# where it does not apply; then the call takes the TensorDict's way. A chain walk reads
# the tensor anyway, so it skips wrapping the input and unwrapping the result, which
# cost a few microseconds each on a call of a few hundred. A plain TensorDict of one batch
# dim holding only ``f``'s one input may take that path too (`one_tensor`), its map put
# back under its key.

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import torch
from tensordict import TensorDict, TensorDictBase

from .._functional import fresh_tensordict
from .._params import leaves
from .._targets import check_target
from .._types import PureFn

__all__ = ["UNSET", "accepts_tensors", "accepts_tensors_via", "one_tensor", "tensor_inputs"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
# (f, params, key, x, *the method's other arguments) -> the one map as a tensor, or None: the TensorDict's way
TensorPath = Callable[..., Any]
UNSET: Any = object()  # (a tensor path's required argument not given: the method's signature says so)


def accepts_tensors_via(tensor_path: TensorPath) -> Callable[
        [Callable[Concatenate[PureFn, TensorDictBase, TensorDictBase, _P], _R]],
        Callable[Concatenate[PureFn, TensorDictBase, TensorDictBase | torch.Tensor, _P], _R]]:
    """`accepts_tensors`, a tensor ``inputs`` tried on ``tensor_path`` first (NOTE [captum-style calls])."""
    return lambda method: _accepting(method, tensor_path)


def accepts_tensors(
    method: Callable[Concatenate[PureFn, TensorDictBase, TensorDictBase, _P], _R],
) -> Callable[Concatenate[PureFn, TensorDictBase, TensorDictBase | torch.Tensor, _P], _R]:
    """``method`` also taking a plain tensor as ``inputs``; see NOTE [captum-style calls].

    The wrapped method checks a tensor ``target`` against the inputs' batch before it runs.
    With a tensor ``x`` (batch first) and an ``f`` reading one key, it runs on
    ``TensorDict({key: x}, batch_size=[len(x)])`` and returns the one map as a tensor
    (a tuple ``(map, delta)`` stays a tuple). A call giving several maps (inputs and
    layers) raises ``ValueError``: pass a TensorDict to get them all.

    The static return type stays the method's (a TensorDict): typing a tensor result needs
    overloads over a ``ParamSpec``, which mypy resolves to ``Any`` at every call with
    ``**kwargs``.
    """
    return _accepting(method, None)


def _accepting(method: Callable[Concatenate[PureFn, TensorDictBase, TensorDictBase, _P], _R],
               tensor_path: TensorPath | None,
               ) -> Callable[Concatenate[PureFn, TensorDictBase, TensorDictBase | torch.Tensor, _P], _R]:
    name = method.__name__

    @functools.wraps(method)
    def wrapper(f: PureFn, params: TensorDictBase, inputs: TensorDictBase | torch.Tensor, /,
                *args: _P.args, **kwargs: _P.kwargs) -> Any:
        # (an int target, the common one, is valid for any batch: `check_target` is left out for it)
        checked = "target" in kwargs and type(kwargs["target"]) is not int
        if not isinstance(inputs, torch.Tensor):
            if checked and isinstance(inputs, TensorDictBase):  # (anything else: checked there)
                check_target(kwargs["target"], inputs.batch_size, name)
            return method(f, params, inputs, *args, **kwargs)
        key = tensor_key(name, f, inputs)
        if checked:
            check_target(kwargs["target"], inputs.shape[:1], name)
        if tensor_path is not None:
            walked = tensor_path(f, params, key, inputs, *args, **kwargs)
            if walked is not None:
                return walked
        result = method(f, params, fresh_tensordict({key: inputs}, inputs.shape[:1]), *args, **kwargs)
        if isinstance(result, tuple):
            return (_only_map(name, result[0]), *result[1:])
        return _only_map(name, result)

    return wrapper


def one_tensor(f: Any, inputs: Any) -> tuple[str, torch.Tensor] | None:
    """The key and tensor of ``inputs`` where it is a plain TensorDict of one batch dim holding only a plain
    tensor under ``f``'s one in_key (a str); else ``None``."""
    if type(inputs) is not TensorDict or len(inputs.batch_size) != 1:
        return None
    entries, keys = inputs.__dict__.get("_tensordict"), getattr(f, "in_keys", None)
    if not isinstance(entries, dict) or len(entries) != 1 or not isinstance(keys, (list, tuple)) or len(keys) != 1:
        return None
    ((key, x),) = entries.items()
    return (key, x) if type(key) is str and key == keys[0] and type(x) is torch.Tensor else None


def tensor_key(caller: str, f: Any, x: torch.Tensor) -> Any:
    """The key a tensor ``x`` as ``f``'s inputs goes under (raising where ``f`` reads several, or ``x`` is 0-d)."""
    keys = tuple(getattr(f, "in_keys", None) or ("input",))
    if len(keys) != 1:
        raise TypeError(f"{caller}: inputs is a tensor, but f reads {len(keys)} inputs {list(keys)}; pass a "
                        f"TensorDict holding each of them")
    if x.dim() == 0:
        raise ValueError(f"{caller}: a tensor as inputs is a batch, its first dim the samples (as in captum), "
                         "got a 0-d tensor; for one sample pass x.unsqueeze(0)")
    return keys[0]


def tensor_inputs(caller: str, f: Any, x: torch.Tensor) -> TensorDict:
    return fresh_tensordict({tensor_key(caller, f, x): x}, x.shape[:1])  # (x's first dim is the batch)


def _only_map(caller: str, result: Any) -> torch.Tensor:
    if type(result) is TensorDict:  # (the common result, read directly: this runs on every call)
        found = leaves(result)
        if len(found) == 1:
            (value,) = found.values()
            if isinstance(value, torch.Tensor):
                return value
    keys = list(result.keys(True, True))
    if len(keys) != 1:
        raise ValueError(f"{caller}: inputs is a tensor, so the result is one tensor, but this call gives "
                         f"{len(keys)} maps {keys}; pass inputs as a TensorDict to get them all")
    return cast(torch.Tensor, result.get(keys[0]))
