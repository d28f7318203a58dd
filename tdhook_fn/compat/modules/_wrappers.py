"""Small TensorDictModules that prepared modules are assembled from (``tdhook.modules``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from textwrap import indent
from typing import Any, cast

import torch
from tensordict import NonTensorData, TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase

from tdhook_fn.compat.hooks import MutableWeakRef, TensorDictRef

__all__ = [
    "FunctionModule",
    "IntermediateKeysCleaner",
    "ModuleCall",
    "ModuleCallWithCache",
    "check_td",
    "flatten_select_reshape_call",
    "get_best_device",
    "layout",
    "prefixed",
]


def get_best_device() -> torch.device:
    """CUDA if available, then MPS, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def flatten_select_reshape_call(
    module: TensorDictModuleBase, td: TensorDictBase, flatten: bool = True, select: bool = True, reshape: bool = True
) -> TensorDictBase:
    """Call ``module`` on ``td`` with its batch dims flattened, keep ``out_keys``, reshape back
    (each step skipped when its flag is ``False``)."""
    result = module(td.flatten() if flatten else td)
    if select:
        result = result.select(*module.out_keys)
    return cast(TensorDictBase, result.reshape(td.shape) if reshape else result)


def layout(module: Any, fields: str) -> str:
    """tdhook's repr: the class name, then ``fields`` (one a line) indented."""
    return f"{type(module).__name__}(\n{indent(fields, 4 * ' ')})"


def prefixed(keys: list[Any], prefix: Any) -> list[Any]:
    return [key if prefix is None else (prefix, key) for key in keys]


def check_td(caller: str, td: Any, keys: Sequence[Any]) -> TensorDictBase:
    """``td``, which must be a TensorDict: a prepared module reads and writes nested entries of it."""
    if not isinstance(td, TensorDictBase):
        raise TypeError(f"{caller}: call the hooked module on a TensorDict holding {list(keys)}, got "
                        f"{type(td).__name__}; e.g. hooked(TensorDict(input=x, batch_size=[len(x)]))")
    return td


class FunctionModule(TensorDictModuleBase):
    """A TensorDict function as a module.

    Args:
        td_fn (Callable): ``td -> td``.
        in_keys (list): the keys it reads.
        out_keys (list): the keys it writes.
    """

    def __init__(self, td_fn: Callable[[TensorDict], TensorDict], in_keys: list[Any], out_keys: list[Any]) -> None:
        super().__init__()
        self.in_keys = in_keys
        self.out_keys = out_keys
        self._td_fn = td_fn

    def forward(self, td: TensorDict) -> TensorDict:
        return self._td_fn(td)

    def __repr__(self) -> str:
        return layout(self, f"in_keys={self.in_keys},\nout_keys={self.out_keys},\ntd_fn={self._td_fn}")


class ModuleCall(TensorDictModuleBase):
    """Call ``td_module`` on ``td[in_key]`` and store its outputs under ``td[out_key]``.

    Args:
        td_module (TensorDictModuleBase): the module to call.
        in_key (str | None): sub-TensorDict holding the inputs. Default: ``td`` itself.
        out_key (str | None): sub-TensorDict receiving the outputs (updated when it
            exists). Default: ``td`` itself.
        flatten (bool): flatten the batch dims for the call. Default: ``True``.
    """

    def __init__(self, td_module: TensorDictModuleBase, in_key: Any = None, out_key: Any = None, flatten: bool = True):
        super().__init__()
        self.in_keys = prefixed(list(td_module.in_keys), in_key)
        self.out_keys = prefixed(list(td_module.out_keys), out_key)
        self._td_module = td_module
        self._in_key = in_key
        self._out_key = out_key
        self._flatten = flatten

    def forward(self, td: TensorDict) -> TensorDict:
        inputs = td if self._in_key is None else td[self._in_key]
        outputs = flatten_select_reshape_call(self._td_module, inputs, flatten=self._flatten)
        if self._out_key is None:
            td.update(outputs)
            return td
        previous = td.get(self._out_key)
        if isinstance(previous, TensorDict):
            previous.update(outputs)
        else:
            td[self._out_key] = outputs
        return td

    def __repr__(self) -> str:
        return layout(self, f"td_module={self._td_module},\nin_keys={self.in_keys},\nout_keys={self.out_keys}")


