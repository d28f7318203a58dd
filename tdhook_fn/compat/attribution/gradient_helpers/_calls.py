"""One call of a prepared attribution module, phrased in the terms of the pure methods."""

# NOTE [tdhook's targets, pure]
# tdhook hands ``init_attr_targets(targets, additional)`` the model outputs (``use_outputs``)
# and the ``target_modules`` activations keyed by path; the pure methods give their target
# callable the outputs and the ``target_layers`` activations under their path, from which
# `make_target` rebuilds tdhook's call. Two details keep user callables seeing what tdhook
# shows them:
#
# - Layout. tdhook's integrated gradients put the path points on a *trailing* batch dim
#   (``[*B, n]``); the pure method puts them first (``[n, *B]``, or ``[n * N]`` for the two
#   ends of the convergence delta). With ``stepped`` the callables get ``[*B, n]``.
# - Convergence delta. tdhook evaluates ``init_attr_targets`` on the plain model outputs at
#   the baselines and the inputs, so a target TensorDict holding no target-layer key takes
#   the outputs, which is what the pure method's delta offers without target layers.

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torch.utils.hooks import RemovableHandle

from tdhook_fn import Functional, Tap, capture
from tdhook_fn._functional import with_copied_inputs
from tdhook_fn.compat.hooks import HookFactory
from tdhook_fn.compat.hooks._caching import cacheable

__all__ = [
    "AttributionCall",
    "CachedOutput",
    "GradFn",
    "UserFn",
    "activations",
    "grad_output_fn",
    "make_cotangents",
    "make_target",
    "returned_td",
]

UserFn = Callable[[TensorDict, TensorDict], TensorDict]
TdFn = Callable[[TensorDictBase], TensorDictBase]
GradFn = Callable[[torch.Tensor], torch.Tensor]
_CACHE_IN = "_tdhook_fn_cache_in_"


@dataclass(frozen=True)
class AttributionCall:
    """What one call of a prepared module passes to a pure method: ``f`` with the hooked module's
    active virtual hooks, detached ``params``, the ``in_keys`` and ``additional_init_keys`` entries
    (``[*B]``), the pure methods' options, ``output_grad_callbacks`` as gradient maps (``grad_fns``)
    and extra ``taps`` (``cache_callback`` captures)."""

    f: Functional
    params: TensorDictBase
    inputs: TensorDictBase
    input_keys: tuple[Any, ...]
    use_inputs: bool
    layers: tuple[str, ...]
    target_layers: tuple[str, ...]
    target: TdFn
    cotangents: TdFn | None
    grad_fns: Mapping[str, GradFn]
    taps: tuple[Tap, ...]

    def options(self) -> dict[str, Any]:
        """Keyword arguments every pure method takes."""
        return {
            "target": self.target,
            "target_layers": self.target_layers,
            "grad_fns": None,
            "taps": self.all_taps() if self.grad_fns else self.taps,
            "cotangents": self.cotangents,
        }

    def all_taps(self) -> tuple[Tap, ...]:
        """The gradient maps, then the other taps. A map at a module the forward never runs does
        nothing, as tdhook's callback never fires (the pure ``grad_fns`` refuse such a module)."""
        return (*(Tap(path, "map_grad", fn, "output") for path, fn in self.grad_fns.items()), *self.taps)


def returned_td(name: str, result: Any) -> TensorDictBase:
    """``result`` of the user's ``name`` callable, which must be a TensorDict (tdhook's ValueError)."""
    if not isinstance(result, TensorDictBase):
        raise ValueError(f"{name} function must return a TensorDict")
    return result


def rebatch(td: TensorDictBase, source: int, dest: int) -> TensorDict:
    """Move batch dim ``source`` of every leaf to ``dest``; the batch size is read from the leaves
    (a user function's TensorDict may have none)."""
    leaves = list(td.items(True, True))
    if not leaves:
        return TensorDict({}, batch_size=[])
    dims = max(source, dest) + 1
    shape = list(leaves[0][1].shape[:dims])
    shape.insert(dest, shape.pop(source))
    out = TensorDict({}, batch_size=shape)
    for key, value in leaves:
        out.set(key, value.movedim(source, dest))
    return out


# NOTE [moved steps]
# The path-point dim is moved twice on every call of a stepped method: a TensorDict of tensors
# leaf by leaf into one new TensorDict (no Python call per leaf, no ``apply``), other contents
# by ``apply``, a user's TensorDict without its batch size by `rebatch`, with the same result.


def _moved(td: TensorDictBase, source: int, dest: int, size: torch.Size, split: tuple[int, ...] = ()) -> TensorDict:
    """``td``'s batch (first reshaped to ``split``, if given) with dim ``source`` moved to ``dest``, then
    reshaped to ``size`` (NOTE [moved steps])."""
    leaves: dict[Any, torch.Tensor] = {}
    for key, value in td.items():
        if not isinstance(value, torch.Tensor):
            td = td.reshape(split) if split else td
            dims = list(td.batch_size)
            dims.insert(dest, dims.pop(source))
            applied = td.apply(partial(torch.movedim, source=source, destination=dest), batch_size=dims)
            assert applied is not None  # (None only in place)
            return applied.reshape(size)
        value = value.reshape(*split, *value.shape[td.batch_dims:]) if split else value
        moved = value.movedim(source, dest)  # (reshaped only when it must be: a view is one more autograd node)
        leaves[key] = moved if moved.shape[:len(size)] == size else moved.reshape(
            *size, *value.shape[len(split) or td.batch_dims:])
    return TensorDict(leaves, batch_size=size, device=td.device)


