"""Fused attention under a sweep's ``vmap``: the runs folded into the attention's batch."""

# NOTE [folded attention]
# torch has no ``vmap`` batching rule for its fused CPU attention kernels
# (``scaled_dot_product_attention`` of a Hugging Face model with ``sdpa`` attention, the
# default): under ``vmap`` it warns and runs the kernel once per run, a Python loop that
# made the sweep slower than a loop of patched forwards. `folded_attention` gives
# ``scaled_dot_product_attention`` a rule of its own while a sweep's runs are mapped: the
# runs' dim is moved in front and folded into the first batch dim (``[K, N, H, L, E]`` ->
# ``[K * N, H, L, E]``; a mask or a key batched over fewer dims is expanded to match), and
# the kernel runs once on the big batch. The numbers are the kernel's own on each sample,
# and its gradient is the kernel's (an `torch.autograd.Function` whose backward is
# the pullback of the kernel on the folded batch).

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["folded_attention"]

_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            options: dict[str, Any]) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **options)


class _Folded(torch.autograd.Function):
    """``scaled_dot_product_attention`` with a batching rule that folds the mapped dim into the batch."""

    generate_vmap_rule = False

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                options: dict[str, Any]) -> torch.Tensor:
        return _attend(q, k, v, mask, options)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        q, k, v, mask, options = inputs
        ctx.save_for_backward(q, k, v, mask)
        ctx.options = options

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, mask = ctx.saved_tensors
        float_mask = mask is not None and mask.is_floating_point()
        if float_mask:  # an additive mask may carry a gradient too
            pull = torch.func.vjp(lambda a, b, c, m: _attend(a, b, c, m, ctx.options), q, k, v, mask)[1]
            return (*pull(grad), None)
        pull = torch.func.vjp(lambda a, b, c: _attend(a, b, c, mask, ctx.options), q, k, v)[1]
        return (*pull(grad), None, None)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             mask: torch.Tensor | None, options: dict[str, Any]) -> tuple[torch.Tensor, int]:
        runs = info.batch_size
        q, k, v = (_in_front(t, d, runs) for t, d in zip((q, k, v), in_dims[:3], strict=True))
        if mask is not None:
            mask = _in_front(mask, in_dims[3], runs)
        if q.dim() < 4:  # one run's query is [L, E]: the runs are its batch dim as they are
            return _folded(q, k, v, mask, options), 0
        n = q.shape[1]
        q, k, v = (t.expand(runs, n, *t.shape[2:]).reshape(runs * n, *t.shape[2:]) for t in (q, k, v))
        if mask is not None:
            mask = _folded_mask(mask, runs, n, q.dim())
        out = _folded(q, k, v, mask, options)
        return out.reshape(runs, n, *out.shape[1:]), 0


# (torch declares Function.apply untyped: its signature here, stated once)
_folded_apply: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, Any]],
                        torch.Tensor] = _Folded.apply


def _folded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            options: dict[str, Any]) -> torch.Tensor:
    return _folded_apply(q, k, v, mask, options)


def _in_front(t: torch.Tensor, dim: int | None, runs: int) -> torch.Tensor:
    """``t`` with the runs' dim first: moved there, or added (expanded, no copy) where ``t`` is shared."""
    return t.movedim(dim, 0) if dim is not None else t.expand(runs, *t.shape)


def _folded_mask(mask: torch.Tensor, runs: int, n: int, rank: int) -> torch.Tensor:
    """A ``[runs, *m]`` mask for folded queries of ``rank`` dims: ``m`` padded to ``rank`` dims, its first folded."""
    per_run = mask.shape[1:]
    per_run = torch.Size([1] * (rank - len(per_run))) + per_run
    mask = mask.reshape(runs, *per_run)
    if mask.stride(0) == 0 and per_run[0] == 1:  # one mask for every run and sample: it broadcasts as it is
        return mask[0]
    return mask.expand(runs, n, *per_run[1:]).reshape(runs * n, *per_run[1:])


class _FoldAttention(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        bound = dict(zip(_NAMES, args, strict=False))
        bound.update(kwargs or {})
        if bound.get("dropout_p", 0.0):  # random per sample: left to vmap's own randomness rules
            return func(*args, **(kwargs or {}))
        q, k, v, mask = (bound.pop(name, None) for name in _NAMES[:4])
        return _folded(q, k, v, mask, bound)


@contextmanager
def folded_attention() -> Iterator[None]:
    """``scaled_dot_product_attention`` with the runs of ``vmap`` folded into its batch (NOTE [folded attention])."""
    if torch.compiler.is_compiling():  # Dynamo traces the kernel itself
        yield
        return
    with _FoldAttention():
        yield
