"""What a call reads of a model's state: its parameters and buffers as one nested TensorDict, and whether its
modes suit an attribution (`check_attribution_modes`)."""

# NOTE [training mode in attributions]
# `tdhook_fn.call` runs a model in whatever mode it is in (its buffers are private
# copies for the call, NOTE [pure buffers]). An attribution is
# different: its forward sees a batch the user never built (integrated gradients pushes
# ``n_steps`` path points through at once, ``per_target`` and ``vmap`` reshape it), so
#
# - a batch norm in training mode (or without running statistics) normalises with the
#   statistics of that batch (of the path points, for integrated gradients): the number is
#   wrong, so the methods raise and say to call ``model.eval()``;
# - dropout in training mode makes two identical calls differ: the methods warn, once per
#   module.

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator
from typing import Any, Literal

import torch
from tensordict import TensorDict, TensorDictBase, is_non_tensor
from torch import nn

__all__ = ["Key", "check_attribution_modes", "leaf_keys", "leaf_values", "leaves", "params"]

Key = tuple[str, ...]


def params(model: nn.Module, *, detach: bool = True) -> TensorDict:
    """The parameters and buffers of ``model``, nested like its module tree.

    Parameters are detached and share storage with the model (no copy; do not modify
    them in place). Buffers are cloned, because modules in training mode update some
    buffers in place (BatchNorm running statistics) and that must not reach the model.
    Tied parameters appear once, under their first name, as in ``named_parameters``.

    Args:
        model (nn.Module): any module.
        detach (bool): ``False`` gives the model's own tensors instead, live: gradients
            reach ``model.weight.grad`` and in-place buffer updates reach the model (what
            the compat layer needs to behave as a plain forward). Default: ``True``.

    Returns:
        TensorDict: batch size ``[]``; ``params(model)["0", "weight"]`` is the weight of
        submodule ``"0"``. ``torch.stack`` several of them to get a batch ``[K]`` to
        ``vmap`` over.

    Examples:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
        >>> sorted(params(net).keys(include_nested=True, leaves_only=True))[:2]
        [('0', 'bias'), ('0', 'weight')]
    """
    td = TensorDict({}, batch_size=[])
    for name, p in model.named_parameters():
        td.set(tuple(name.split(".")), p.detach() if detach else p)
    for name, b in model.named_buffers():
        td.set(tuple(name.split(".")), b.detach().clone() if detach else b)
    return td


def leaves(params: TensorDictBase) -> dict[Key, Any]:
    """The leaf tensors of a params TensorDict by key tuple."""
    # Depth first with a stack of iterators, not by recursion (a Python call per TensorDict), and each level's
    # entries read in the loop (a plain TensorDict's dict directly: ``items(True, True)`` costs twice as much;
    # any other TensorDict's leaves under their nested keys): this runs on every call.
    out: dict[Key, Any] = {}
    stack: list[tuple[Key, Iterator[tuple[Any, Any]]]] = []
    td: TensorDictBase | None = params
    prefix: Key = ()
    while td is not None:  # (a TensorDict whose entries are to read: the params, then each nested one met)
        own = td.__dict__.get("_tensordict") if type(td) is TensorDict else None
        stack.append((prefix, iter(own.items()) if isinstance(own, dict) else iter(td.items(True, True))))
        td = None
        while stack and td is None:
            prefix, items = stack[-1]
            for key, value in items:
                if type(value) is torch.Tensor and type(key) is str:  # (the common leaf: two identity tests)
                    out[(*prefix, key)] = value
                elif isinstance(key, tuple):  # (a leaf of a TensorDict that is not a plain one, under its nested key)
                    out[(*prefix, *key)] = value
                elif type(value) is TensorDict or (not isinstance(value, torch.Tensor) and isinstance(
                        value, TensorDictBase) and not is_non_tensor(value)):  # (a plain nested one: never non-tensor)
                    td, prefix = value, (*prefix, key)  # its entries next, then the rest of this level's
                    break
                else:
                    out[(*prefix, key)] = value
            else:
                stack.pop()
    return out


