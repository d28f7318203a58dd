"""The argument checks every gradient method shares, run before anything else."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

from .._functional import NestedKey
from .._modes import check_attribution_modes

__all__ = ["check_call", "check_layers"]


def check_layers(method: str, layers: Any, name: str = "layers") -> None:
    """``layers`` must be a sequence of path strings (a lone string would be read per character)."""
    if isinstance(layers, str) or not isinstance(layers, (Sequence, Mapping)):
        raise TypeError(f"{method}: {name} must be a list of submodule paths, got {layers!r}; write {name}=[{layers!r}]"
                        if isinstance(layers, str) else f"{method}: {name} must be a list of submodule paths, got "
                        f"{type(layers).__name__}")
    for path in layers:
        if not isinstance(path, str):
            raise TypeError(f"{method}: each of {name} must be a submodule path (str), got {path!r}")


def check_call(method: str, f: Any, params: Any, inputs: Any, input_keys: Sequence[NestedKey] = ()) -> None:
    """The arguments every method shares, checked before anything runs.

    Raises:
        TypeError: ``f`` is a module or not callable, ``params`` or ``inputs`` is not a
            TensorDict, an attributed input is not floating point (named, with what to do).
        KeyError: an attributed input key is missing.
    """
    if isinstance(f, nn.Module):
        raise TypeError(f"{method}: f is the module {type(f).__name__}; pass its pure function and params: "
                        f"f, params = tdhook_fn.pure(model) (tdhook_fn.functional(model) and tdhook_fn.params(model) "
                        f"in one call), then {method}(f, params, inputs, ...)")
    if not callable(f):
        raise TypeError(f"{method}: f must be a pure function f(params, td) -> td, got {type(f).__name__}")
    if not isinstance(params, TensorDictBase):
        raise TypeError(f"{method}: params must be a TensorDict (tdhook_fn.params(model)), got {type(params).__name__}")
    if not isinstance(inputs, TensorDictBase):
        raise TypeError(f"{method}: inputs must be a TensorDict, or a tensor whose first dim is the batch, got "
                        f"{type(inputs).__name__}; wrap a batch x as TensorDict(input=x, batch_size=[len(x)])")
    for key in input_keys:
        value = inputs.get(key, None)
        if value is None:
            keys = list(inputs.keys(True, True))
            raise KeyError(f"{method}: the inputs have no attributed key {key!r} (keys: {keys})")
        if isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex()):
            raise TypeError(
                f"{method}: input {key!r} is {value.dtype}, and gradients exist only for floating-point inputs; "
                "for token ids attribute the embedding layer instead (layers=['<embedding path>'], "
                "use_inputs=False; integrated gradients: interpolate='layers')"
            )
    model = getattr(f, "model", None)
    if isinstance(model, nn.Module):
        check_attribution_modes(model, method)
