"""Patched runs of a causal model on the positions a patch can change, from the corrupted run's cache."""

# NOTE [causal sweeps]
# In a causal model (a decoder: each position attends to itself and the ones before it) a
# patch at position ``p`` changes nothing at the positions before ``p``, at any layer. With
# ``patching_sweep(..., causal=True)`` the runs are grouped by the first position they
# patch, and a group starting at ``p > 0`` runs the model on the positions ``[p:]`` only,
# with the corrupted run's keys and values of the positions before ``p`` in the model's
# cache (Hugging Face's ``past_key_values``); its outputs at the positions before ``p``
# are the corrupted run's. On top of what ``vmap`` shares (NOTE [patching sweeps]: the
# layers below a chunk's first patch run once), a run at position ``p`` of ``T`` costs
# about ``(T - p) / T`` of one: about half, over a grid of every position.
#
# What it takes, each checked with an error that says what to do instead:
#
# - a Hugging Face model whose forward takes ``past_key_values`` and ``use_cache``, with
#   a cache of full-attention layers (``DynamicLayer``; sliding windows keep too little);
# - inputs it knows how to cut: ``input_ids``, ``inputs_embeds``, ``position_ids`` and
#   ``token_type_ids`` are cut to ``[p:]``, ``attention_mask`` stays whole (it covers the
#   cached positions too); any other input is refused;
# - sites whose activation has its positions first (``[N, T, ...]``, no other dim of size
#   ``T``) and whose selection starts with one position (an int); other runs start at 0
#   and run whole, as without ``causal``;
# - ``f``'s outputs with their positions first (``[N, T, ...]``), so the corrupted run's
#   first ``p`` positions complete them.
#
# Being causal is the caller's claim, and it is tested: the run of the largest ``p`` is
# also run whole, and its outputs must agree (``RuntimeError`` otherwise: the model
# attends to later positions, or does not use its cache as assumed). It runs eagerly
# (no functorch transform around the sweep).

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from .._functional import Functional, with_copied_inputs
from .._paths import resolve_path
from .._taps import Tap
from ._kept_logits import KEEP_SLOT, complete, positions_read, reads_tail_alone
from ._sites import Site

__all__ = ["CausalCut", "causal_cut", "check_agrees", "share_before"]

_CUT = ("input_ids", "inputs_embeds", "position_ids", "token_type_ids")  # per position: cut to [p:]
_WHOLE = ("attention_mask",)  # covers the cached positions and the new ones
_CACHE_SLOTS = ("cache", "past_key_values")  # the forward's cache argument (transformers 5.x, 4.x)


def _forward_parameters(f: Functional) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(f.model.forward).parameters.values())
    except (TypeError, ValueError):
        return []


def _forward_names(f: Functional, parameters: list[inspect.Parameter]) -> dict[Any, str]:
    """Each in_key's parameter name in the model's forward (positional in_keys by position)."""
    names = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    positional = [k for k in f.in_keys if k not in f.keywords]
    out = dict(zip(positional, names, strict=False))
    out.update(f.keywords)
    return out


def _dynamic_cache() -> Any:
    try:
        return importlib.import_module("transformers.cache_utils")
    except ImportError as e:
        raise TypeError("patching_sweep: causal=True takes the model's key/value cache from transformers, which "
                        "does not import here; pass causal=False") from e


@dataclass
class CausalCut:
    """How the runs of one sweep are cut to the positions a patch can change (NOTE [causal sweeps])."""

    f: Functional
    keyed: Functional  # f with every input passed by its forward's name (keyed.keywords)
    slot: str  # the forward's cache argument
    length: int
    cache_layers: list[tuple[torch.Tensor, torch.Tensor]]
    corrupted: TensorDict  # f's outputs on the corrupted inputs, [N, T, ...]
    takes_keep: bool  # the forward takes logits_to_keep
    kept: int | None = None  # the last positions the metric reads (NOTE [positions the metric reads]); None: all
    width: int | None = None  # the last positions the runs hand the metric; None: all

    def start(self, site: Site, activation: torch.Tensor) -> int:
        """The first position ``site`` patches, if it can be cut there; else 0 (the run runs whole)."""
        if not site.index or not isinstance(site.index[0], int):
            return 0
        shape = activation.shape[1:]
        if not shape or shape[0] != self.length or self.length in shape[1:]:
            raise ValueError(f"patching_sweep: causal=True needs the activation at site {site.key!r} with its "
                             f"{self.length} positions first and no other dim of that size, got {tuple(shape)} "
                             "(batch flattened); pass causal=False for this site")
        return site.index[0] % self.length

    def inputs(self, flat: TensorDictBase, start: int) -> TensorDictBase:
        out = flat.copy()
        for key, name in self.keyed.keywords.items():
            if name in _CUT:
                out.set(key, flat.get(key)[:, start:])
        return out

    def run(self, start: int) -> Callable[[TensorDictBase, TensorDictBase, Sequence[Tap]], TensorDict]:
        """``forward`` of the positions ``[start:]``, the ones before in the cache, completed to all positions;
        the logits of the last `kept` positions only, once `read_by` has set it."""
        kept = [(k[..., :start, :], v[..., :start, :]) for k, v in self.cache_layers]
        extra: dict[str, Any] = {}
        if self.kept is not None and self.kept < self.length - start:
            extra[KEEP_SLOT] = self.kept

        def run(params: TensorDictBase, td: TensorDictBase, taps: Sequence[Tap]) -> TensorDict:
            cached = {self.slot: _dynamic_cache().DynamicCache(ddp_cache_data=kept)} if start else {}
            out = self.keyed.with_taps(*taps).call_with(params, with_copied_inputs(td), **cached,
                                                        use_cache=bool(start), **extra)
            ran = self.length - start
            logits = self.kept if self.kept is not None and extra else ran
            return complete(out, self.corrupted, self.f.out_keys, self.length, logits, ran, self.width)

        return run

    def read_by(self, metric: Callable[[TensorDictBase], torch.Tensor]) -> None:
        """Set `kept` to the last positions ``metric`` reads, and `width` where it can be handed those alone
        (NOTE [positions the metric reads])."""
        if self.takes_keep:
            self.kept = positions_read(metric, self.corrupted, self.length)
        if self.kept is not None and reads_tail_alone(metric, self.corrupted, self.kept, self.length):
            self.width = self.kept

    def shifted(self, site: Site, start: int) -> Site:
        """``site`` with its position counted from ``start``."""
        if not start:
            return site
        first = site.index[0]
        assert isinstance(first, int)
        return Site(site.path, (first % self.length - start, *site.index[1:]), site.element, site.site, site.call,
                    site.key)


