"""Pruning with the public API of ``tdhook.weights.pruning`` from tdhook 0.1.3.

Inside the context the user's model *is* pruned, as with tdhook (that is what the
method is for: the raw model, the hooked module and anything else holding the model
see the pruned weights), and on exit it is restored bit for bit.

# NOTE [pruning in place]
The masks come from the pure functions of :mod:`tdhook_fn.weights`
(:func:`~tdhook_fn.weights.pruning_scores`, :func:`~tdhook_fn.weights.global_unstructured_masks`,
:func:`~tdhook_fn.weights.ln_structured_mask`, :func:`~tdhook_fn.weights.apply_masks`), and
every pruned value is computed before the first parameter is written, so a bad score, amount
or dim leaves the model untouched. The pruned values are then copied into the model's own
``nn.Parameter`` objects under ``torch.no_grad`` (same objects, same storage, same order in
``named_parameters``), after a copy of each pruned parameter is kept. On exit, also when the
body raises or ``__enter__`` fails after pruning, those copies are written back, newest first.

Differences from tdhook 0.1.3:

- tdhook clones every parameter and buffer on entry and writes them all back on exit (so a
  BatchNorm's running statistics updated inside the context are reset); only the pruned
  parameters are remembered and restored here.
- tdhook swaps each pruned parameter's storage (``prune.remove``) and moves it to the end
  of its module's ``named_parameters``; here values are written in place.
- A failure while computing the masks leaves the model as it was (tdhook may leave it
  partly pruned, and a failed ``__enter__`` never restores it).
- ``Pruning`` prepares a model only while a :class:`PruningContext` (which restores it)
  enters: a ``CompositeHookingContextFactory`` subclass must use it as its
  ``_hooking_context_class``; with another class tdhook prunes for good, this raises
  ``RuntimeError``.
- A parameter tied between modules is scored once (under its first name), and a module
  named twice in ``modules_to_prune`` is pruned with both masks at once.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from types import TracebackType
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictModuleBase
from torch import nn

from tdhook_fn._params import params as params_of
from tdhook_fn.compat.contexts import HookingContext, HookingContextFactory
from tdhook_fn.compat.hooks import resolve_submodule_path
from tdhook_fn.compat.modules import HookedModule, RoutedModule
from tdhook_fn.weights import (
    apply_masks,
    default_skip,
    global_unstructured_masks,
    ln_structured_mask,
    pruning_scores,
)

__all__ = ["Pruning", "PruningContext"]

Keys = list[Any]
Saved = list[tuple[torch.Tensor, torch.Tensor]]  # (the model's parameter, its value before pruning)

# The list a PruningContext collects the pruned parameters' original values in while it enters.
_SAVING: ContextVar[Saved | None] = ContextVar("tdhook_fn_pruning_saved", default=None)
_ROOT_NAMES = ("", "td_module", "module")


def _restore(saved: Saved) -> None:
    """Write the remembered values back, newest first (a parameter pruned twice ends original)."""
    with torch.no_grad():
        for param, original in reversed(saved):
            param.copy_(original)


def _prune_in_place(targets: list[tuple[torch.Tensor, torch.Tensor]]) -> Saved:
    """Zero the masked entries of each parameter in place; return their previous values.

    Args:
        targets: ``(parameter, keep-mask)`` pairs; a parameter listed twice gets both masks.
    """
    merged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for param, keep in targets:
        previous = merged.get(id(param))
        merged[id(param)] = (param, keep if previous is None else previous[1] & keep)
    named = {str(i): pair for i, pair in enumerate(merged.values())}
    current = TensorDict({name: param.detach() for name, (param, _) in named.items()}, batch_size=[])
    masks = TensorDict({name: keep for name, (_, keep) in named.items()}, batch_size=[])
    pruned = apply_masks(current, masks)  # every new value first: a mismatched mask changes nothing
    saved: Saved = []
    with torch.no_grad():
        for name, (param, _) in named.items():
            saved.append((param, param.detach().clone()))
            param.copy_(pruned.get(name))
    return saved


class PruningContext(HookingContext):
    """A hooking context that restores the parameters its factory pruned.

    The model is pruned while the context enters (by :meth:`Pruning._prepare_module`) and
    restored when it exits, when the body raises, or when entering fails after pruning.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._saved: Saved = []

    def _enter(self, managed_by_context_manager: bool = True) -> HookedModule:
        saved: Saved = []
        token = _SAVING.set(saved)
        try:
            hooked = super()._enter(managed_by_context_manager=managed_by_context_manager)
        except BaseException:
            _restore(saved)
            raise
        finally:
            _SAVING.reset(token)
        self._saved = saved
        return hooked

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            super().__exit__(exc_type, exc_value, traceback)
        finally:
            saved, self._saved = self._saved, []
            _restore(saved)


