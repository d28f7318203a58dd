"""The argument checks every gradient method shares, run before anything else."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from .._functional import NestedKey, with_copied_inputs
from .._modes import check_attribution_modes
from .._targets import as_target
from .._vjp import untransformed

__all__ = ["check_batch_first", "check_call", "check_layers"]


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
