"""tdhook's adapter hook as a module, so that `tdhook_fn.weights.with_adapters` can splice it.

tdhook 0.1.3 runs an adapter inside a setting hook: ``adapter(adapter_input, **kwargs)``
where ``adapter_input`` is the hooked value (``fwd``: the output; ``fwd_pre``: the tuple of
positional arguments) or, when the adapter reads another module, the cached value there,
and ``kwargs`` are the hook's other arguments (``module``, ``args`` for ``fwd``, ``value``
(``None``) and ``direction``) that ``inspect.signature(adapter)`` names. For an
``nn.Module`` that signature is ``(*args, **kwargs)``, so ``fwd`` adapters always receive
``args=`` (the hooked module's positional inputs) and must accept it. A result of another
type than the hooked value is refused.

`AdapterCall` does exactly that in its ``forward``, with the adapter as its child
module, so the adapter's weights are ordinary entries of the params the adapted model
runs with. ``args`` come from `ArgsRecorder`, a tap recording the hooked module's
inputs into the `recording_args` store of the current call.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from tdhook_fn import Tap
from tdhook_fn._taps import Captured
from tdhook_fn.compat.hooks import CacheProxy, HookDirection

__all__ = ["AdapterCall", "AdapterSpec", "ArgsRecorder", "recording_args"]

# Per call of an adapted model: id(spec) -> positional inputs of the module that spec adapts.
_ARGS: ContextVar[dict[int, tuple[Any, ...]] | None] = ContextVar("tdhook_fn_adapter_args", default=None)


@contextmanager
def recording_args() -> Iterator[None]:
    """A fresh store for `ArgsRecorder` taps, for one call of an adapted model."""
    token = _ARGS.set({})
    try:
        yield
    finally:
        _ARGS.reset(token)


@dataclass(frozen=True, eq=False)
class AdapterSpec:
    """How one tdhook setting hook calls its adapter.

    Attributes:
        direction: ``"fwd"`` or ``"fwd_pre"``.
        target: the user's submodule being adapted (the hook's ``module`` argument).
        proxy: for an adapter reading another module, the cache entry it reads.
        accepted: the names in ``inspect.signature(adapter)``.
    """

    direction: HookDirection
    target: nn.Module
    proxy: CacheProxy | None
    accepted: frozenset[str]

    @property
    def needs_args(self) -> bool:
        return self.direction == "fwd" and "args" in self.accepted


class AdapterCall(nn.Module):
    """``forward(value)`` runs tdhook's setting-hook callback for ``adapter`` on ``value``.

    Args:
        adapter (nn.Module): the user's adapter (registered as child ``adapter``).
        direction (str): ``"fwd"`` (``value`` is the output) or ``"fwd_pre"`` (``value``
            is the single positional input, or the tuple of them when there are several).
        target (nn.Module): the adapted submodule of the model.
        proxy (CacheProxy | None): read the adapter's input from this cache entry.
    """

    def __init__(self, adapter: nn.Module, direction: HookDirection, target: nn.Module, proxy: CacheProxy | None):
        super().__init__()
        self.adapter = adapter
        accepted = frozenset(inspect.signature(adapter).parameters)
        self.spec = AdapterSpec(direction, target, proxy, accepted)

    def forward(self, value: Any) -> Any:
        spec = self.spec
        pre = spec.direction == "fwd_pre"
        original = (value if isinstance(value, tuple) else (value,)) if pre else value
        adapter_input = original if spec.proxy is None else spec.proxy.resolve()
        offered: dict[str, Any] = {"module": spec.target}
        if spec.needs_args:
            store = _ARGS.get()
            offered["args"] = None if store is None else store.get(id(spec))
        offered.update(value=None, direction=spec.direction)
        result = self.adapter(adapter_input, **{k: v for k, v in offered.items() if k in spec.accepted})
        if result is not None and type(result) is not type(original):
            raise RuntimeError(
                f"Callback returned a value of type {type(result).__name__} but the original value was of type "
                f"{type(original).__name__}"
            )
        if not pre or result is None or isinstance(value, tuple):
            return result
        if len(result) != 1:  # the tap hands a single input over unwrapped and wraps the result again
            raise RuntimeError(f"fwd_pre adapter returned {len(result)} arguments for a module called with 1")
        return result[0]


@dataclass(frozen=True)
class ArgsRecorder(Tap):
    """A tap recording the positional inputs of the module at ``path`` for ``spec``'s adapter.

    Its forward hook runs first among the module's forward hooks, so the adapter splice
    registered earlier on the same module finds the inputs of the current call.
    """

    spec: AdapterSpec | None = field(default=None, compare=False)

    def attach(self, module: nn.Module, captured: Captured) -> RemovableHandle:
        slot = id(self.spec)

        def record(_module: nn.Module, args: tuple[Any, ...], _output: Any) -> None:
            store = _ARGS.get()
            if store is not None:
                store[slot] = args

        return module.register_forward_hook(record, prepend=True)
