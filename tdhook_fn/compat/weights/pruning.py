"""``Pruning`` with the public API of ``tdhook.weights.pruning`` (tdhook 0.1.3).

The model is never pruned: its parameters take the masked values as replacements in the hooked
module's calls (NOTE [one scope]). Differences from tdhook 0.1.3 are listed in ``docs/compat.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictModuleBase
from torch import nn

from tdhook_fn._params import params as params_of
from tdhook_fn._paths import PathError
from tdhook_fn._types import Replace
from tdhook_fn.compat.contexts import HookingContext, HookingContextFactory
from tdhook_fn.compat.hooks import merge_paths, resolve_submodule_path
from tdhook_fn.compat.modules import HookedModule, RoutedModule
from tdhook_fn.compat.modules._scope import Replacement
from tdhook_fn.compat.weights._running_weights import running_weights
from tdhook_fn.weights import (
    apply_masks,
    default_skip,
    global_unstructured_masks,
    ln_structured_mask,
    pruning_scores,
)

__all__ = ["Pruning", "PruningContext"]

Targets = list[tuple[torch.Tensor, torch.Tensor]]  # (the model's parameter, its keep-mask)
_ROOT_NAMES = ("", "td_module", "module")


class _PrunedValues(torch.autograd.Function):
    """``pruned`` forward; backward, the gradient goes unchanged to ``live`` (tdhook's ``.grad``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(live: torch.Tensor, pruned: torch.Tensor) -> torch.Tensor:
        return pruned.view_as(pruned)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        return None

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _walk_to_model(module: Any) -> str:
    """The path tdhook's walk takes from a hooked module it is handed to the TensorDictModule around the model:
    ``td_module`` for each hooked module on the way (``""``: not a hooked module)."""
    levels = []
    while isinstance(module, HookedModule):
        levels.append("td_module")
        module = getattr(module.hooking_context, "_module", None)
    return ".".join(levels)


def _within(prefix: str, path: str, argument: str) -> str:
    """``path``, a tdhook name from the hooked module, from the TensorDictModule ``prefix`` leads to.

    Raises:
        PathError: ``path`` names something outside the model.
    """
    if path == prefix or path.startswith(prefix + "."):
        return path[len(prefix) + 1:]
    raise PathError(f"Pruning over a hooked module: {argument} {path!r} does not start with {prefix!r}, the path "
                    "to the model there (as tdhook names it); compat prunes only the model's parameters")


def _named_from(prefix: str, importance: Callable[..., Any], skip: Callable[[str, nn.Module], bool] | None,
                ) -> tuple[Callable[..., Any], Callable[[str, nn.Module], bool] | None]:
    """``importance`` and ``skip`` receiving names from the hooked module, as tdhook's (``prefix`` + the name)."""
    def named(module_key: str, **rest: Any) -> Any:
        return importance(module_key=merge_paths(prefix, module_key), **rest)

    return named, (None if skip is None else lambda name, module: skip(merge_paths(prefix, name), module))


# (torch declares Function.apply untyped: its signature here, stated once)
_pruned_values: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _PrunedValues.apply


def _masking(param: torch.Tensor, keep: torch.Tensor) -> Replace:
    """The replacement of one parameter: its value at each call (never kept: a write through ``.data``
    moves no version counter), masked as `apply_masks` does (which checks the mask now, on entry),
    with an identity gradient to it."""
    apply_masks(TensorDict({"p": param.detach()}, batch_size=[]), TensorDict({"p": keep}, batch_size=[]))
    factor = keep.to(param.dtype)

    def pruned(value: torch.Tensor) -> torch.Tensor:
        masked = value.detach() * factor
        if torch.is_grad_enabled() and value.requires_grad:
            return _pruned_values(value, masked)
        return masked

    return pruned


class PruningContext(HookingContext):
    """The context of `Pruning`, as tdhook names it; it restores nothing because nothing is written."""


class Pruning(HookingContextFactory):
    """Relevance-based pruning and circuit pruning, as tdhook's ``Pruning``.

    Args:
        importance_callback (Callable): ``importance_callback(module_key=...,
            parameter_name=..., parameter=...)`` gives the importance of one parameter
            (a tensor of its shape), or ``None`` to leave it alone. ``parameter`` is the
            model's own ``nn.Parameter`` (its ``.grad`` included), or where the module runs
            another value (pruned, applied vectors), that value; ``module_key`` is the
            submodule's name from the pruning root, or in structured mode the key of
            ``modules_to_prune``.
        amount_to_prune (float | int | None): global mode: the ``amount`` of
            `tdhook_fn.weights.global_unstructured_masks`; structured mode: the amount for
            modules whose own is ``None`` (or 0).
        modules_to_prune (dict | None): structured mode: ``{module_key: (dim, amount)}``,
            masks of `tdhook_fn.weights.ln_structured_mask` (``n=1``) of the importance.
        skip_modules (Callable | None): global mode: ``skip_modules(name, module)`` leaves a
            submodule's own parameters out. Default: none skipped (see `default_skip`).
        relative_path (str | None): path of the pruning root inside the model (for a
            TensorDictModule, inside it). Default: the model itself.

    Raises:
        ValueError: neither ``amount_to_prune`` nor ``modules_to_prune`` is given.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> _ = torch.manual_seed(0)  # some draws leave every hidden unit dead: pruned and whole outputs agree
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> pruning = Pruning(lambda module_key, parameter_name, parameter: parameter.abs(), 0.5)
        >>> x = torch.ones(1, 4)
        >>> with pruning.prepare(net) as hooked:
        ...     pruned = hooked(TensorDict(input=x, batch_size=[1]))["output"]
        ...     zeros = sum(int((p == 0).sum()) for p in net.parameters())
        >>> zeros, torch.equal(pruned, net(x))
        (0, False)
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
        self, module: RoutedModule, in_keys: list[NestedKey], out_keys: list[NestedKey], extra_relative_path: str
    ) -> TensorDictModuleBase:
        """``module`` running with pruned parameters, masks computed now (replacements: NOTE [one scope])."""
        # tdhook walks the module it is handed: over another context's hooked module, names start there
        prefix = "" if extra_relative_path else _walk_to_model(module.runner)
        path, names_from = self._relative_path, ""
        if prefix and not path:
            names_from = prefix
        elif prefix:
            path = _within(prefix, path, "relative_path")
        root = resolve_submodule_path(module.model, path)
        if not isinstance(root, nn.Module):
            raise ValueError(f"Pruning: relative_path {self._relative_path!r} names a {type(root).__name__}")
        running = running_weights(module, root, detach=False)  # the scores' input: what the module runs
        targets = (self._global_targets(root, running, names_from) if self._modules_to_prune is None
                   else self._structured_targets(root, running, names_from))
        if names_from:  # (after the model's: tdhook's walk scores the hooked module's other parameters last)
            self._check_only_the_model_scored(module.runner)
        # (one replacement per target: a parameter listed twice gets both masks, one after the other)
        replacements: list[Replacement] = [(param, _masking(param, keep)) for param, keep in targets]
        return module.replacing(replacements)

    def _check_only_the_model_scored(self, hooked: Any) -> None:
        """Raise where tdhook would also prune a parameter the hooked module holds besides the model (an adapter's).

        Raises:
            NotImplementedError: naming the parameter.
        """
        if self._modules_to_prune is not None:
            return  # (keys outside the model do not resolve: PathError)
        for name, submodule in hooked.named_modules():
            if name.split(".")[0] == "td_module" or (self._skip_modules and self._skip_modules(name, submodule)):
                continue
            for param_name, param in submodule.named_parameters(recurse=False):
                if self._importance_callback(module_key=name, parameter_name=param_name, parameter=param) is not None:
                    raise NotImplementedError(
                        f"Pruning over {type(hooked).__name__}: tdhook also prunes {name}.{param_name}, which the "
                        "hooked module holds besides the model; compat prunes only the model's parameters. Skip it "
                        "(skip_modules, or None from importance_callback), or pass relative_path='td_module'")

    def _global_targets(self, root: nn.Module, running: TensorDictBase, names_from: str) -> Targets:
        live = params_of(root, detach=False)  # the model's own Parameters: the replacements' keys
        importance, skip = self._importance_callback, self._skip_modules or None
        if names_from:  # (tdhook's names, from the hooked module)
            importance, skip = _named_from(names_from, importance, skip)
        scores = pruning_scores(root, running, importance, skip=skip)
        assert self._amount_to_prune is not None  # checked in __init__
        masks = global_unstructured_masks(scores, self._amount_to_prune)
        return [(live.get(key), masks.get(key)) for key in masks.keys(True, True)]

    def _structured_targets(self, root: nn.Module, running: TensorDictBase, names_from: str) -> Targets:
        assert self._modules_to_prune is not None
        names = {id(module): name for name, module in root.named_modules()}
        scored = []  # every module's scores first, then the masks: as tdhook, each callback runs before any error
        for module_key, (dim, amount) in self._modules_to_prune.items():
            key = _within(names_from, module_key, "modules_to_prune key") if names_from else module_key
            submodule = resolve_submodule_path(root, key)
            if not isinstance(submodule, nn.Module):
                raise ValueError(f"Pruning: {module_key!r} names a {type(submodule).__name__}, not a module")
            live = params_of(submodule, detach=False)
            name = names.get(id(submodule))  # (None: a module reached from outside the root, scored as it is)
            values = live if name is None else running.get(tuple(name.split("."))) if name else running
            # (the module's own parameters only: every submodule below it is skipped)
            scores = pruning_scores(submodule, values, self._importance_at(module_key), skip=lambda name, _: name != "")
            scored.append((module_key, dim, amount, live, scores))
        targets: Targets = []
        for module_key, dim, amount, live, scores in scored:
            fraction: Any = amount or self._amount_to_prune  # tdhook: a falsy amount falls back to the global one
            for name, score in scores.items():
                try:
                    keep = ln_structured_mask(cast(torch.Tensor, score), fraction, dim, n=1)
                except (TypeError, ValueError) as e:
                    raise type(e)(f"Pruning: {module_key!r}, parameter {name!r}: {e}") from e
                targets.append((live.get(name), cast(torch.Tensor, keep)))
        return targets

    def _importance_at(self, module_key: str) -> Callable[..., Any]:
        """The importance callback as structured mode calls it: ``module_key`` is the key of ``modules_to_prune``."""
        return lambda parameter_name, parameter, **_: self._importance_callback(
            module_key=module_key, parameter_name=parameter_name, parameter=parameter)

    @staticmethod
    def default_skip(name: str, module: nn.Module) -> bool:
        """tdhook's skip rule: the roots (``""``, ``"td_module"``, ``"module"``) and ``ModuleList``,
        ``Sequential`` and ``TensorDictModule`` containers (parameter-free, as `tdhook_fn.weights.default_skip`'s)."""
        if isinstance(module, nn.ModuleDict):
            return name in _ROOT_NAMES
        return isinstance(module, TensorDictModule) or default_skip(name, module)