class Pruning(HookingContextFactory):
    """Relevance-based pruning and circuit pruning, as tdhook's ``Pruning``.

    Args:
        importance_callback (Callable): ``importance_callback(module_key=...,
            parameter_name=..., parameter=...)`` gives the importance of one parameter
            (a tensor of its shape), or ``None`` to leave it alone. ``parameter`` is the
            model's own ``nn.Parameter`` (its ``.grad`` included); ``module_key`` is the
            submodule's name from the pruning root, or in structured mode the key of
            ``modules_to_prune``.
        amount_to_prune (float | int | None): global mode: the fraction (``round(amount *
            n)`` entries) or number of entries of lowest ``|importance|`` to zero across all
            scored parameters; structured mode: the amount for modules whose own is ``None``
            (or 0).
        modules_to_prune (dict | None): structured mode: ``{module_key: (dim, amount)}``;
            each scored parameter of that module loses the ``amount`` slices along ``dim``
            with the lowest L1 norm of importance.
        skip_modules (Callable | None): global mode: ``skip_modules(name, module)`` leaves a
            submodule's own parameters out. Default: none skipped (see :meth:`default_skip`).
        relative_path (str | None): path of the pruning root inside the model (for a
            TensorDictModule, inside it). Default: the model itself.

    Raises:
        ValueError: neither ``amount_to_prune`` nor ``modules_to_prune`` is given.

    >>> import torch
    >>> from tensordict import TensorDict
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> pruning = Pruning(lambda module_key, parameter_name, parameter: parameter.abs(), 0.5)
    >>> with pruning.prepare(net) as hooked:
    ...     zeros = sum(int((p == 0).sum()) for p in net.parameters())
    ...     out = hooked(TensorDict(input=torch.ones(1, 4), batch_size=[1]))["output"]
    >>> zeros, sum(int((p == 0).sum()) for p in net.parameters())
    (15, 0)
    """

    _hooking_context_class = PruningContext

    def __init__(
        self,
        importance_callback: Callable[..., Any],
        amount_to_prune: float | int | None = None,
        modules_to_prune: dict[str, tuple[int, float | int | None]] | None = None,
        skip_modules: Callable[[str, nn.Module], bool] | None = None,
        relative_path: str | None = None,
    ) -> None:
        if amount_to_prune is None and modules_to_prune is None:
            raise ValueError("`amount_to_prune` is required for global pruning")
        super().__init__()
        self._importance_callback = importance_callback
        self._amount_to_prune = amount_to_prune
        self._modules_to_prune = modules_to_prune
        self._skip_modules = skip_modules
        self._relative_path = relative_path or ""

    def _prepare_module(
        self, module: TensorDictModuleBase, in_keys: Keys, out_keys: Keys, extra_relative_path: str
    ) -> TensorDictModuleBase:
        """Prune the model in place (see NOTE [pruning in place]) and return ``module``.

        Raises:
            RuntimeError: not called while a :class:`PruningContext` enters.
        """
        saved = _SAVING.get()
        if saved is None:
            raise RuntimeError(
                "Pruning prunes the model in place and only its own PruningContext restores it: "
                "use Pruning(...).prepare(model), or a composite factory with "
                "_hooking_context_class = PruningContext"
            )
        if isinstance(module, RoutedModule):
            model = module.model
        else:  # a module handed over by a pre-factory
            model = resolve_submodule_path(module, extra_relative_path)
        root = resolve_submodule_path(model, self._relative_path)
        if not isinstance(root, nn.Module):
            raise ValueError(f"Pruning: relative_path {self._relative_path!r} names a {type(root).__name__}")
        targets = self._global_targets(root) if self._modules_to_prune is None else self._structured_targets(root)
        saved.extend(_prune_in_place(targets))
        return module

    def _global_targets(self, root: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
        live = params_of(root, detach=False)  # the model's own Parameters: callbacks may read .grad
        scores = pruning_scores(root, live, self._importance_callback, skip=self._skip_modules or None)
        assert self._amount_to_prune is not None  # checked in __init__
        masks = global_unstructured_masks(scores, self._amount_to_prune)
        return [(live.get(key), masks.get(key)) for key in masks.keys(True, True)]

    def _structured_targets(self, root: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
        assert self._modules_to_prune is not None
        scored: list[tuple[str, str, torch.Tensor, int, Any, Any]] = []
        for module_key, (dim, amount) in self._modules_to_prune.items():
            submodule = resolve_submodule_path(root, module_key)
            if not isinstance(submodule, nn.Module):
                raise ValueError(f"Pruning: {module_key!r} names a {type(submodule).__name__}, not a module")
            for param_name, parameter in submodule.named_parameters(recurse=False):
                score = self._importance_callback(module_key=module_key, parameter_name=param_name, parameter=parameter)
                if score is not None:  # tdhook: a falsy amount falls back to the global one
                    scored.append((module_key, param_name, parameter, dim, amount or self._amount_to_prune, score))
        targets: list[tuple[torch.Tensor, torch.Tensor]] = []
        for module_key, name, param, dim, amount, score in scored:
            try:
                keep = ln_structured_mask(score, amount, dim, n=1)
            except (TypeError, ValueError) as e:
                raise type(e)(f"Pruning: {module_key!r}, parameter {name!r}: {e}") from e
            assert isinstance(keep, torch.Tensor)
            targets.append((param, keep))
        return targets

    @staticmethod
    def default_skip(name: str, module: nn.Module) -> bool:
        """tdhook's skip rule: the roots (``""``, ``"td_module"``, ``"module"``) and containers.

        Containers are ``ModuleList``, ``Sequential`` and ``TensorDictModule``, as in tdhook;
        :func:`tdhook_fn.weights.default_skip` lists ``ModuleDict`` instead. None of them
        has parameters of its own, so both rules prune the same parameters.
        """
        if isinstance(module, nn.ModuleDict):
            return name in _ROOT_NAMES
        return isinstance(module, TensorDictModule) or default_skip(name, module)