def share_before(model: nn.Module, site: Site) -> float:
    """About the share of the forward done before ``site``: the leaf modules registered up to it, of all."""
    module = resolve_path(model, site.path)
    leaves = [m for m in model.modules() if not next(m.children(), None)]
    mine = {id(m) for m in module.modules()}
    at = [i for i, m in enumerate(leaves) if id(m) in mine]
    if not leaves or not at:
        return 0.5
    return (at[0] if site.site == "input" else at[-1] + 1) / len(leaves)


def causal_cut(f: Functional, params: TensorDictBase, flat: TensorDictBase) -> CausalCut:
    """Check that ``f`` fits NOTE [causal sweeps], and run the corrupted inputs ``flat`` once, keeping the cache."""
    if type(f) is not Functional or f.taps:
        raise ValueError("patching_sweep: causal=True runs f's model on part of the positions; f must be a plain "
                         "tdhook_fn.functional(model) without taps of its own (pass causal=False)")
    forward_parameters = _forward_parameters(f)
    names = _forward_names(f, forward_parameters)
    parameters = {p.name for p in forward_parameters}
    slot = next((name for name in _CACHE_SLOTS if name in parameters), None)
    if slot is None or "use_cache" not in parameters:
        raise TypeError(f"patching_sweep: causal=True needs a model whose forward takes a key/value cache "
                        f"({' or '.join(_CACHE_SLOTS)}) and use_cache (a Hugging Face decoder); "
                        f"{type(f.model).__name__}'s does not; pass causal=False")
    unknown = [k for k in f.in_keys if names.get(k) not in (*_CUT, *_WHOLE)]
    if unknown:
        raise ValueError(f"patching_sweep: causal=True cuts the inputs {list(_CUT)} to the positions it runs and "
                         f"keeps {list(_WHOLE)}; it does not know what to do with {unknown} (passed as "
                         f"{[names.get(k) for k in unknown]}); pass causal=False")
    lengths = {flat.get(k).shape[1] for k in f.in_keys if names[k] in _CUT and flat.get(k).dim() >= 2}
    if len(lengths) != 1:
        raise ValueError(f"patching_sweep: causal=True needs the per-position inputs {list(_CUT)} with one number of "
                         f"positions (dim 1), got {sorted(lengths)}")
    cache = _dynamic_cache().DynamicCache()
    keyed = Functional(f.model, f.in_keys, f.out_keys, (), {k: names[k] for k in f.in_keys})  # every input by name
    corrupted = keyed.call_with(params, with_copied_inputs(flat), **{slot: cache}, use_cache=True)
    layers = getattr(cache, "layers", [])
    if not layers or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers})
        raise ValueError(f"patching_sweep: causal=True needs a key/value cache of full-attention layers "
                         f"(DynamicLayer); the model's has {kinds or 'no layers'}; pass causal=False")
    return CausalCut(f, keyed, slot, lengths.pop(), [(layer.keys, layer.values) for layer in layers],
                     corrupted, KEEP_SLOT in parameters)


def check_agrees(cut: TensorDictBase, whole: TensorDictBase, site: Site) -> None:
    """The test of NOTE [causal sweeps]: the cut run's outputs must be the whole run's (float rounding apart)."""
    for key in whole.keys(True, True):
        a, b = cut.get(key), whole.get(key)
        scale = b.abs().max().item() if b.numel() else 0.0
        rtol = 1e-3 if b.dtype in (torch.float32, torch.float64) else 3e-2
        if a.shape != b.shape:
            raise RuntimeError(f"patching_sweep: causal=True, but the run patching {site.key!r} gives {key!r} "
                               f"shaped {tuple(a.shape)} from the cache, {tuple(b.shape)} when all positions run")
        far = ~torch.isclose(a.to(b.dtype), b, rtol=rtol, atol=rtol * scale)
        if far.any():
            sample, position = (int(i) for i in far.nonzero()[0][:2])
            raise RuntimeError(
                f"patching_sweep: causal=True, but the run patching {site.key!r} gives other outputs from the cache "
                f"than when all positions run ({key!r}, first at sample {sample}, position {position}): the model "
                "attends to later positions or does not use its cache as a causal decoder does (a position that "
                "left padding hides may attend to every position); pass causal=False")