def leaf_keys(td: TensorDictBase) -> list[str | Key]:
    """``list(td.keys(True, True))`` (a one-part key as its str), from `leaves`: a seventh of the calls."""
    keys: list[str | Key] = []
    for key, value in leaves(td).items():  # (a loop, not a comprehension: one Python call less, on every call)
        if isinstance(value, torch.Tensor):
            keys.append(key[0] if len(key) == 1 else key)
    return keys


def leaf_values(td: TensorDictBase) -> list[Any]:
    """The leaf values of a TensorDict, in `leaves` order, without building their keys (cheaper, on every call)."""
    out: list[Any] = []
    stack: list[Iterator[Any]] = []
    level: TensorDictBase | None = td
    while level is not None:  # depth first, as `leaves`: a loop, not recursion, each level read in it
        own = level.__dict__.get("_tensordict") if type(level) is TensorDict else None
        stack.append(iter(own.values()) if isinstance(own, dict) else iter(level.values(True, True)))
        level = None
        while stack and level is None:
            for value in stack[-1]:
                if type(value) is torch.Tensor:  # (the common leaf: one identity test)
                    out.append(value)
                elif type(value) is TensorDict or (not isinstance(value, torch.Tensor) and isinstance(
                        value, TensorDictBase) and not is_non_tensor(value)):
                    level = value  # (its values next, then the rest of this one's)
                    break
                else:
                    out.append(value)
            else:
                stack.pop()
    return out


_warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def check_attribution_modes(model: nn.Module, caller: str, *, batch_norms: bool = True,
                            dropout: Literal["warn", "raise"] = "warn", why: str = "") -> None:
    """Raise for batch-dependent batch norms, warn once (or raise) for modules that draw at random.

    Args:
        batch_norms: refuse batch norms that use the batch's statistics (training mode,
            or ``track_running_stats=False``); off where the batch is the caller's own.
        dropout: ``"raise"`` where random draws cannot run (under ``vmap``); ``why`` says why.

    Raises:
        ValueError: such a batch norm, or dropout with ``dropout="raise"``; the message
            names the modules.
    """
    # One plain walk of the module tree with the tests inline, names built only for a module to report: this
    # runs on every call, and a call per module (or an any() of a generator: a call per step) costs more than it.
    batch_dependent: set[int] = set()
    drawing: list[nn.Module] = []
    stack, seen = [model], set()
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if batch_norms and isinstance(module, nn.modules.batchnorm._BatchNorm):
            if module.training or module.running_mean is None:  # normalises with the batch's statistics
                batch_dependent.add(id(module))
        elif module.training and (dropout == "raise" or module not in _warned):
            if isinstance(module, nn.modules.dropout._DropoutNd):
                draws = module.p > 0
            else:  # transformers' attention modules call functional dropout with a float attribute
                draws = False
                for k, v in vars(module).items():
                    if isinstance(v, float) and v > 0 and "dropout" in k and not k.startswith("_"):
                        draws = True
                        break
            if draws:
                drawing.append(module)
        for child in module._modules.values():
            if child is not None:
                stack.append(child)
    if batch_dependent:
        names = [name or "<root>" for name, module in model.named_modules() if id(module) in batch_dependent]
        raise ValueError(
            f"{caller}: modules {names} are batch norms that normalise with the statistics of the batch "
            "(training mode, or track_running_stats=False); the batch this method runs holds path points, runs or "
            "reshaped samples, so the result would be wrong. Call model.eval() first (with running statistics)"
        )
    if not drawing:
        return
    draw = set(map(id, drawing))
    stochastic = [name or "<root>" for name, module in model.named_modules() if id(module) in draw]
    if dropout == "raise":
        raise ValueError(f"{caller}: modules {stochastic} apply dropout in training mode{why}; call model.eval()")
    _warned.update(drawing)
    warnings.warn(
        f"{caller}: modules {stochastic} apply dropout in training mode, so two identical calls give different "
        "results; call model.eval() for deterministic results",
        RuntimeWarning,
        stacklevel=3,
    )
