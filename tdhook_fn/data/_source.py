"""A dataset seen as numbered batches of TensorDicts.

Two kinds are accepted: a TensorDict with a leading batch dim (a slice per batch; a
memory-mapped one is read a batch at a time) and a map-style
``torch.utils.data.Dataset`` whose items are TensorDicts or dicts of tensors (the items
of a batch are stacked).
"""

# NOTE [every row counts]
# An ``out_dir`` must not return, or resume with, rows of a dataset that has changed since,
# even in one sample or in its order. A TensorDict is digested whole when the job is
# described: every leaf's bytes, read through (a memory-mapped one is not loaded), which is
# cheap next to attributing it. A Dataset is read lazily (decoding images, tokenizing), so it
# is digested a batch at a time as each batch is read, and the digest is recorded with the
# batch (NOTE [resumable out_dir]); resuming or returning the ``out_dir`` reads its recorded
# batches again (reading only, no attribution) and refuses one whose digest differs.

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from ._fingerprint import Json, fingerprint

__all__ = ["Source"]


class Source:
    """``dataset`` cut into batches of ``batch_size`` samples, in order."""

    def __init__(self, dataset: Any, batch_size: int):
        if isinstance(dataset, TensorDictBase):
            if not dataset.batch_dims:
                raise ValueError("attribute: a TensorDict dataset needs a leading batch dim (one row per sample), "
                                 "got batch_size=[]; e.g. TensorDict(input=x, batch_size=[len(x)])")
        elif isinstance(dataset, torch.Tensor):
            raise TypeError("attribute: dataset is a Tensor; name its key: TensorDict(input=x, batch_size=[len(x)]) "
                            "(with labels: TensorDict(input=x, label=y, batch_size=[len(x)]))")
        elif not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise TypeError(f"attribute: dataset must be a TensorDict with a leading batch dim or a map-style "
                            f"torch.utils.data.Dataset (with __len__ and __getitem__), got {type(dataset).__name__}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"attribute: batch_size must be a positive int, got {batch_size!r}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.lazy = not isinstance(dataset, TensorDictBase)  # rows digested per batch as read (see the NOTE)
        self.length = len(dataset) if self.lazy else dataset.batch_size[0]
        if self.length == 0:
            raise ValueError("attribute: the dataset is empty")
        self.n_batches = -(-self.length // batch_size)

    def bounds(self, index: int) -> tuple[int, int]:
        """The first and one-past-last sample of batch ``index``."""
        start = index * self.batch_size
        return start, min(start + self.batch_size, self.length)

    def read(self, index: int) -> tuple[TensorDict, str]:
        """Batch ``index`` as a TensorDict in ordinary memory, batch size ``[n]``, and the digest of its samples.

        A TensorDict's rows are all in the job's description already: no digest per batch.
        """
        start, stop = self.bounds(index)
        if not self.lazy:
            return self.dataset[start:stop].to_tensordict(), _IN_THE_JOB
        items = [self._item(i) for i in range(start, stop)]
        stacked: TensorDictBase = TensorDict.maybe_dense_stack(items)
        return stacked.to_tensordict(), _digest(index, items)

    def digest(self, index: int) -> str:
        """The digest `read` gives for batch ``index``, without stacking the batch."""
        start, stop = self.bounds(index)
        if not self.lazy:
            return _IN_THE_JOB
        return _digest(index, [self._item(i) for i in range(start, stop)])

    def describe(self) -> Json:
        """Length, type and, for a TensorDict, every leaf's digest (NOTE [every row counts])."""
        try:
            rows = "digested per batch" if self.lazy else fingerprint(self.dataset)
        except TypeError as e:
            raise TypeError(f"attribute: cannot fingerprint the dataset: {e}") from e
        return {"length": self.length, "type": type(self.dataset).__name__, "rows": rows}

    def _item(self, i: int) -> TensorDictBase:
        item = self.dataset[i]
        if isinstance(item, TensorDictBase):
            return item
        if isinstance(item, Mapping):
            return TensorDict(dict(item), batch_size=[])
        raise TypeError(f"attribute: dataset[{i}] is a {type(item).__name__}; the items of a Dataset must be "
                        f"TensorDicts or dicts of tensors, e.g. {{'input': x, 'label': y}}")


_IN_THE_JOB = "in the job"  # what a TensorDict's batches record (describe digests every row)


def _digest(index: int, parts: list[TensorDictBase]) -> str:
    try:
        described = [fingerprint(part) for part in parts]
    except TypeError as e:
        raise TypeError(f"attribute: cannot fingerprint batch {index} of the dataset: {e}") from e
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()