class ModuleCallWithCache(TensorDictModuleBase):
    """Like `ModuleCall`, with a fresh cache per call that hooks can fill.

    Before each call ``cache_ref`` is pointed at a new TensorDict with the flattened
    batch size; afterwards the cache is written to ``td`` (under ``cache_key``) when
    ``cache_as_output``, else its batch shape is recorded in it as ``"_shape"``.

    Args:
        td_module (TensorDictModuleBase): the module to call.
        stored_keys (list): keys hooks store in the cache (declared as outputs).
        cache_key (str | None): where the cache goes in ``td``. Default: ``td`` itself.
        in_key (str | None): sub-TensorDict holding the inputs, as in `ModuleCall`.
        out_key (str | None): sub-TensorDict receiving the outputs, as in `ModuleCall`.
        flatten (bool): flatten the batch dims for the call, as in `ModuleCall`. Default: ``True``.
        cache_ref (MutableWeakRef | TensorDictRef | None): the reference hooks write
            through. Default: a new ``MutableWeakRef``.
        cache_as_output (bool): write the cache to ``td``. Default: ``True``.
    """

    def __init__(
        self,
        td_module: TensorDictModuleBase,
        stored_keys: list[Any],
        cache_key: Any = None,
        in_key: Any = None,
        out_key: Any = None,
        cache_ref: MutableWeakRef[TensorDict] | TensorDictRef | None = None,
        flatten: bool = True,
        cache_as_output: bool = True,
    ):
        super().__init__()
        self.in_keys = prefixed(list(td_module.in_keys), in_key)
        outputs = prefixed(list(td_module.out_keys), out_key)
        self.out_keys = outputs + prefixed(list(stored_keys), cache_key) if cache_as_output else outputs
        self._td_module = td_module
        self._cache_key = cache_key
        self._in_key = in_key
        self._out_key = out_key
        self._flatten = flatten
        self._cache_as_output = cache_as_output
        self._cache_ref: MutableWeakRef[TensorDict] | TensorDictRef = cache_ref or MutableWeakRef(TensorDict())

    @property
    def cache_ref(self) -> MutableWeakRef[TensorDict] | TensorDictRef:
        return self._cache_ref

    def forward(self, td: TensorDict) -> TensorDict:
        inputs = td if self._in_key is None else td[self._in_key]
        cache = TensorDict(batch_size=inputs.batch_size, device=inputs.device).flatten()
        self._cache_ref.set(cache)
        outputs = flatten_select_reshape_call(self._td_module, inputs, flatten=self._flatten)
        if self._out_key is None:
            td.update(outputs)
        else:
            td[self._out_key] = outputs
        if not self._cache_as_output:
            cache["_shape"] = NonTensorData(tuple(inputs.shape))
        elif self._cache_key is None:
            td.update(cache.reshape(inputs.shape))
        else:
            td[self._cache_key] = cache.reshape(inputs.shape)
        return td

    def __repr__(self) -> str:
        return layout(self, f"td_module={self._td_module},\nin_keys={self.in_keys},\nout_keys={self.out_keys}")


class IntermediateKeysCleaner(TensorDictModuleBase):
    """Drop ``intermediate_keys`` from the TensorDict.

    Args:
        intermediate_keys (list): the keys (or key prefixes) to drop.
    """

    def __init__(self, intermediate_keys: list[Any]) -> None:
        super().__init__()
        self.in_keys = intermediate_keys
        self.out_keys = []
        self._intermediate_keys = intermediate_keys

    def forward(self, td: TensorDict) -> TensorDict:
        return td.exclude(*self._intermediate_keys)

    def __repr__(self) -> str:
        return layout(self, f"in_keys={self.in_keys},\nout_keys={self.out_keys}")
