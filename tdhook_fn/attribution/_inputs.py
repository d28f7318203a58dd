"""What a method accepts, settled once at its boundary: plain tensors as its inputs and targets (the captum-style
calls), and the argument checks every gradient method shares, run before anything else."""

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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from .._functional import fresh_tensordict, with_copied_inputs
from .._params import check_attribution_modes, leaves
from .._targets import as_target, check_target
from .._types import NestedKey, PureFn
from .._vjp import untransformed

__all__ = [
    "UNSET", "accepts_tensors", "accepts_tensors_via", "check_call", "check_layers", "one_tensor",
    "tensor_inputs",
]

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
        # (an int target, the common one, is valid for any batch, and a callable is its own target:
        # `check_target` is left out for both)
        target = kwargs.get("target", UNSET)
        checked = target is not UNSET and type(target) is not int and not callable(target)
        if not isinstance(inputs, torch.Tensor):
            if checked and isinstance(inputs, TensorDictBase):  # (anything else: checked there)
                check_target(target, inputs.batch_size, name)
            return method(f, params, inputs, *args, **kwargs)
        key = tensor_key(name, f, inputs)
        if checked:
            check_target(target, inputs.shape[:1], name)
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


def check_layers(caller: str, layers: Any, name: str = "layers") -> None:
    """``layers`` must be a sequence of path strings (a lone string would be read per character)."""
    if type(layers) is tuple and not layers:
        return  # (the default, asked at every call)
    if isinstance(layers, str) or not isinstance(layers, (Sequence, Mapping)):
        raise TypeError(f"{caller}: {name} must be a list of submodule paths, got {layers!r}; write {name}=[{layers!r}]"
                        if isinstance(layers, str) else f"{caller}: {name} must be a list of submodule paths, got "
                        f"{type(layers).__name__}")
    for path in layers:
        if not isinstance(path, str):
            raise TypeError(f"{caller}: each of {name} must be a submodule path (str), got {path!r}")


def check_call(caller: str, f: Any, params: Any, inputs: Any, input_keys: Sequence[NestedKey] = (),
               target: Any = None, *, modes: bool = True) -> None:
    """The arguments every method shares, checked before anything runs.

    ``modes=False`` leaves out the model's modes (`check_attribution_modes`), for a caller
    whose plan of the model checked them (NOTE [plans per model]).

    Raises:
        TypeError: ``f`` is a module or not callable, ``params`` or ``inputs`` is not a
            TensorDict, an attributed input is not floating point (named, with what to do).
        KeyError: an attributed input key is missing.
    """
    if isinstance(f, nn.Module):
        raise TypeError(f"{caller}: f is the module {type(f).__name__}; pass its pure function and params: "
                        f"f, params = tdhook_fn.pure(model) (tdhook_fn.functional(model) and tdhook_fn.params(model) "
                        f"in one call), then {caller}(f, params, inputs, ...)")
    if not callable(f):
        raise TypeError(f"{caller}: f must be a pure function f(params, td) -> td, got {type(f).__name__}")
    if type(params) is not TensorDict and not isinstance(params, TensorDictBase):  # (the identity test first)
        raise TypeError(f"{caller}: params must be a TensorDict (tdhook_fn.params(model)), got {type(params).__name__}")
    if type(inputs) is not TensorDict and not isinstance(inputs, TensorDictBase):
        raise TypeError(f"{caller}: inputs must be a TensorDict, or a tensor whose first dim is the batch, got "
                        f"{type(inputs).__name__}; wrap a batch x as TensorDict(input=x, batch_size=[len(x)])")
    for key in input_keys:
        value = inputs.get(key, None)
        if value is None:
            keys = list(inputs.keys(True, True))
            raise KeyError(f"{caller}: the inputs have no attributed key {key!r} (keys: {keys})")
        if isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex()):
            raise TypeError(
                f"{caller}: input {key!r} is {value.dtype}, and gradients exist only for floating-point inputs; "
                "for token ids attribute the embedding layer instead (layers=['<embedding path>'], "
                "use_inputs=False; integrated gradients: interpolate='layers')"
            )
    model = getattr(f, "model", None)
    if modes and isinstance(model, nn.Module):
        check_attribution_modes(model, caller)
    if not inputs.batch_dims:  # (its test, inline: batched inputs, the common call, need none)
        check_batch_first(caller, f, params, inputs, target)


