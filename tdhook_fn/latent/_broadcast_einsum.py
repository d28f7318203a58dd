"""One einsum over two operands whose leading (batch) dims broadcast, without expanding them."""

# NOTE [all pairs by broadcasting]
# ``cka(acts[:, None], acts[None, :])`` asks for an ``L x L`` table. Broadcasting the
# operands (as ``*`` or ``matmul`` would) copies each per-layer tensor ``L`` times. Here a
# batch dim of size 1 in one operand is dropped from that operand's einsum subscript: a dim
# held by both is a batch dim of the contraction, a dim held by one is an outer-product dim,
# so the whole table is one batched matrix product over the per-layer tensors.

from __future__ import annotations

import string
from collections.abc import Callable

import torch
from torch import Tensor

_BATCH_LETTERS = string.ascii_uppercase
_broadcast_shapes: Callable[..., torch.Size] = torch.broadcast_shapes  # (untyped in torch)


def broadcast(*shapes: torch.Size) -> torch.Size:
    """``torch.broadcast_shapes``, typed (its stub is not)."""
    return _broadcast_shapes(*shapes)


def broadcast_einsum(a_core: str, b_core: str, out_core: str, a: Tensor, b: Tensor) -> Tensor:
    """``einsum(f"...{a_core},...{b_core}->...{out_core}", a, b)`` with the ``...`` broadcast.

    The core subscripts are lowercase letters naming the trailing dims of each operand.
    """
    batch_a, batch_b = a.shape[: a.ndim - len(a_core)], b.shape[: b.ndim - len(b_core)]
    shape = broadcast(batch_a, batch_b)
    nd = len(shape)
    if nd > len(_BATCH_LETTERS):
        raise ValueError(f"at most {len(_BATCH_LETTERS)} batch dims are supported, got {nd}")
    pad_a, pad_b = (1,) * (nd - len(batch_a)) + batch_a, (1,) * (nd - len(batch_b)) + batch_b
    keep_a = [i for i in range(nd) if pad_a[i] != 1 or pad_b[i] == 1]
    keep_b = [i for i in range(nd) if pad_b[i] != 1]
    a = a.reshape([pad_a[i] for i in keep_a] + list(a.shape[len(batch_a):]))
    b = b.reshape([pad_b[i] for i in keep_b] + list(b.shape[len(batch_b):]))
    letters_a = "".join(_BATCH_LETTERS[i] for i in keep_a)
    letters_b = "".join(_BATCH_LETTERS[i] for i in keep_b)
    return torch.einsum(f"{letters_a}{a_core},{letters_b}{b_core}->{_BATCH_LETTERS[:nd]}{out_core}", a, b)
