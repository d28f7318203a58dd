"""Pullbacks of one forward taken more than once: one per target (`pull_each`, seeded by `one_hots`) and the
passes of `gradients` (`pull_passes`), each to its own keys after its own setup; see NOTE [attribution engine]."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from tensordict import TensorDictBase

__all__ = ["BackwardPass", "one_hots", "pull_each", "pull_passes", "pull_vmapped"]


@dataclass(frozen=True)
class BackwardPass:
    """One pullback of `gradients`' ``passes`` (NOTE [attribution engine]); not the LRP rule `Pass`.

    Attributes:
        keys (tuple): the input keys and layer paths whose gradients this pass gives.
        before (Callable | None): run before the pass (a rule switching its backward for it).
            Default: ``None``.
    """

    keys: tuple[Any, ...]
    before: Callable[[], object] | None = None


def one_hots(values: TensorDictBase) -> TensorDictBase:
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
        if v.dim() == len(batch):  # one target per sample: T = 1
            return torch.ones_like(v).unsqueeze(0)
        eye = torch.eye(n, dtype=v.dtype, device=v.device)
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


def pull_passes(pullback: Callable[..., Any], cot: TensorDictBase, lead: int, passes: Sequence[BackwardPass],
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