def steps_last(td: TensorDictBase, batch: torch.Size) -> TensorDictBase:
    """The method's ``[n, *B]`` (or ``[n * N]``) as tdhook's ``[*B, n]``."""
    size = td.batch_size
    split = () if size[1:] == batch else (size.numel() // max(batch.numel(), 1), *batch)
    return _moved(td, 0, len(batch), torch.Size((*batch, (split or size)[0])), split)


def steps_first(td: TensorDictBase, batch: torch.Size, like: torch.Size) -> TensorDictBase:
    """tdhook's ``[*B, n]`` back to the method's batch ``like``."""
    n, size = len(batch), td.batch_size
    if len(size) > n:
        return _moved(td, n, 0, like)
    out = rebatch(td, n, 0)  # a user's TensorDict made without its batch size: read it from the leaves
    return out if out.batch_size == like else out.reshape(like)


def make_target(
    out_keys: Sequence[Any],
    target_modules: Sequence[str],
    use_outputs: bool,
    init_attr_targets: UserFn | None,
    additional: TensorDict,
    stepped: bool,
    renamed: Mapping[str, str] | None = None,
) -> TdFn:
    """tdhook's target construction as a target callable (NOTE [tdhook's targets, pure]).

    ``additional`` holds the caller's ``additional_init_keys`` entries; ``stepped``: the method puts
    path points on a leading batch dim; ``renamed``: private capture key -> path (``cache_callback``).
    """
    batch = additional.batch_size

    def target(seen: TensorDictBase) -> TensorDictBase:
        like = seen.batch_size
        if stepped:
            seen = steps_last(seen, batch)
        if renamed:
            seen = seen.copy()
            for private, path in renamed.items():
                if private in seen.keys():
                    seen.set(path, seen.get(private))
        keys = list(out_keys) if use_outputs else []
        present = False
        for path in target_modules:  # (a loop: no call when there are none)
            if path in seen.keys():
                keys.append(path)
                present = True
        targets = seen.select(*(keys if present or use_outputs else out_keys))
        if init_attr_targets is not None:
            targets = init_attr_targets(targets, additional)
            if not isinstance(targets, TensorDictBase):
                returned_td("init_attr_targets", targets)  # raises
        return steps_first(targets, batch, like) if stepped else targets

    return target


def make_cotangents(init_attr_grads: UserFn, additional: TensorDict, stepped: bool) -> TdFn:
    """tdhook's ``init_attr_grads`` as the pure methods' ``cotangents``, with tdhook's checks."""
    batch = additional.batch_size

    def cotangents(values: TensorDictBase) -> TensorDictBase:
        targets = steps_last(values, batch) if stepped else values
        grads = returned_td("init_attr_grads", init_attr_grads(targets, additional))
        if grads.batch_size != targets.batch_size:
            raise ValueError("init_grads should have the same batch size as targets")
        if set(grads.keys(True, True)) != set(targets.keys(True, True)):
            raise ValueError("Targets and init_grads must have the same keys")
        return steps_first(grads, batch, values.batch_size) if stepped else grads

    return cotangents


def activations(f: Functional, params: TensorDictBase, inputs: TensorDictBase, paths: Sequence[str]) -> TensorDict:
    """Activations at ``paths`` (keyed by path) for ``inputs`` with the batch flattened, no grad."""
    flat = with_copied_inputs(inputs.reshape(-1))  # (a forward may write its inputs in place)
    probe = f.with_taps(*(capture(path, key=f"{_CACHE_IN}{i}") for i, path in enumerate(paths)))
    with torch.no_grad():
        out = probe(params, flat)
    result = TensorDict({}, batch_size=flat.batch_size)
    for i, path in enumerate(paths):
        result.set(path, out.get(f"{_CACHE_IN}{i}"))
    return result


def grad_output_fn(callback: Callable[..., Any], submodule: nn.Module) -> GradFn:
    """An ``output_grad_callbacks`` entry as a gradient map (`tdhook_fn.map_grad`), the callback
    called as tdhook's ``set_grad_output`` hook calls it on ``submodule``."""
    hook = HookFactory.make_setting_hook(None, callback=callback, direction="bwd_pre")

    def fn(grad: torch.Tensor) -> torch.Tensor:
        new = hook(submodule, (grad,))
        return grad if new is None else new[0]

    return fn


@dataclass(frozen=True)
class CachedOutput(Tap):
    """A custom tap storing ``cache_callback``'s result for the user's submodule ``target`` under ``key``,
    the callback called as tdhook's caching hook calls it."""

    target: Any = field(default=None, compare=False, repr=False)

    def attach(self, module: nn.Module, captured: dict[str, Any]) -> RemovableHandle:
        callback: Callable[..., Any] | None = self.fn
        original, key, path = self.target, self.key, self.path
        assert callback is not None

        def hook(_shadow: nn.Module, args: Any, output: Any) -> None:
            value = callback(module=original, args=args, output=output, key=("_cache_out", path), direction="fwd")
            captured[key] = cacheable(value, "cache_callback")

        return module.register_forward_hook(hook)
