"""SHA-256 digests of array data: tensors and numpy arrays, by dtype, shape and bytes.

A dataset is digested whole (NOTE [every row counts] in ``_source``), so a leaf is hashed
a slab of rows at a time: a memory-mapped leaf is read through, never copied whole into
memory, and a non-contiguous or GPU leaf is copied one slab at a time.
"""

from __future__ import annotations

import hashlib
import math
from typing import cast

import numpy as np
import torch
from tensordict import TensorDictBase

__all__ = ["array_digest", "rows_digest", "tensor_digest"]

_SLAB_BYTES = 1 << 24


def tensor_digest(t: torch.Tensor) -> str:
    """The SHA-256 of a tensor's dtype, shape and bytes (in C order, whatever its strides)."""
    data = t.detach().resolve_conj().resolve_neg()
    h = hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode())
    if data.numel():
        rows = data.reshape(1, -1) if data.dim() == 0 else data
        step = max(1, _SLAB_BYTES // max(1, math.prod(rows.shape[1:]) * rows.element_size()))
        for start in range(0, len(rows), step):
            h.update(rows[start:start + step].cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def array_digest(a: np.ndarray) -> str:
    """The SHA-256 of a numpy array's dtype, shape and bytes; not for ``dtype=object`` (its bytes are pointers)."""
    if a.dtype.hasobject:
        raise TypeError("array_digest: an object array holds pointers, not values; describe its items instead")
    h = hashlib.sha256(f"{a.dtype.str}{a.dtype}{a.shape}".encode())
    if a.size:
        h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
    return h.hexdigest()


def rows_digest(result: TensorDictBase, start: int, stop: int) -> str:
    """The SHA-256 of rows ``start:stop`` of every leaf of ``result``, by key (NOTE [checked out_dir])."""
    h = hashlib.sha256()
    for key, leaf in sorted(result.items(True, True), key=lambda item: str(item[0])):
        h.update(f"{key}:{tensor_digest(cast(torch.Tensor, leaf)[start:stop])};".encode())
    return h.hexdigest()
