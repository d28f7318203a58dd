"""Params transforms: routed calls with other weights, the model untouched."""

# NOTE [params transforms]
# A method that runs the model with other weights (pruning masks, for instance) must not
# write them into the model: other threads, and pure calls with params that share the
# model's storage, would see them. It gives the hooked module's calls other params
# instead: a *params transform* ``transform(model, params) -> params`` receives the routed
# model and the params it would run with (its live tensors, or the previous transform's
# result) and returns the ones to use, same keys. ``RoutedModule.with_params_transform``
# attaches one to a prepared module; `transforming_params` activates one for every
# routed call in this thread while it is open (for a method that wraps a module that is
# not a RoutedModule, such as a pre-factory's hooked module). Routed calls apply the active
# transforms, outer ones first; a call without any runs exactly as before.
#
# A transformed call still runs with the model's live tensors (the core's ``params=None``,
# NOTE [live parameters]), and only the tensors a transform *replaced* are put in the call's
# private shadow, as the core's ``overrides``. So buffers stay live, as in a plain forward
# (BatchNorm in training mode updates the model's running statistics; the core would copy
# buffers given as params), and the model's own slots are never written. Transforms should
# keep gradients flowing to the live tensors, so ``.backward()`` still fills
# ``model.weight.grad``.

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from tensordict import TensorDictBase
from torch import nn

from tdhook_fn._params import leaves

__all__ = ["ParamsTransform", "active_transforms", "replaced", "transforming_params"]

ParamsTransform = Callable[[nn.Module, TensorDictBase], TensorDictBase]

# The transforms active in this thread, outermost first.
_TRANSFORMS: ContextVar[tuple[ParamsTransform, ...]] = ContextVar("tdhook_fn_params_transforms", default=())


@contextmanager
def transforming_params(*transforms: ParamsTransform) -> Iterator[None]:
    """Apply ``transforms`` to the params of every routed call in this thread until exit.

    Context variables are per thread (and asyncio task):
    other threads' calls are not affected.
    """
    token = _TRANSFORMS.set((*_TRANSFORMS.get(), *transforms))
    try:
        yield
    finally:
        _TRANSFORMS.reset(token)


def active_transforms() -> tuple[ParamsTransform, ...]:
    """The transforms `transforming_params` made active in this thread, outermost first."""
    return _TRANSFORMS.get()


def replaced(live: TensorDictBase, transformed: TensorDictBase,
             prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], torch.Tensor]:
    """The tensors ``transformed`` replaced (by identity), keyed for the core's ``overrides``.

    Args:
        live (TensorDict): the live params the transforms started from.
        transformed (TensorDict): their result, keyed like ``live``.
        prefix (tuple[str, ...]): the model's key inside the routed root.

    Raises:
        ValueError: ``transformed`` lacks or adds keys (they are named).
    """
    before, after = leaves(live), leaves(transformed)
    if before.keys() != after.keys():
        missing = sorted(".".join(k) for k in before.keys() - after.keys())
        extra = sorted(".".join(k) for k in after.keys() - before.keys())
        raise ValueError(f"a params transform must keep the keys: missing {missing}, unexpected {extra}")
    return {(*prefix, *k): value for k, value in after.items() if value is not before[k]}
