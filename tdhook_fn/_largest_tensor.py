"""The size of the largest tensor a piece of code creates: what chunk sizes are measured by."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LargestTensor"]


class LargestTensor(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A dispatch mode recording, in ``bytes``, the size of the largest tensor an op creates.

    Views create no tensor and are not counted. The perturbation methods' default chunks
    (NOTE [default chunk rows]) and the weights' alpha sweep size their chunks by it.

    Examples:
        >>> import torch
        >>> with LargestTensor() as mode:
        ...     _ = torch.ones(4, 8).sum(0)
        >>> mode.bytes
        128
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out
