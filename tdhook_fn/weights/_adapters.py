"""Adapters: modules spliced into a model's forward, with their weights in the params.

Sparse autoencoders and ROME-style edits read and replace the same activation
(``in_path == out_path``); transcoders read one activation and replace another.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tensordict import TensorDict, TensorDictBase
from torch import nn

from .._call import call
from .._functional import Functional
from .._params import params as params_of
from .._paths import resolve_path
from .._taps import Site, Tap

__all__ = ["Adapted", "Adapter", "adapter_params", "with_adapters"]


@dataclass(frozen=True)
class Adapter:
    """``module`` reads the activation at ``in_path`` and its output replaces the one at
    ``out_path``; ``site="input"`` acts on module inputs (tdhook's ``fwd_pre``)."""

    module: nn.Module
    in_path: str
    out_path: str
    site: Site = "output"


class Adapted(Functional):
    """A :class:`tdhook_fn.Functional` with adapters; ``params[key][name]`` holds their weights."""

    def __init__(self, base: Functional, adapters: Mapping[str, Adapter], key: str, taps: Sequence[Tap] = ()):
        super().__init__(base.model, base.in_keys, base.out_keys, taps)
        self.base_taps = base.taps
        self.adapters = dict(adapters)
        self.key = key

    def with_taps(self, *taps: Tap) -> Adapted:
        base = Functional(self.model, self.in_keys, self.out_keys, self.base_taps)
        return Adapted(base, self.adapters, self.key, (*self.taps, *taps))

    def __call__(self, params: TensorDictBase, td: TensorDictBase) -> TensorDict:
        if self.key not in params.keys():
            raise KeyError(f"adapted function: params have no {self.key!r} entry (see adapter_params)")
        weights = params.get(self.key)
        taps: list[Tap] = []
        for name, adapter in self.adapters.items():
            if name not in weights.keys():
                raise KeyError(f"adapted function: params[{self.key!r}] has no weights for adapter {name!r}")
            taps += _splice(name, adapter, weights.get(name))
        run = Functional(self.model, self.in_keys, self.out_keys, (*self.base_taps, *taps, *self.taps))
        return run(params.exclude(self.key), td)


def _splice(name: str, adapter: Adapter, weights: TensorDictBase) -> list[Tap]:
    """Taps for one call: record the input activation if needed, then replace the output."""
    if adapter.in_path == adapter.out_path:
        return [Tap(adapter.out_path, "intervene", lambda act: call(adapter.module, weights, act), adapter.site)]
    seen: dict[str, Any] = {}

    def record(act: Any) -> None:
        seen["act"] = act

    def replace(_: Any) -> Any:
        if "act" not in seen:
            raise RuntimeError(f"adapter {name!r}: {adapter.out_path!r} ran before {adapter.in_path!r}")
        return call(adapter.module, weights, seen["act"])

    return [Tap(adapter.in_path, "intervene", record, adapter.site),
            Tap(adapter.out_path, "intervene", replace, adapter.site)]


def _as_adapter(value: Adapter | tuple[nn.Module, str, str]) -> Adapter:
    return value if isinstance(value, Adapter) else Adapter(*value)


def with_adapters(
    f: Functional, adapters: Mapping[str, Adapter | tuple[nn.Module, str, str]], *, key: str = "adapters"
) -> Adapted:
    """``f`` with each adapter's output replacing the activation at its ``out_path``.

    The adapters' weights are read from ``params[key][name]`` on every call, so
    ``torch.func.grad`` of a loss of the adapted function with respect to those entries
    trains the adapters; the model's own entries are used as usual.

    Args:
        f (Functional): pure function of a model.
        adapters (Mapping): name -> :class:`Adapter` or ``(module, in_path, out_path)``.
        key (str): where the adapters' weights live in the params. Default: ``"adapters"``.

    Returns:
        Adapted: a pure ``g(params, td) -> td``.

    Raises:
        ValueError: an adapter path does not resolve in ``f.model`` (it is named).

    >>> import torch, tdhook_fn
    >>> from tensordict import TensorDict
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> sae = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    >>> g = with_adapters(tdhook_fn.functional(net), {"sae": (sae, "[1]", "[1]")})
    >>> p = tdhook_fn.params(net).update(adapter_params({"sae": (sae, "[1]", "[1]")}))
    >>> g(p, TensorDict(input=torch.randn(5, 3), batch_size=[5]))["output"].shape
    torch.Size([5, 2])
    """
    if not isinstance(f, Functional):
        raise TypeError("with_adapters needs a tdhook_fn.Functional")
    resolved = {name: _as_adapter(a) for name, a in adapters.items()}
    base_taps: tuple[Tap, ...] = f.taps
    later_taps: tuple[Tap, ...] = ()
    if isinstance(f, Adapted):  # adapters added to an adapted function join the existing ones
        if f.key != key or resolved.keys() & f.adapters.keys():
            raise ValueError(f"with_adapters: nested adapters must share key {f.key!r} and have new names")
        resolved = {**f.adapters, **resolved}
        base_taps, later_taps = f.base_taps, f.taps
    for name, adapter in resolved.items():
        for path in (adapter.in_path, adapter.out_path):
            try:
                resolve_path(f.model, path)
            except ValueError as e:
                raise ValueError(f"adapter {name!r}: path {path!r} does not resolve: {e}") from None
    return Adapted(Functional(f.model, f.in_keys, f.out_keys, base_taps), resolved, key, later_taps)


def adapter_params(
    adapters: Mapping[str, Adapter | tuple[nn.Module, str, str]], *, key: str = "adapters"
) -> TensorDict:
    """``{key: {name: params(adapter module)}}``, to merge into a model's params."""
    weights = TensorDict({}, batch_size=[])
    for name, adapter in adapters.items():
        weights.set(name, params_of(_as_adapter(adapter).module))
    return TensorDict({key: weights}, batch_size=[])
