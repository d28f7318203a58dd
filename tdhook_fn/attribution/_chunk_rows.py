"""How many perturbed rows go through one forward when no ``chunk_size`` is given."""

# NOTE [default chunk rows]
# Without a ``chunk_size``, a perturbation method's forwards are sized by the model's
# widest activation: on the CPU, rows are packed into a forward until its largest
# activation reaches about ``_ACTIVATION_BYTES`` (8 MiB), so a narrow model runs every row
# in one forward (the fixed cost of a forward, about 0.3 ms through the pure call, is paid
# once) and a wide one runs in forwards that keep their activations in cache; the
# activations, and so the peak memory, stay bounded whatever the model. Measured on 8x8
# digits, one thread: the docs CNN (convs of 16 and 32 channels, 8 KiB per sample in its
# widest activation) costs 14-16 us a sample in forwards of up to 1024 samples (8 MiB),
# 16.5 at 1536 and 24 at 2048; the small CNN (one 8-channel conv, 2 KiB) 4.2-4.5 us a
# sample from 1024 to 8192 samples (16 MiB), one forward of 12832 samples 37% slower.
# A model whose widest activation of one sample passes the budget runs one row per
# forward: its work per sample then dwarfs the fixed cost of a forward.
#
# The widest activation per sample is *probed* once per ``f`` and shape of a sample: ``f``
# runs on one sample under a dispatch mode that records the bytes of every op's result
# that is not a view (`LargestTensor`), and the figure is kept with ``f`` (a weak reference, so
# it goes with ``f``): the first call on a shape of sample runs ``f`` once more. A result
# that does not grow with the batch (a weight the forward transforms) counts as if it
# did: the chunks are then smaller than they could be, never larger. Only an eager CPU
# call outside every transform probes; elsewhere (a ``vmap``, ``grad`` or
# ``torch.compile`` around the call, another device, an ``f`` that cannot be weakly
# referenced, a probe that raises) the rows are sized by the input instead: about
# ``_INPUT_ELEMENTS`` input elements per forward. The probe decides only how the rows are
# split, never a number: every call of one ``f`` on one shape of sample splits alike, so
# repeated calls give the same bits.

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from tensordict import TensorDictBase

from .._functional import with_copied_inputs
from .._largest_tensor import LargestTensor
from .._pool_layout import fast_pooling
from .._probe import measuring_only
from .._vjp import RandomState, untransformed

__all__ = ["default_rows"]

_ACTIVATION_BYTES = 2**23  # the largest activation of one forward on the CPU; NOTE [default chunk rows]
_INPUT_ELEMENTS = 2**16  # input elements per forward where the activations are not probed
_widest: weakref.WeakKeyDictionary[Callable[..., Any], dict[tuple[Any, ...], int]] = weakref.WeakKeyDictionary()


def default_rows(f: Callable[..., Any], params: TensorDictBase, flat: TensorDictBase, rows: int) -> int:
    """Rows per forward for ``rows`` rows of the ``N`` samples ``flat`` without a ``chunk_size``: equal chunks.

    NOTE [default chunk rows].
    """
    n = max(1, flat.batch_size[0])
    widest = _widest_per_sample(f, params, flat)
    if widest is None:
        elements = sum(cast(torch.Tensor, v).numel() for v in flat.values(True, True))
        most = max(1, _INPUT_ELEMENTS // max(1, elements))
    else:
        most = max(1, _ACTIVATION_BYTES // max(1, widest * n))
    count = -(-rows // most)  # equal chunks: no chunk of a few rows left over
    return -(-rows // count)


def _widest_per_sample(f: Callable[..., Any], params: TensorDictBase, flat: TensorDictBase) -> int | None:
    """The bytes of ``f``'s widest activation for one sample of ``flat``; None where not probed."""
    items = [(key, cast(torch.Tensor, v)) for key, v in flat.items(True, True)]  # (one walk: on every call)
    if not items or flat.batch_size[0] == 0 or any(v.device.type != "cpu" for _, v in items) or not untransformed():
        return None
    signature = tuple((key, v.shape[1:], v.dtype) for key, v in items)
    try:
        known = _widest.setdefault(f, {})
    except TypeError:  # (f cannot be weakly referenced: nowhere to keep the figure)
        return None
    if signature not in known:
        probe = LargestTensor()
        random_state = RandomState()  # (an f that draws gives the same numbers on its first call)
        try:
            with torch.no_grad(), probe, fast_pooling(), measuring_only():  # (as `target_values` runs it)
                f(params, with_copied_inputs(flat[:1]))  # (a forward may write its input in place)
        except Exception:  # a probe only sizes chunks: the real forward raises what is wrong
            return None
        finally:
            random_state.restore()
        known[signature] = probe.bytes
    return known[signature]
