"""A model as a pure function ``f(params, td) -> td``, and the call under it: the model run with given parameters
on a private shadow, without touching the model (`run`, `tdhook_fn.call`)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import nn
from torch.nn.utils import parametrize

from ._forward_values import get_input, output_leaves
from ._params import Key, leaves
from ._params import params as params_of
from ._paths import resolve_path
from ._pool_layout import FAST_POOLING
from ._shadow import Shadow, param_marks, shadow_lock
from ._tap_calls import attached, check_tap_keys
from ._taps import Captured, Tap, attaches_itself
from ._traced import run_traced
from ._types import NestedKey

__all__ = [
    "Functional",
    "call",
    "call_with_taps",
    "fresh_tensordict",
    "functional",
    "one_key_as_list",
    "pack",
    "pure",
    "require_params",
    "run",
    "shadow_of",
    "with_copied_inputs",
]


class Functional:
    """A pure function of ``(params, td)`` running ``model``; build it with `functional`.

    Calling it reads ``in_keys`` from ``td``, runs the model on its private shadow with
    ``params`` (see `tdhook_fn.call`) and returns a new TensorDict holding
    ``out_keys`` and any captured activations (under their tap keys). ``td`` is not
    modified. `with_taps` adds taps.

    Attributes:
        model (nn.Module): the module (or ``TensorDictModule``) that runs.
        in_keys (tuple): keys read from the input TensorDict, passed positionally, or
            by keyword for those named in ``keywords``.
        keywords (dict): in_key -> the forward's keyword argument it is passed as.
        out_keys (tuple): entries of a dict output by key, else keys for the leaves of
            the output in optree order.
        taps (tuple[Tap, ...]): taps active on every call.
    """

    def __init__(
        self,
        model: nn.Module,
        in_keys: Sequence[NestedKey],
        out_keys: Sequence[NestedKey],
        taps: Sequence[Tap] = (),
        keywords: Mapping[NestedKey, str] | None = None,
    ):
        self.model = model
        self.in_keys = (in_keys,) if isinstance(in_keys, str) else tuple(in_keys)  # (one_key_as_list, inline)
        self.keywords = dict(keywords or {})
        self.out_keys = (out_keys,) if isinstance(out_keys, str) else tuple(out_keys)
        self.taps = tuple(taps)
        if self.taps:
            check_tap_keys(self.taps, self.out_keys, "functional")  # NOTE [taps that never fire]

    def with_taps(self, *taps: Tap) -> Functional:
        """A new function with ``taps`` added after this one's."""
        return Functional(self.model, self.in_keys, self.out_keys, self.taps + taps, self.keywords)

    def __call__(self, params: TensorDictBase, td: TensorDictBase) -> TensorDict:
        if params is None:  # (`require_params` raises: only called then, as this runs on every call)
            require_params(params, "functional")
        return self._run(params, td, {})

    def call_with(self, params: TensorDictBase, td: TensorDictBase, **extra: Any) -> TensorDict:
        """``self(params, td)``, passing the forward ``extra`` keyword arguments as well.

        For what no TensorDict holds, such as a Hugging Face cache object
        (``past_key_values=``). Not for a ``TensorDictModule`` (it takes the TensorDict only).

        Raises:
            TypeError: ``params`` is None (pass `tdhook_fn.params` ``(model)``).
        """
        require_params(params, "functional")
        return self._run(params, td, extra)

    def _run(self, params: TensorDictBase | None, td: TensorDictBase, extra: dict[str, Any]) -> TensorDict:
        if extra and isinstance(self.model, TensorDictModuleBase):
            raise TypeError(f"functional: a TensorDictModule takes no extra keyword arguments, got {sorted(extra)}")
        if type(td) is not TensorDict and not isinstance(td, TensorDictBase):  # (the identity test first)
            raise TypeError(
                f"functional: f(params, td) takes the inputs as a TensorDict, got {type(td).__name__}; wrap a batch "
                f"x as TensorDict({self.in_keys[0] if self.in_keys else 'input'}=x, batch_size=[len(x)])"
            )
        if isinstance(self.model, TensorDictModuleBase):
            output, captured = run(self.model, params, self.taps, lambda root: root(td.copy()))
            missing = [k for k in self.out_keys if k not in output.keys(include_nested=True)]
            if missing:
                raise KeyError(f"functional: the TensorDictModule wrote no {missing}")
            leaves = [output.get(k) for k in self.out_keys]
        else:
            names = self.keywords
            args: list[Any] = []
            kwargs: dict[str, Any] = {}
            own = td.__dict__["_tensordict"] if type(td) is TensorDict else None  # (`get` costs a few calls)
            for key in self.in_keys:  # (a loop, a tensor read inline: comprehensions and calls cost, on every call)
                value = own.get(key) if own is not None and type(key) is str else td.get(key, None)
                if type(value) is not torch.Tensor:  # missing, a non-tensor entry (a kwarg), a TensorDict
                    value = get_input(td, key)
                if key in names:
                    kwargs[names[key]] = value
                else:
                    args.append(value)
            kwargs.update(extra)
            output, captured = run(self.model, params, self.taps, lambda root: root(*args, **kwargs))
            # (the common output, one tensor for one key, taken as it is: on every call)
            leaves = [output] if type(output) is torch.Tensor and len(self.out_keys) == 1 else output_leaves(
                output, self.out_keys)
        return pack(td.batch_size, dict(zip(self.out_keys, leaves, strict=False)), captured)

    def __repr__(self) -> str:
        taps = f", taps={list(self.taps)}" if self.taps else ""
        model = type(self.model).__name__
        return f"Functional({model}, in_keys={list(self.in_keys)}, out_keys={list(self.out_keys)}{taps})"


