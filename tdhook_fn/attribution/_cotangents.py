"""What a pullback is fed at the target values (ones, one one-hot per target, or the caller's cotangents), and the
pullbacks run with it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from .._functional import fresh_tensordict
from .._params import leaves

__all__ = ["Cotangents", "Guide", "Pass", "check_per_target_or_cotangents", "pull_each", "pull_passes", "pull_vmapped",
           "seed_cotangents"]

Cotangents = Callable[[TensorDictBase], TensorDictBase]


@dataclass(frozen=True)
class Pass:
    """One pullback of `gradients`' ``passes`` (NOTE [attribution engine]).

    Attributes:
        keys (tuple): the input keys and layer paths whose gradients this pass gives.
        before (Callable | None): run before the pass (a rule switching its backward for it).
            Default: ``None``.
    """

    keys: tuple[Any, ...]
    before: Callable[[], object] | None = None


class Guide:
    """Whether one call's guided taps rectify the gradient, switched between the pullbacks of one forward.

    Attributes:
        on (bool): ``relu`` of the gradient (guided backprop), else the gradient as it is.
    """

    __slots__ = ("on",)

    def __init__(self, on: bool = True) -> None:
        self.on = on

    def setter(self, on: bool) -> Callable[[], None]:
        """What switches the guide to ``on`` (a pass's ``before``)."""
        def switch() -> None:
            self.on = on

        return switch


def check_per_target_or_cotangents(caller: str, per_target: bool, cotangents: Cotangents | None) -> None:
    """``per_target`` and ``cotangents`` both say what is put in at the targets: one of them."""
    if per_target and cotangents is not None:
        raise ValueError(f"{caller}: per_target and cotangents exclude each other (cotangents say what is put in at "
                         "the targets, per_target puts in one one-hot per target); give one of them")


def seed_cotangents(values: TensorDictBase, per_target: bool, cotangents: Cotangents | None,
                    ) -> tuple[TensorDictBase, int]:
    """What is put in at the target values, and its number of leading (target) dims.

    ``cotangents(values)``; or one-hots ``[T, *B, T]`` with ``per_target``; or ones.
    """
    if cotangents is not None:
        cot = cotangents(values)
        if not isinstance(cot, TensorDictBase):
            raise TypeError(f"cotangents must return a TensorDict, got {type(cot).__name__}")
        return cot, 0
    if per_target:
        return _one_hots(values), 1
    return _ones_like(values), 0


def _ones_like(values: TensorDictBase) -> TensorDictBase:
    """``values.apply(torch.ones_like)``, built directly for a plain TensorDict (``apply`` costs more)."""
    if type(values) is not TensorDict:
        return cast(TensorDictBase, values.apply(torch.ones_like))
    ones: dict[Any, Any] = {}
    for name, value in values.__dict__["_tensordict"].items():  # its own entries, read as `leaves` reads them
        if type(value) is not torch.Tensor:  # a nested TensorDict (or a tensor subclass): by key, levels made by set
            out = values.empty(recurse=True)
            for key, leaf in leaves(values).items():
                out.set(key, torch.ones_like(leaf))
            return out
        ones[name] = torch.ones_like(value)
    return fresh_tensordict(ones, values.batch_size, values.device)  # (shaped as the values)


def _one_hots(values: TensorDictBase) -> TensorDictBase:
    """Cotangents ``[T, *B, T]``: target ``t`` selected by a one-hot on the last dim."""
    batch = values.batch_size
    for key, v in values.items(True, True):
        if v.dim() > len(batch) + 1:
            raise ValueError(f"per_target needs target values shaped [*batch] or [*batch, T]; target {key!r} has shape "
                             f"{tuple(v.shape)} for batch {list(batch)}: flatten its target dims in the target")
    sizes = {v.shape[len(batch)] if v.dim() > len(batch) else 1 for v in values.values(True, True)}
    if len(sizes) != 1:
        raise ValueError(f"per_target needs the same number of targets in every target key, got {sizes}")
    (n,) = sizes

    def one_hot(v: torch.Tensor) -> torch.Tensor:
        eye = torch.eye(n, dtype=v.dtype, device=v.device)
        if v.dim() == len(batch):  # one target per sample: T = 1
            return torch.ones_like(v).unsqueeze(0)
        return eye.reshape(n, *([1] * len(batch)), n).expand(n, *v.shape)

    return cast(TensorDictBase, values.apply(one_hot, batch_size=[n, *batch]))


def pull_each(pullback: Callable[..., Any], cot: TensorDictBase, *, retain_graph: bool = False,
              wanted: Sequence[int] | None = None) -> Any:
    """The pullback of every cotangent along ``cot``'s first dim, stacked (NOTE [attribution engine]).

    ``retain_graph``: the graph is kept after the last (another pass follows); ``wanted``: the positions of the
    primals whose gradients are needed (the others come back ``None``), as the pullback takes them.
    """
    leaf = next(iter(cot.values(True, True)))
    if isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu":
        return pull_vmapped(pullback, cot, wanted)
    last = cot.batch_size[0] - 1
    # (the last frees the graph, unless another pass follows)
    pulled = [pullback(cot[t], retain_graph=retain_graph or t < last, wanted=wanted)[0] for t in range(last + 1)]
    return [None if pulled[0][i] is None else torch.stack([p[i] for p in pulled])  # (the primals are a flat list)
            for i in range(len(pulled[0]))]


def pull_vmapped(pullback: Callable[..., Any], cot: TensorDictBase, wanted: Sequence[int] | None = None) -> Any:
    """`pull_each` on accelerators: the pullback ``vmap``-ed over ``cot``'s first dim (NOTE [attribution engine])."""
    if wanted is None:
        return torch.func.vmap(pullback)(cot)[0]
    chosen = list(wanted)  # (vmap returns tensors only: the wanted ones, put back in place after)
    some = torch.func.vmap(lambda c: [pullback(c, wanted=chosen)[0][i] for i in chosen])(cot)
    out: list[Any] = [None] * (max(chosen) + 1)
    for i, g in zip(chosen, some, strict=True):
        out[i] = g
    return out


def pull_passes(pullback: Callable[..., Any], cot: TensorDictBase, lead: int, passes: Sequence[Pass],
                 names: tuple[Any, ...]) -> list[Any]:
    """Each pass's keys' gradients, from its own pullback of ``cot``; ``names``: the primals' keys, in order.

    See NOTE [attribution engine].
    """
    index = {name: i for i, name in enumerate(names)}
    pulled: list[Any] = [None] * len(names)
    for n, step in enumerate(passes):
        unknown = [key for key in step.keys if key not in index]
        if unknown or not step.keys:
            raise ValueError(f"gradients: pass {n} names {list(step.keys)}; each pass takes some of the attributed "
                             f"input keys and layers {list(names)}")
        wanted = [index[key] for key in step.keys]
        if step.before is not None:
            step.before()
        kept = n < len(passes) - 1  # (the graph freed by the last)
        grads = (pull_each(pullback, cot, retain_graph=kept, wanted=wanted) if lead
                 else pullback(cot, retain_graph=kept, wanted=wanted)[0])
        for i in wanted:
            pulled[i] = grads[i]
    missing = [name for name, grad in zip(names, pulled, strict=True) if grad is None]
    if missing:
        raise ValueError(f"gradients: no pass gives the gradients of {missing}; name each attributed input key and "
                         "layer in a pass")
    return pulled
