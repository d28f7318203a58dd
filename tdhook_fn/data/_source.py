"""A dataset seen as numbered batches of TensorDicts.

Two kinds are accepted: a TensorDict with a leading batch dim (a slice per batch; a
memory-mapped one is read a batch at a time) and a map-style
``torch.utils.data.Dataset`` whose items are TensorDicts or dicts of tensors (the items
of a batch are stacked).
"""

from __future__ import annotations

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
        self.length = dataset.batch_size[0] if isinstance(dataset, TensorDictBase) else len(dataset)
        if self.length == 0:
            raise ValueError("attribute: the dataset is empty")
        self.n_batches = -(-self.length // batch_size)

    def bounds(self, index: int) -> tuple[int, int]:
        """The first and one-past-last sample of batch ``index``."""
        start = index * self.batch_size
        return start, min(start + self.batch_size, self.length)

    def batch(self, index: int) -> TensorDict:
        """Batch ``index`` as a TensorDict in ordinary memory, batch size ``[n]``."""
        start, stop = self.bounds(index)
        if isinstance(self.dataset, TensorDictBase):
            return self.dataset[start:stop].to_tensordict()
        stacked: TensorDictBase = TensorDict.maybe_dense_stack([self._item(i) for i in range(start, stop)])
        return stacked.to_tensordict()

    def describe(self) -> Json:
        """Length, type and the fingerprints of the first and last samples (NOTE [job fingerprints])."""
        first, last = (self._item(i) if not isinstance(self.dataset, TensorDictBase) else self.dataset[i]
                       for i in (0, self.length - 1))
        return {"length": self.length, "type": type(self.dataset).__name__,
                "first": fingerprint(first), "last": fingerprint(last)}

    def _item(self, i: int) -> TensorDictBase:
        item = self.dataset[i]
        if isinstance(item, TensorDictBase):
            return item
        if isinstance(item, Mapping):
            return TensorDict(dict(item), batch_size=[])
        raise TypeError(f"attribute: dataset[{i}] is a {type(item).__name__}; the items of a Dataset must be "
                        f"TensorDicts or dicts of tensors, e.g. {{'input': x, 'label': y}}")