def functional(
    model: nn.Module,
    in_keys: Sequence[NestedKey] | Mapping[NestedKey, str] | str | None = None,
    out_keys: Sequence[NestedKey] | str | None = None,
) -> Functional:
    """Turn ``model`` into a pure ``f(params, td) -> td``.

    Args:
        model (nn.Module): an ``nn.Module`` or a ``TensorDictModule``.
        in_keys (list | dict | str | None): keys of the forward's positional arguments (one
            str is one key, as in tensordict's ``TensorDictModule``), or a
            dict ``{key: keyword}`` passing each key as that keyword argument (as
            tensordict's ``TensorDictModule`` does: ``{"input_ids": "input_ids",
            "attention_mask": "attention_mask"}`` for a Hugging Face model). Default:
            ``["input"]``, or the ``TensorDictModule``'s own.
        out_keys (list | str | None): for a dict (or other ``Mapping``, e.g. a transformers
            ``ModelOutput``) output, the entries to keep, by key (a tuple walks nested
            dicts); otherwise keys for the output's leaves in order (tuples, lists and
            dataclasses are flattened in optree order). Default: ``["output"]``, or the
            ``TensorDictModule``'s own.

    Returns:
        Functional: ``f(params, td)`` with any batch size of ``td`` (``[]``, ``[3]``,
        ``[2, 3]``); the result keeps as much of it as the outputs share.

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Linear(3, 2)
        >>> f = tdhook_fn.functional(net)
        >>> td = TensorDict(input=torch.ones(5, 3), batch_size=[5])
        >>> f(tdhook_fn.params(net), td)["output"].shape
        torch.Size([5, 2])
        >>> torch.func.vmap(f, (None, 0))(tdhook_fn.params(net), td).batch_size
        torch.Size([5])
    """
    if isinstance(model, TensorDictModuleBase):
        in_keys = model.in_keys if in_keys is None else in_keys
        out_keys = model.out_keys if out_keys is None else out_keys
    if not isinstance(model, nn.Module):
        raise TypeError(f"functional: expected an nn.Module, got {type(model).__name__}")
    in_keys, out_keys = one_key_as_list(in_keys), one_key_as_list(out_keys)
    keywords = dict(in_keys) if isinstance(in_keys, Mapping) else {}
    for key, name in keywords.items():
        if not isinstance(name, str):
            raise TypeError(f"functional: in_keys maps {key!r} to {name!r}; a keyword argument name is a str")
    in_keys = ["input"] if in_keys is None else list(in_keys)
    out_keys = ["output"] if out_keys is None else list(out_keys)
    if not out_keys:
        raise ValueError("functional: out_keys must name at least one output")
    return Functional(model, in_keys, out_keys, keywords=keywords)


