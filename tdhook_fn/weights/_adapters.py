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

from .._functional import Functional, call
from .._params import params as params_of
from .._paths import PathError, resolve_path
from .._taps import Side, Tap

__all__ = ["Adapted", "Adapter", "adapter_params", "with_adapters"]


@dataclass(frozen=True)
class Adapter:
    """``module`` reads the activation at ``in_path`` and its output replaces the one at
    ``out_path``; ``site="input"`` acts on module inputs (tdhook's ``fwd_pre``).

    Args:
        module (nn.Module): the adapter.
        in_path (str): where it reads its input (see `tdhook_fn.resolve_path`).
        out_path (str): the activation its output replaces.
        site (str): ``"output"`` or ``"input"`` of the modules at the paths. Default: ``"output"``.
    """

    module: nn.Module
    in_path: str
    out_path: str
    site: Side = "output"


class Adapted(Functional):
    """A `tdhook_fn.Functional` with adapters; ``params[key][name]`` holds their weights.

    Args:
        base (Functional): the function adapted.
        adapters (Mapping[str, Adapter]): the adapters by name.
        key (str): the params entry holding the adapters' weights.
        taps (Sequence[Tap]): further taps, active after the adapters. Default: ``()``.
    """

    def __init__(self, base: Functional, adapters: Mapping[str, Adapter], key: str, taps: Sequence[Tap] = ()):
        super().__init__(base.model, base.in_keys, base.out_keys, taps, base.keywords)
        self.base_taps = base.taps
        self.adapters = dict(adapters)
        self.key = key

    def with_taps(self, *taps: Tap) -> Adapted:
        base = Functional(self.model, self.in_keys, self.out_keys, self.base_taps, self.keywords)
        return Adapted(base, self.adapters, self.key, (*self.taps, *taps))

    def __call__(self, params: TensorDictBase, td: TensorDictBase) -> TensorDict:
        if self.key not in params.keys():
            raise KeyError(f"adapted function: params have no {self.key!r} entry (see adapter_params)")
        weights = params.get(self.key)
        if not isinstance(weights, TensorDictBase):
            raise TypeError(
                f"adapted function: params[{self.key!r}] is a {type(weights).__name__}, not a TensorDict of "
                "adapter weights (see adapter_params)"
            )
        taps: list[Tap] = []
        for name, adapter in self.adapters.items():
            if name not in weights.keys():
                raise KeyError(f"adapted function: params[{self.key!r}] has no weights for adapter {name!r}")
            taps += _splice(name, adapter, weights.get(name))
        run = Functional(self.model, self.in_keys, self.out_keys, (*self.base_taps, *taps, *self.taps), self.keywords)
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


AdapterSpec = Adapter | tuple[nn.Module, str, str]


def _as_adapters(what: str, adapters: Mapping[str, AdapterSpec]) -> dict[str, Adapter]:
    """``adapters`` as name -> `Adapter`, or a TypeError/ValueError naming the bad one."""
    if not isinstance(adapters, Mapping):
        raise TypeError(
            f"{what}: adapters must be a mapping name -> Adapter or (module, in_path, out_path), "
            f"e.g. {{'sae': (sae, '[1]', '[1]')}}; got {type(adapters).__name__}"
        )
    return {name: _as_adapter(what, name, value) for name, value in adapters.items()}


def _as_adapter(what: str, name: object, value: object) -> Adapter:
    if not isinstance(name, str):
        raise TypeError(f"{what}: adapter names must be strings (they key the params), got {name!r}")
    if isinstance(value, Adapter):
        adapter = value
    elif isinstance(value, tuple) and len(value) == 3:
        adapter = Adapter(*value)
    else:
        got = f"a tuple of {len(value)}" if isinstance(value, tuple) else type(value).__name__
        raise TypeError(
            f"{what}: adapter {name!r} must be an Adapter or a (module, in_path, out_path) tuple, got {got}"
        )
    if not isinstance(adapter.module, nn.Module):
        raise TypeError(
            f"{what}: adapter {name!r} has a {type(adapter.module).__name__}, not an nn.Module: wrap it in one, "
            "so that its weights can live in the params"
        )
    for path in (adapter.in_path, adapter.out_path):
        if not isinstance(path, str):
            raise TypeError(
                f"{what}: adapter {name!r} has path {path!r}: paths are strings such as '[1]' or 'layers[0]'"
            )
    if adapter.site not in ("output", "input"):
        raise ValueError(f"{what}: adapter {name!r} has site={adapter.site!r}: site must be 'output' or 'input'")
    return adapter


def _check_key(model: nn.Module, key: object) -> None:
    """The adapters' key must not be a top-level name of the model's own params."""
    if not isinstance(key, str):
        raise TypeError(f"with_adapters: key must be a string, got {key!r}")
    names = {n for n, _ in model.named_children()}
    names |= {n for n, _ in model.named_parameters(recurse=False)} | {n for n, _ in model.named_buffers(recurse=False)}
    if key in names:
        free = next(k for k in (f"_{key}" + "_" * i for i in range(len(names) + 1)) if k not in names)
        raise ValueError(
            f"with_adapters: key={key!r} is also a name in the model (a submodule, parameter or buffer), so the "
            f"adapters' weights would mix with the model's own: pass another key, e.g. key={free!r}"
        )


def with_adapters(f: Functional, adapters: Mapping[str, AdapterSpec], *, key: str = "adapters") -> Adapted:
    """``f`` with each adapter's output replacing the activation at its ``out_path``.

    The adapters' weights are read from ``params[key][name]`` on every call, so
    ``torch.func.grad`` of a loss of the adapted function with respect to those entries
    trains the adapters; the model's own entries are used as usual.

    Args:
        f (Functional): pure function of a model.
        adapters (Mapping): name -> `Adapter` or ``(module, in_path, out_path)``.
        key (str): where the adapters' weights live in the params. Default: ``"adapters"``.

    Returns:
        Adapted: a pure ``g(params, td) -> td``.

    Raises:
        TypeError: ``f`` is not a Functional, ``adapters`` not a mapping, an adapter not an
            `Adapter` or ``(module, in_path, out_path)`` with an ``nn.Module`` (named).
        ValueError: an adapter path does not resolve in ``f.model``, its ``site`` is not
            ``"output"`` or ``"input"`` (the adapter is named), or ``key`` is also a name in
            the model.

    Examples:
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
        raise TypeError(
            f"with_adapters: f must be a tdhook_fn.Functional, e.g. tdhook_fn.functional(model), "
            f"got {type(f).__name__}"
        )
    resolved = _as_adapters("with_adapters", adapters)
    _check_key(f.model, key)
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
            except PathError as e:
                raise PathError(f"adapter {name!r}: path {path!r} does not resolve: {e}") from None
    return Adapted(Functional(f.model, f.in_keys, f.out_keys, base_taps, f.keywords), resolved, key, later_taps)


def adapter_params(adapters: Mapping[str, AdapterSpec], *, key: str = "adapters") -> TensorDict:
    """``{key: {name: params(adapter module)}}``, to merge into a model's params.

    Args:
        adapters (Mapping[str, Adapter | tuple]): the adapters by name, as `with_adapters` takes them.
        key (str): the entry the weights go under. Default: ``"adapters"``.

    Raises:
        TypeError: ``adapters`` is not a mapping, or an adapter is malformed (it is named).
        ValueError: an adapter's ``site`` is not ``"output"`` or ``"input"``.
    """
    weights = TensorDict({}, batch_size=[])
    for name, adapter in _as_adapters("adapter_params", adapters).items():
        weights.set(name, params_of(adapter.module))
    return TensorDict({key: weights}, batch_size=[])