def check_batch_first(caller: str, f: Any, params: TensorDictBase, inputs: TensorDictBase, target: Any = None) -> None:
    """Raise where ``f`` reads a sample with a batch dim of 1 in front other than the sample itself."""
    # NOTE [unbatched inputs]
    # The methods run ``f`` on inputs with one batch dim in front: several batch dims are
    # flattened to one, and inputs without any (``batch_size=[]``) become a batch of one,
    # ``[1, ...]`` (integrated gradients puts its path points there too). A model that
    # reads the leading dim otherwise would compute another function there than on the
    # sample, and the maps would be silently wrong: ``nn.MultiheadAttention`` with
    # ``batch_first=False`` given ``[T, D]`` sees one position of ``T`` sequences, a
    # forward reducing over dim 0 sums over the batch. So for inputs without batch dims an
    # eager call first runs ``f`` on the sample and on it as a batch of one (the same
    # random state for both, without a graph) and raises where what is attributed (the
    # target values; every output where no target is given) differs, unless the sample
    # alone gives another value when run again (noise the random state does not hold); a model
    # that cannot run the sample alone (batch norm, a batched-only forward) reads it as a
    # batch of one, and is left to that. Under ``vmap`` and ``torch.compile`` nothing is
    # compared (the data cannot be read there). Not seen either: a batch dim that the
    # model does not read as the batch but whose size fits (``batch_size=[T]`` for a
    # ``batch_first=False`` model given ``[T, B, D]``): the model runs on what it is given,
    # and the maps are those of the positions taken as samples.
    if inputs.batch_size != torch.Size([]) or not untransformed():
        return
    # the GPUs the call may draw on: the inputs', and the params' (a GPU model may move CPU inputs there)
    tensors = [t for td in (inputs, params) for t in td.values(True, True) if isinstance(t, torch.Tensor)]
    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        cpu, cuda = torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]

        def seeded(td: TensorDictBase) -> Any:
            torch.set_rng_state(cpu)
            for d, state in zip(devices, cuda, strict=True):
                torch.cuda.set_rng_state(state, d)
            return _attributed(f(params, with_copied_inputs(td)), td, target)  # (a forward may write its inputs)

        try:
            alone = seeded(inputs)
        except Exception:  # (batched-only: the batch of one is the only reading)
            return
        try:
            batched = seeded(inputs.unsqueeze(0))
        except Exception as e:
            raise ValueError(_not_batch_first(caller, "raises on it as a batch of one, [1, ...]")) from e
        differs = _difference(alone, batched)
        if differs is not None and _difference(alone, seeded(inputs)) is None:  # (else: noise of its own)
            raise ValueError(_not_batch_first(caller, differs))


def _attributed(out: Any, td: TensorDictBase, target: Any) -> Any:
    """What is attributed of ``f``'s output ``out`` on ``td``: the target values, or every output without one."""
    if target is None or not isinstance(out, TensorDictBase):
        return out
    offered = out.clone(False)
    for key, value in td.items(True, True):  # (labels and other inputs a target may read)
        if key not in offered.keys(True, True):
            offered.set(key, value)
    values = as_target(target, outputs=list(out.keys(True, True)))(offered)
    return TensorDict(target=values) if isinstance(values, torch.Tensor) else values


def _difference(alone: Any, batched: Any) -> str | None:
    """How the outputs on the sample and on it as a batch of one differ, if they do."""
    for key, value in alone.items(True, True):
        one = batched.get(key, None)
        if not isinstance(value, torch.Tensor) or not isinstance(one, torch.Tensor):
            continue
        if one.numel() != value.numel():  # (the same numbers in another shape are the same function)
            return (f"gives {key!r} of shape {tuple(one.shape)} on it as a batch of one, {tuple(value.shape)} on the "
                    "sample")
        finite = value[torch.isfinite(value)] if value.is_floating_point() else value
        scale = float(finite.abs().max()) if value.is_floating_point() and finite.numel() else 1.0
        if not torch.allclose(one.reshape(-1), value.reshape(-1), rtol=1e-4, atol=1e-5 * max(1.0, scale),
                              equal_nan=True):
            return f"gives another {key!r} on it as a batch of one than on the sample"
    return None


def _not_batch_first(caller: str, what: str) -> str:
    return (f"{caller}: the inputs have no batch dims (batch_size=[]), so the model runs on the sample as a batch of "
            f"one (NOTE [unbatched inputs]), and this model {what}: it does not read a leading dim as the batch "
            "(e.g. nn.MultiheadAttention or nn.TransformerEncoderLayer with batch_first=False given [T, D], or a "
            "forward that reduces over dim 0). Give the inputs the batch dim the model reads as the batch, and "
            "batch_size=[B] (e.g. TensorDict(input=x[None], batch_size=[1]) for a batch-first model, or a "
            "batch_first=True model)")
