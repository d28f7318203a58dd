"""Params transforms: routed calls with other weights, the model untouched.

# NOTE [params transforms]
A method that runs the model with other weights (pruning masks, for instance) must not
write them into the model: other threads, and pure calls with params that share the
model's storage, would see them. It gives the hooked module's calls other params
instead: a *params transform* ``transform(model, params) -> params`` receives the routed
model and the params it would run with (its live tensors, or the previous transform's
result) and returns the ones to use, same keys. ``RoutedModule.with_params_transform``
attaches one to a prepared module; :func:`transforming_params` activates one for every
routed call in this thread while it is open (for a method that wraps a module that is
not a RoutedModule, such as a pre-factory's hooked module). Routed calls apply the active
transforms, outer ones first; a call without any runs exactly as before.

A transformed call still runs with the model's live tensors (the core's ``params=None``,
NOTE [live parameters]), and only the tensors a transform *replaced* are put in the call's
private shadow, by a custom tap (:class:`SlotTap`) that sets the shadow's slots before the
forward. So buffers stay live, as in a plain forward (BatchNorm in training mode updates
the model's running statistics; the core would copy buffers given as params), and the
model's own slots are never written. Transforms should keep gradients flowing to the live
tensors, so ``.backward()`` still fills ``model.weight.grad``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from tensordict import TensorDictBase
from torch import nn
from torch.utils.hooks import RemovableHandle

from tdhook_fn._params import leaves
from tdhook_fn._taps import Captured, Tap

from ._virtual import module_paths

__all__ = ["ParamsTransform", "SlotTap", "active_transforms", "slot_taps", "transforming_params"]

ParamsTransform = Callable[[nn.Module, TensorDictBase], TensorDictBase]
Slot = tuple[str, str, torch.Tensor, str]  # ("_parameters" or "_buffers", name, the value to put there, its key)

# The transforms active in this thread, outermost first.
_TRANSFORMS: ContextVar[tuple[ParamsTransform, ...]] = ContextVar("tdhook_fn_params_transforms", default=())


@contextmanager
def transforming_params(*transforms: ParamsTransform) -> Iterator[None]:
    """Apply ``transforms`` to the params of every routed call in this thread until exit.

    See NOTE [params transforms]. Context variables are per thread (and asyncio task):
    other threads' calls are not affected.
    """
    token = _TRANSFORMS.set((*_TRANSFORMS.get(), *transforms))
    try:
        yield
    finally:
        _TRANSFORMS.reset(token)


def active_transforms() -> tuple[ParamsTransform, ...]:
    """The transforms :func:`transforming_params` made active in this thread, outermost first."""
    return _TRANSFORMS.get()


class _Restore:
    """Puts the shadow's previous slot values back when the call ends."""

    def __init__(self, previous: list[tuple[dict[str, Any], str, Any]]) -> None:
        self._previous = previous

    def remove(self) -> None:
        for slots, name, value in reversed(self._previous):
            slots[name] = value
        self._previous = []


@dataclass(frozen=True)
class SlotTap(Tap):
    """A custom tap putting other tensors in a shadow submodule's parameter or buffer slots.

    Attributes:
        slots (tuple): ``(kind, name, value, key)``: ``value`` replaces the shadow's
            ``kind[name]`` (``kind`` is ``"_parameters"`` or ``"_buffers"``) for the call;
            ``key`` names it in errors.
    """

    slots: tuple[Slot, ...] = field(default=(), compare=False, repr=False)

    def attach(self, module: nn.Module, captured: Captured) -> RemovableHandle:
        previous: list[tuple[dict[str, Any], str, Any]] = []
        for kind, name, value, key in self.slots:
            slots: dict[str, Any] = module.__dict__[kind]
            current = slots[name]
            if current is not None and tuple(current.shape) != tuple(value.shape):
                _Restore(previous).remove()
                raise ValueError(
                    f"params transform: {key!r} has shape {tuple(value.shape)}, the model has {tuple(current.shape)}"
                )
            previous.append((slots, name, current))
            slots[name] = value
        return cast(RemovableHandle, _Restore(previous))


def slot_taps(root: nn.Module, live: TensorDictBase, transformed: TensorDictBase) -> tuple[SlotTap, ...]:
    """Taps putting the tensors ``transformed`` replaced (by identity) in ``root``'s shadow.

    Args:
        root (nn.Module): the module the call runs (its shadow gets the taps).
        live (TensorDict): the live params the transforms started from.
        transformed (TensorDict): their result, keyed like ``live``.

    Raises:
        ValueError: ``transformed`` lacks or adds keys (they are named).
    """
    before, after = leaves(live), leaves(transformed)
    if before.keys() != after.keys():
        missing = sorted(".".join(k) for k in before.keys() - after.keys())
        extra = sorted(".".join(k) for k in after.keys() - before.keys())
        raise ValueError(f"a params transform must keep the keys: missing {missing}, unexpected {extra}")
    replaced = {id(before[k]): (value, ".".join(k)) for k, value in after.items() if value is not before[k]}
    if not replaced:
        return ()
    paths = module_paths(root)
    taps = []
    for module in root.modules():
        slots = [
            (kind, name, *replaced[id(tensor)])
            for kind in ("_parameters", "_buffers")
            for name, tensor in module.__dict__[kind].items()
            if tensor is not None and id(tensor) in replaced
        ]
        if slots:
            taps.append(SlotTap(paths[id(module)], "custom", slots=tuple(slots)))
    return tuple(taps)
