"""Occlusion: the change of the target when a sliding window of the input is set to its baseline."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from .._targets import Target
from .._types import NestedKey, PureFn
from ._baselines import Baselines
from ._engine import flat_inputs
from ._inputs import accepts_tensors
from ._perturbation import (
    as_maps,
    check_no_extra,
    checked_keys,
    evaluate,
    flat_baselines,
    per_sample_views,
    plain_tensors_now,
)

__all__ = ["occlusion"]

Shape = tuple[int, ...]
_CALLER = "occlusion"
_ALL_MASKS = 2**24  # window masks (bools) built at once below this; else per chunk
_DENSE_SPREAD = 2**20  # below this many mask elements the changes are spread by one product with the masks
_KEPT_MASKS = 2**16  # window plans of at most this many mask elements are kept between calls; NOTE [kept windows]


@dataclass
class _Windows:
    """The window positions over one input: per feature dim, which elements each position covers."""

    covers: list[torch.Tensor]  # per dim d, [positions_d, size_d] bool
    every: torch.Tensor | None = None  # every window's mask, once built (not a cached_property: Dynamo traces this)
    dense: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # by dtype: see spread

    @property
    def count(self) -> int:
        return math.prod([c.shape[0] for c in self.covers])

    def every_mask(self) -> torch.Tensor:
        """Every window's mask, ``[count, 1, *feature_shape]``: 2 ops per dim (built at most once per call)."""
        if self.every is not None:
            return self.every
        dims = len(self.covers)
        out = None
        for d, cover in enumerate(self.covers):
            shape = [1] * (2 * dims)
            shape[d], shape[dims + d] = cover.shape
            term = cover.reshape(shape)
            out = term if out is None else out & term
        assert out is not None
        self.every = out.reshape(self.count, 1, *(c.shape[1] for c in self.covers))
        return self.every

    def masks(self, lo: int, hi: int) -> torch.Tensor:
        """Windows ``lo .. hi - 1`` (row-major over the positions) as masks ``[p, 1, *feature_shape]``."""
        sizes = [c.shape[1] for c in self.covers]
        if self.count * math.prod(sizes) <= _ALL_MASKS:
            return self.every_mask()[lo:hi]
        index = torch.arange(lo, hi, device=self.covers[0].device)
        out = torch.ones(hi - lo, 1, *sizes, dtype=torch.bool, device=index.device)
        for d in reversed(range(len(self.covers))):
            steps = self.covers[d].shape[0]
            shape = [hi - lo, 1] + [1] * len(self.covers)
            shape[2 + d] = sizes[d]
            out = out & self.covers[d][index % steps].reshape(shape)
            index = index // steps
        return out

    def spread(self, change: torch.Tensor) -> torch.Tensor:
        """Changes ``[T, N, count]`` averaged over the windows covering each element: ``[T, N, *feature_shape]``."""
        sizes = [c.shape[1] for c in self.covers]
        if self.count * math.prod(sizes) <= _DENSE_SPREAD:  # one product with every mask
            dense, covering = self._dense(change.dtype)
            return (change @ dense / covering).reshape(*change.shape[:2], *sizes)
        out = change.reshape(*change.shape[:2], *(c.shape[0] for c in self.covers))
        weights = torch.ones((), dtype=change.dtype, device=change.device)
        for cover in self.covers:  # contract each window dim with its covers, in turn (dim 2 is the next one)
            if cover.shape[0] == cover.shape[1]:  # window and stride 1 (a channel dim): each element its own window
                out, weights = out.movedim(2, -1), weights.unsqueeze(-1)
                continue
            as_float = cover.to(change.dtype)
            out = torch.tensordot(out, as_float, dims=([2], [0]))
            weights = weights.unsqueeze(-1) * as_float.sum(0)
        return out / weights

    def _dense(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every window's mask ``[count, elements]`` in ``dtype``, and how many windows cover each element."""
        if dtype not in self.dense:
            dense = self.every_mask().reshape(self.count, -1).to(dtype)
            self.dense[dtype] = dense, dense.sum(0)
        return self.dense[dtype]


# NOTE [kept windows]
# The windows of an input depend only on the shape of a sample, the window, the strides
# and the device; building them (the covers, every window's mask, the masks as floats and
# how many windows cover each element) is a dozen small ops, on a small model a sixth of
# an occlusion call. So they are kept between calls, keyed by exactly those (a changed
# shape, window, stride or device builds new ones), for plans of at most `_KEPT_MASKS`
# mask elements (a few MiB in all: larger plans go with forwards that dwarf their cost).
# A kept plan's tensors are each set once (every mask on first use, its float copy per
# dtype) and never written after, only read (``torch.where``, a product): calls on several
# threads share them safely, and a race builds the same tensors twice. Only plain
# tensors are kept: inside a transform (``vmap``, ``grad``), Dynamo's trace, a JIT trace,
# a dispatch mode (fake tensors) or ``torch.inference_mode`` (whose tensors autograd
# cannot save later) the windows are built for the call alone.


def _windows(key: NestedKey, size: Shape, window: Shape, stride: Shape, device: torch.device) -> _Windows:
    _check_windows(key, size, window, stride)
    positions = [math.ceil((n - w) / s) + 1 for n, w, s in zip(size, window, stride, strict=True)]
    if math.prod(positions) * math.prod(size) <= _KEPT_MASKS and plain_tensors_now():
        return _kept_windows(size, window, stride, device)
    return _built_windows(size, window, stride, device)


def _check_windows(key: NestedKey, size: Shape, window: Shape, stride: Shape) -> None:
    for d, (n, w, s) in enumerate(zip(size, window, stride, strict=True)):
        if w < 1 or s < 1:
            raise ValueError(f"{_CALLER}: input {key!r}: window and stride sizes must be positive, got window "
                             f"{window} and strides {stride}")
        if w > n:
            raise ValueError(f"{_CALLER}: input {key!r}: sliding window {window} is larger than one sample "
                             f"{tuple(size)} in dim {d}; give a window no larger than the sample")
        if s > w and w < n:
            raise ValueError(f"{_CALLER}: input {key!r}: stride {s} is larger than the window {w} in dim {d}, so some "
                             "elements would never be occluded; give strides no larger than the window")


@functools.lru_cache(maxsize=16)  # (16 plans of 2**16 masks: 5 MiB with their float32 copies)
def _kept_windows(size: Shape, window: Shape, stride: Shape, device: torch.device) -> _Windows:
    """`_built_windows`, kept for the next call on the same shapes and device: NOTE [kept windows]."""
    return _built_windows(size, window, stride, device)


def _built_windows(size: Shape, window: Shape, stride: Shape, device: torch.device) -> _Windows:
    covers = []
    for n, w, s in zip(size, window, stride, strict=True):
        starts = torch.arange(0, (math.ceil((n - w) / s) + 1) * s, s, device=device).unsqueeze(1)
        elements = torch.arange(n, device=device)
        covers.append((elements >= starts) & (elements < starts + w))
    return _Windows(covers)


def _per_key(name: str, given: Any, keys: Sequence[NestedKey]) -> dict[NestedKey, Any]:
    if isinstance(given, Mapping):
        check_no_extra(_CALLER, name, given, keys)
        missing = [key for key in keys if key not in given]
        if missing:
            raise KeyError(f"{_CALLER}: {name} has no entry for input {missing[0]!r}; give one for every "
                           f"occluded input {list(keys)}")
        return dict(given)
    if len(keys) != 1 and not (name == "strides" and (given is None or isinstance(given, int))):
        raise TypeError(f"{_CALLER}: {len(keys)} inputs are occluded {list(keys)}; give {name} as a dict "
                        "{key: shape}")
    return dict.fromkeys(keys, given)


def _shape(key: NestedKey, name: str, value: Any, dims: int) -> Shape:
    if value is None:
        value = 1
    if isinstance(value, int) and not isinstance(value, bool) and name == "strides":
        return (value,) * dims
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                       for v in value):
        raise TypeError(f"{_CALLER}: {name} for input {key!r} must be a tuple of ints, got {value!r}")
    if len(value) != dims:
        raise ValueError(f"{_CALLER}: {name} for input {key!r} has {len(value)} dims, but one sample has {dims} "
                         f"(the input's shape after the batch dims); give one size per dim")
    return tuple(value)


