"""The stacked weights of a fused z+ / alpha-beta link, kept between calls while the weights' bits are the same."""

# NOTE [stacked weights kept]
# `fused` builds its stacked weights (NOTE [fused alpha-beta]) from the module's weight
# and bias: about ten small ops per convolution, ~50 us a call each on the benchmarks'
# CNN, for numbers that change only when the params do. A version counter cannot say
# that they did not: a write through ``w.data`` (``w.data.add_(1)``) leaves ``w._version``
# as it was (tested). So a planned link keeps the stacked weights with a copy of the
# tensors they were built from, and serves them again only where the given tensors have
# the same dtype, device and shape and the same bits (one integer comparison per
# tensor: NaNs and signed zeros compare as what they are, so the stacked weights are
# exactly those a rebuild would give). Only small weights on the CPU are kept: for large
# ones the rebuild costs little beside the module's own op, and a copy would hold their
# memory; on an accelerator the comparison waits for the device (not measured there).

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["StackCache"]

_KEPT_ELEMENTS = 1 << 16  # the largest weight kept (elements): 256 KiB in float32
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _same_bits(given: torch.Tensor | None, kept: torch.Tensor | None) -> bool:
    if given is None or kept is None:
        return given is kept
    if given.dtype != kept.dtype or given.device != kept.device or given.shape != kept.shape:
        return False
    bits = _BITS[given.element_size()]
    return torch.equal(given.view(bits), kept.view(bits))


def _keepable(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """A plain CPU tensor of a floating dtype ``dtype`` that requires no grad: compared by its bits."""
    return t.device.type == "cpu" and t.dtype == dtype and dtype in _FLOATS and t.layout == torch.strided and (
        not t.requires_grad)


class StackCache:
    """The last stacked weights of one link per input sign (``signed``), with the tensors they were built from."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[bool, tuple[torch.Tensor, torch.Tensor | None, Any]] = {}

    def get(self, weight: torch.Tensor, bias: torch.Tensor | None, signed: bool, build: Callable[[], Any]) -> Any:
        """``build()``'s stacked weights for ``weight`` and ``bias``, served again while their bits are the same."""
        if not (_keepable(weight, weight.dtype) and (bias is None or _keepable(bias, weight.dtype))) or (
                weight.numel() > _KEPT_ELEMENTS):
            return build()
        entry = self._entries.get(signed)  # (one read: another thread may replace it meanwhile)
        if entry is not None and _same_bits(weight, entry[0]) and _same_bits(bias, entry[1]):
            return entry[2]
        stacked = build()
        self._entries[signed] = (weight.clone(), None if bias is None else bias.clone(), stacked)
        return stacked
