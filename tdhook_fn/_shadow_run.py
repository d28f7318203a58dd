"""Running a model with given parameters, without touching the model."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from ._params import Key, leaves
from ._paths import resolve_path
from ._pool_layout import FAST_POOLING
from ._shadow import Shadow, param_marks, shadow_lock
from ._tap_calls import attached
from ._taps import Captured, Tap, sees_modules
from ._traced import run_traced

__all__ = ["call", "call_with_taps", "require_params", "run", "shadow_of"]

_POOL_SIZE = 16


def require_params(params: Any, where: str) -> None:
    """Refuse ``params=None`` at a public entry point: only the internal live path runs the model's own tensors.

    Raises:
        TypeError: ``params`` is None.
    """
    if params is None:
        raise TypeError(
            f"{where}: params is None; pass tdhook_fn.params(model) (or a TensorDict with its keys). The model's own "
            "tensors are never run live: that would update its buffers and fill its .grad")


def run(
    model: nn.Module,
    params: TensorDictBase | None,
    taps: Sequence[Tap],
    invoke: Callable[[nn.Module], Any],
    *,
    overrides: Mapping[Key, Any] | None = None,
) -> tuple[Any, Captured]:
    """``invoke(shadow)`` on a private shadow of ``model`` holding ``params``, with ``taps``.

    ``params=None`` runs with the model's own tensors, live (the compat layer's plain
    forward); ``overrides`` then replaces some of them, by key, for this call only (the
    model's own slots are never written). Everything registered for the call is removed
    on the way out, also when it raises.
    """
    if overrides and params is not None:
        raise ValueError("run: overrides replace the model's own tensors; pass params=None with them")
    if params is not None and type(params) is not TensorDict and not isinstance(params, TensorDictBase):
        raise TypeError(f"params must be a TensorDict (see tdhook_fn.params), got {type(params).__name__}")
    compiling = torch.compiler.is_compiling()
    if compiling and params is not None:  # (a TensorDict: checked above)
        return run_traced(model, leaves(params), taps, invoke)
    values = None if params is None else leaves(params)
    targets = [resolve_path(model, tap.path) for tap in taps] if taps else []
    captured: Captured = {}
    # (a tap that attaches itself sees the shadow's modules, and may choose by their class: NOTE [shadow max pooling])
    fast = not compiling and FAST_POOLING.get() and not (taps and any(sees_modules(tap) for tap in taps))
    with shadow_of(model, fast) as shadow:
        if values is None:
            shadow.load_own()
            if overrides:
                shadow.override(dict(overrides))
        else:
            shadow.load(values)
        marks = {} if values is None else param_marks(values, shadow.param_keys)
        if taps:
            modules = [shadow.module_for(target, tap.path) for tap, target in zip(taps, targets, strict=True)]
            with attached(taps, modules, captured):
                output = invoke(shadow.root)
        else:  # (nothing to attach: the common call)
            output = invoke(shadow.root)
        if values is not None:
            shadow.check_params_kept(values, marks)
    return output, captured


def call(model: nn.Module, params: TensorDictBase, /, *args: Any, **kwargs: Any) -> Any:
    """Run ``model(*args, **kwargs)`` with ``params`` in place of its own tensors.

    The model is never changed, not even while the call runs (it runs on a private shadow
    copy of the module tree), so threads may share it. Works under ``torch.func`` transforms: ``vmap`` over a
    stacked params TensorDict (batch ``[K]``) or over inputs, ``grad``/``vjp``/``jacrev``
    with respect to params or inputs.

    Args:
        model (nn.Module): the module whose forward runs.
        params (TensorDict): exactly the keys of `tdhook_fn.params` ``(model)``.
        *args (Any): passed to the forward.
        **kwargs (Any): passed to the forward.

    Returns:
        Any: what the forward returns.

    Raises:
        TypeError: ``params`` is None or not a TensorDict.
        ValueError: ``params`` lacks or adds keys (they are named).

    Examples:
        >>> import torch, tdhook_fn
        >>> net = torch.nn.Linear(3, 2)
        >>> ensemble = torch.stack([tdhook_fn.params(net)] * 4)
        >>> torch.func.vmap(tdhook_fn.call, (None, 0, None))(net, ensemble, torch.ones(3)).shape
        torch.Size([4, 2])
    """
    require_params(params, "call")
    output, _ = run(model, params, (), lambda root: root(*args, **kwargs))
    return output


def call_with_taps(
    model: nn.Module, params: TensorDictBase, taps: Sequence[Tap], /, *args: Any, **kwargs: Any
) -> tuple[Any, Captured]:
    """Like `call`, with ``taps`` active for this call only.

    Args:
        model (nn.Module): the module whose forward runs.
        params (TensorDict): exactly the keys of `tdhook_fn.params` ``(model)``.
        taps (Sequence[Tap]): the taps active for this call (`capture`, `intervene`, ...).
        *args (Any): passed to the forward.
        **kwargs (Any): passed to the forward.

    Returns:
        tuple[Any, dict[str, Any]]: the forward's output and the captured activations
        by tap key.

    Raises:
        TypeError: ``params`` is None or not a TensorDict.
    """
    require_params(params, "call_with_taps")
    return run(model, params, taps, lambda root: root(*args, **kwargs))


# the shadows of each model, and those for `fast_pooling` calls (NOTE [shadow max pooling])
_pools: tuple[weakref.WeakKeyDictionary[nn.Module, list[Shadow]], ...] = (weakref.WeakKeyDictionary(),
                                                                          weakref.WeakKeyDictionary())


class shadow_of:  # (a context manager read as a function; a class, not a generator: it runs on every call)
    """Borrow a refreshed shadow of ``model`` for one call (``with shadow_of(model) as shadow:``); it is cleared
    on return.

    ``fast_pooling``: shadows that pool in channels-last where that is faster (NOTE [shadow max pooling]).
    """

    __slots__ = ("fast_pooling", "model", "pool", "shadow")

    def __init__(self, model: nn.Module, fast_pooling: bool = False):
        self.model = model
        self.fast_pooling = fast_pooling

    def __enter__(self) -> Shadow:
        model = self.model
        pools = _pools[self.fast_pooling]
        with shadow_lock:
            pool = pools.get(model)
            if pool is None:
                pool = pools[model] = []
            shadow = pool.pop() if pool else None
        self.pool = pool
        if shadow is not None:
            self.shadow = shadow
            try:
                current = shadow.refresh(check=True)  # (False, and left empty, where the model changed)
            except BaseException:
                self.__exit__()
                raise
            if current:
                return shadow
        self.shadow = shadow = Shadow(model, self.fast_pooling)
        try:
            shadow.refresh()
        except BaseException:
            self.__exit__()
            raise
        return shadow

    def __exit__(self, *exc: object) -> None:
        shadow = self.shadow
        shadow.unload()
        with shadow_lock:
            if len(self.pool) < _POOL_SIZE:
                self.pool.append(shadow)