def pure(
    model: nn.Module,
    in_keys: Sequence[NestedKey] | Mapping[NestedKey, str] | str | None = None,
    out_keys: Sequence[NestedKey] | str | None = None,
) -> tuple[Functional, TensorDict]:
    """``(functional(model, in_keys, out_keys), params(model))``: what every method takes first.

    The one-line path from a module to a method call, as captum's ``Method(model)``.

    Args:
        model (nn.Module): an ``nn.Module`` or a ``TensorDictModule``.
        in_keys (Sequence | Mapping | None): the input keys, as in `functional`.
        out_keys (Sequence | None): the output keys, as in `functional`.

    Returns:
        tuple[Functional, TensorDict]: the pure function and the model's parameters and
        buffers (detached, see `tdhook_fn.params`).

    Examples:
        >>> import torch, tdhook_fn
        >>> from tdhook_fn.attribution import integrated_gradients
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> x = torch.randn(5, 3)
        >>> f, params = tdhook_fn.pure(model)
        >>> integrated_gradients(f, params, x, 0.0, target=model(x).argmax(-1)).shape
        torch.Size([5, 3])
    """
    return functional(model, in_keys, out_keys), params_of(model)


def with_copied_inputs(td: TensorDictBase, keep: Collection[NestedKey] = ()) -> TensorDictBase:
    """``td`` with its tensors copied (except those under ``keep``), for a method to run ``f`` on.

    A model may write its inputs in place (a first ``ReLU(inplace=True)``, ``x += ...``);
    a method's call must never write the caller's tensors. ``keep`` names those the
    method replaces anyway (the attributed inputs, differentiated as fresh leaves).
    """
    out = td.copy()
    for key, value in td.items(True, True):
        if isinstance(value, torch.Tensor) and key not in keep:
            out.set(key, value.clone())
    return out


def one_key_as_list(keys: Any) -> Any:
    """A lone str key as a list of that key: ``"input"`` names one entry, not five (as ``TensorDictModule``)."""
    return [keys] if isinstance(keys, str) else keys


# NOTE [unchecked TensorDicts]
# ``TensorDict(entries, batch_size=b)`` checks every entry's leading dims against ``b`` and
# parses the batch size: about twice what ``TensorDict._new_unsafe`` costs, and one
# gradient call builds several (the model's inputs and outputs, the target values, the
# cotangents, the maps). Where the entries were just made with that batch in front (an
# output's column, a gradient of an input, a ``ones_like``, the primals of the inputs' own
# entries), the check cannot fail, so those are built with ``_new_unsafe``. Only under
# one-name (str) keys: ``_new_unsafe`` stores a tuple key as one name (a nested key would
# come back missing); anything else takes the checked constructor and ``set``. Under
# torch.compile ``_new_unsafe`` builds the checked one itself.


def fresh_tensordict(entries: Any, batch_size: Sequence[int], device: Any = None, names: Any = None) -> TensorDict:
    """``entries`` (a dict of tensors just made with ``batch_size`` in front) as a TensorDict, built unchecked
    where every key is one name and every value a plain tensor (NOTE [unchecked TensorDicts]); otherwise by
    ``set``, which makes a nested key's levels. ``names``: the batch dims' names, if any."""
    for key, value in entries.items():
        if type(key) is not str or type(value) is not torch.Tensor:
            out = TensorDict({}, batch_size=batch_size, device=device, names=names)
            for name, value in entries.items():
                out.set(name, value)
            return out
    return TensorDict._new_unsafe(entries, batch_size=torch.Size(batch_size), device=device, names=names)


def pack(batch: torch.Size, outputs: dict[NestedKey, Any], captured: Captured) -> TensorDict:
    values: dict[Any, Any] = {**outputs}
    values.update(captured)
    for key, value in values.items():
        if type(value) is not torch.Tensor and not isinstance(value, (torch.Tensor, TensorDictBase)):
            raise TypeError(
                f"functional: {key!r} is a {type(value).__name__}; only tensors fit a "
                "TensorDict (give the tap an fn that selects one)"
            )
        while value.shape[: len(batch)] != batch:  # keep the batch dims the outputs share
            batch = batch[:-1]
    return fresh_tensordict(values, batch)


# -- the call: a model run on its private shadow ------------------------------------------------------------

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
    fast = not compiling and FAST_POOLING.get() and not (taps and any(attaches_itself(tap) for tap in taps))
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
        self.shadow = shadow
        try:
            if shadow is None or not shadow.refresh(check=True):  # (False, and left empty, where the model changed)
                self.shadow = shadow = Shadow(model, self.fast_pooling)
                shadow.refresh()
        except BaseException:
            self.__exit__()
            raise
        if shadow.cache_keys and parametrize._cache_enabled:  # NOTE [cached parametrizations]
            shadow.set_cache_aside()
        return shadow

    def __exit__(self, *exc: object) -> None:
        shadow = self.shadow
        if shadow is None:  # (building it failed)
            return
        shadow.unload()
        with shadow_lock:
            if len(self.pool) < _POOL_SIZE:
                self.pool.append(shadow)