@accepts_tensors
def occlusion(
    f: PureFn,
    params: TensorDictBase,
    inputs: TensorDictBase,
    baselines: Baselines = 0.0,
    *,
    target: Target,
    sliding_window_shapes: Shape | Mapping[NestedKey, Shape],
    strides: int | Shape | Mapping[NestedKey, int | Shape] | None = None,
    per_target: bool = False,
    chunk_size: int | None = None,
    input_keys: NestedKey | Sequence[NestedKey] | None = None,
) -> TensorDict:
    """``F(x) - F(x with a window set to its baseline)``, averaged over the windows covering each element.

    captum's ``Occlusion``: a window of ``sliding_window_shapes`` slides over each sample
    of each occluded input in steps of ``strides`` from the corner at index 0, the last
    window of a dim cut off at the edge. All occluded copies of the batch are built once
    and go through ``f`` in batched forwards of at most ``chunk_size`` windows; the map
    of an element is the mean change over the windows that cover it. Inputs are
    occluded one at a time.

    Args:
        f (Functional | Callable): pure ``f(params, td) -> td``.
        params (TensorDict): parameters for ``f``.
        inputs (TensorDict | Tensor): inputs, any batch size ``[*B]``; or a tensor, batch
            first, for an ``f`` with one in_key (the result is then a tensor).
        baselines (TensorDict | Tensor | float): what an occluded element becomes, as in
            `feature_ablation`. Default: ``0.0``.
        target (int | tuple[int, ...] | Tensor | Callable): see `tdhook_fn.as_target`.
        sliding_window_shapes (tuple | dict): the window, one size per dim of a sample
            (``(1, 3, 3)`` for ``[C, H, W]`` images); a dict ``{key: window}`` for several
            inputs.
        strides (int | tuple | dict | None): the step of the window per dim (an int for
            all dims), no larger than the window; a dict by key for several inputs.
            Default: ``None``, steps of 1.
        per_target (bool): one map per target on a new leading dim ``T``. Default: the
            targets' sum.
        chunk_size (int | None): at most this many occluded copies of the batch per
            forward (captum's ``perturbations_per_eval``). Default: ``None``,
            equal chunks whose widest activation stays near 8 MiB on the CPU (probed
            once per ``f``): every copy in one forward for a narrow model, forwards that
            keep a wide one's activations in cache.
        input_keys (Sequence | None): the inputs to occlude. Default: ``f.in_keys``.

    Returns:
        TensorDict: keyed like the occluded inputs, batch ``[*B]`` (``[T, *B]`` with
        ``per_target``), in the target values' dtype. A tensor for tensor ``inputs``.

    Raises:
        ValueError: a window larger than a sample, a stride larger than its window (some
            elements never occluded), or sizes with the wrong number of dims.

    Examples:
        >>> import torch, tdhook_fn
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Flatten(), torch.nn.Linear(18, 3))
        >>> f, p = tdhook_fn.pure(net)
        >>> x = torch.randn(4, 1, 5, 5)
        >>> occlusion(f, p, x, target=2, sliding_window_shapes=(1, 2, 2), strides=(1, 1, 1)).shape
        torch.Size([4, 1, 5, 5])
        >>> one = torch.vmap(lambda s: occlusion(f, p, s[None], target=2, sliding_window_shapes=(1, 2, 2))[0])(x)
        >>> torch.allclose(one, occlusion(f, p, x, target=2, sliding_window_shapes=(1, 2, 2)), atol=1e-6)
        True
    """
    keys = checked_keys(_CALLER, f, params, inputs, target, input_keys, chunk_size)
    batch = inputs.batch_size
    starts = flat_baselines(_CALLER, inputs, baselines, keys)
    windows, strides_of = _per_key("sliding_window_shapes", sliding_window_shapes, keys), _per_key("strides", strides,
                                                                                                   keys)
    xs = per_sample_views(inputs, keys, inputs.batch_dims)
    plans = {}
    for key in keys:
        size = tuple(xs[key].shape[1:])
        window = _shape(key, "sliding_window_shapes", windows[key], len(size))
        plans[key] = _windows(key, size, window, _shape(key, "strides", strides_of[key], len(size)), xs[key].device)
    first = dict(zip(keys, _cumulative([plans[k].count for k in keys]), strict=True))

    def build(lo: int, hi: int) -> dict[NestedKey, torch.Tensor]:
        out = {}
        for key in keys:  # rows first[key] + 1 .. first[key] + count occlude this key; the others leave it
            a, b = max(lo - 1 - first[key], 0), min(hi - 1 - first[key], plans[key].count)
            if a >= b:
                continue
            masks = plans[key].masks(a, b)
            before = max(first[key] + 1 - lo, 0)
            after = hi - lo - before - (b - a)
            if before or after:  # rows of the reference or of other inputs leave this one alone
                masks = torch.cat([masks.new_zeros(before, *masks.shape[1:]), masks,
                                   masks.new_zeros(after, *masks.shape[1:])])
            out[key] = torch.where(masks, starts[key], xs[key])
        return out

    rows = 1 + sum(plans[k].count for k in keys)
    values = evaluate(f, params, flat_inputs(inputs), target, rows=rows, build=build, chunk_size=chunk_size,
                      per_target=per_target, caller=_CALLER,
                      baselines=list(starts.values()))
    change = (values[:1] - values[1:]).permute(2, 1, 0)  # [T, N, rows - 1]
    maps = {key: plans[key].spread(change[..., first[key]: first[key] + plans[key].count]) for key in keys}
    return as_maps(maps, batch, per_target)


def _cumulative(counts: list[int]) -> list[int]:
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out
