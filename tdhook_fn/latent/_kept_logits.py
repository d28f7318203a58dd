"""The logits a metric reads: where it reads the last positions only, the runs compute those only."""

# NOTE [positions the metric reads]
# A metric usually reads the logits of the last position only, yet the language-model head
# (a ``d x vocab`` product, a fifth of a default GPT-2's forward at 16 tokens) runs at
# every position a run computes. Where the model's forward takes ``logits_to_keep``
# (Hugging Face's causal LMs), the runs of a sweep compute the logits of the last ``T - r``
# positions only, ``r`` the first position the metric reads, and the positions before take
# the corrupted run's logits (as, with ``causal=True``, the positions before a run's start
# already do): the metric never reads them. ``r`` is
# found on the corrupted run's outputs: the first position where the metric's gradient is
# not zero. It is a finding, so it is tested: the metric of those outputs with every
# position before ``r`` changed (by noise larger than the values) must be the same, bit
# for bit. A metric without a gradient, one that reads earlier positions in a way its
# gradient does not show, or autograd off (inference mode) make the runs compute every
# position, as before: never a number that depends on this guess. Without ``causal`` it costs
# one forward of the corrupted inputs, and it is done only outside transforms and where
# no gradient is asked for (the data decide it, as in NOTE [unchanged sites]).
#
# Completing every run's outputs to all ``T`` positions copies the corrupted run's logits
# into each run (``T x vocab`` numbers a run: a tenth of a causal sweep of GPT-2 at 32
# tokens). Where the metric also gives the same value, bit for bit, on the outputs cut
# to their last ``T - r`` positions (tested on the corrupted run's outputs and on random
# ones, so a metric that counts positions from the front, or reads the length, fails it),
# the runs hand it those only.

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from .._functional import Functional, with_copied_inputs
from .._taps import Tap

__all__ = ["KEEP_SLOT", "complete", "kept_logits", "positions_read", "reads_tail_alone", "takes_keep"]

KEEP_SLOT = "logits_to_keep"  # Hugging Face causal LMs: the logits of the last k positions only


def takes_keep(f: Functional) -> bool:
    """Whether ``f``'s model is called with keyword arguments and its forward takes `KEEP_SLOT`."""
    if not isinstance(f, Functional) or not isinstance(f.model, torch.nn.Module) or KEEP_SLOT in f.keywords.values():
        return False
    try:
        return KEEP_SLOT in inspect.signature(f.model.forward).parameters
    except (TypeError, ValueError):
        return False


def positions_read(metric: Callable[[TensorDictBase], torch.Tensor], outputs: TensorDict, length: int) -> int | None:
    """How many last positions of ``outputs`` (``[N, T, ...]``) ``metric`` reads, if fewer than all and tested;
    else None (NOTE [positions the metric reads])."""
    if torch.is_inference_mode_enabled():
        return None
    first = _first_read(metric, outputs, length)
    if first is None or first <= 0 or not _reads_from(metric, outputs, first, length):
        return None
    return length - first


def reads_tail_alone(metric: Callable[[TensorDictBase], torch.Tensor], outputs: TensorDict, kept: int,
                     length: int) -> bool:
    """Whether ``metric`` gives the same, bit for bit, on ``outputs`` (``[N, T, ...]``) and on their last ``kept``
    positions alone; checked on ``outputs`` and on random last positions (NOTE [positions the metric reads])."""
    noise = torch.Generator(device="cpu").manual_seed(1)

    def random_tail(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dim() < 2 or t.shape[1] != length:
            return t
        tail = torch.randn(t[:, length - kept:].shape, generator=noise, dtype=t.dtype).to(t.device)
        return torch.cat([t[:, : length - kept], tail * (float(t.detach().abs().max()) + 1.0)], dim=1)

    try:
        with torch.no_grad():
            for whole in (outputs, _each(outputs, random_tail)):
                if not torch.equal(metric(whole), metric(_each(whole, lambda t: _last(t, kept, length)))):
                    return False
    except (RuntimeError, IndexError, ValueError):
        return False
    return True


def _last(t: torch.Tensor, kept: int, length: int) -> torch.Tensor:
    return t[:, length - kept:] if t.dim() >= 2 and t.shape[1] == length else t


def complete(out: TensorDictBase, corrupted: TensorDictBase, keys: Sequence[Any], length: int, kept: int,
             ran: int, width: int | None = None) -> TensorDict:
    """``out`` of a run over the last ``ran`` positions (its logits over the last ``kept``), completed by the
    corrupted run's outputs ``corrupted`` to the last ``width`` positions (default: all ``length``)."""
    width = length if width is None else width
    done = TensorDict({}, batch_size=corrupted.batch_size)
    for key in keys:
        head, tail = corrupted.get(key), out.get(key)
        got = tail.shape[1] if tail.dim() >= 2 else -1
        if tail.dim() < 2 or head.shape[2:] != tail.shape[2:] or got not in (ran, kept):
            raise ValueError(f"patching_sweep: causal=True needs f's outputs with their positions first; "
                             f"{key!r} is {tuple(head.shape)} on all {length} positions and "
                             f"{tuple(tail.shape)} on the last {ran}; pass causal=False")
        if got >= width:
            done.set(key, tail[:, got - width:])
        else:
            done.set(key, torch.cat([head[:, length - width: length - got].to(tail.dtype), tail], dim=1))
    return done


def kept_logits(f: Functional, params: TensorDictBase, flat: TensorDictBase,
                metric: Callable[[TensorDictBase], torch.Tensor], corrupted: TensorDictBase | None = None,
                ) -> Callable[[TensorDictBase, TensorDictBase, Sequence[Tap]], TensorDict] | None:
    """A forward for the runs of a sweep (without ``causal``) computing the logits ``metric`` reads only,
    completed by the corrupted run's outputs (``corrupted``, run here if not given); None where that does not
    apply (NOTE [positions the metric reads])."""
    if not takes_keep(f):
        return None
    if corrupted is None:
        corrupted = f(params, with_copied_inputs(flat))
    lengths = {t.shape[1] for t in corrupted.values(True, True) if isinstance(t, torch.Tensor) and t.dim() >= 2}
    if len(lengths) != 1:
        return None
    length = lengths.pop()
    kept = positions_read(metric, corrupted, length)
    if kept is None:
        return None
    width = kept if reads_tail_alone(metric, corrupted, kept, length) else length

    def run(p: TensorDictBase, td: TensorDictBase, taps: Sequence[Tap]) -> TensorDict:
        out = f.with_taps(*taps).call_with(p, with_copied_inputs(td), **{KEEP_SLOT: kept})
        return complete(out, corrupted, f.out_keys, length, kept, length, width)

    return run


def _each(td: TensorDict, fn: Callable[[torch.Tensor], torch.Tensor]) -> TensorDict:
    out = td.apply(fn)
    assert out is not None
    return out


def _first_read(metric: Callable[[TensorDictBase], torch.Tensor], outputs: TensorDict, length: int) -> int | None:
    """The first position of ``outputs`` (``[N, T, ...]``) where ``metric``'s gradient is not zero; None if none
    is found (no gradient)."""
    leaves = _each(outputs, lambda t: t.detach().requires_grad_() if t.is_floating_point() else t)
    floats = [(key, leaves.get(key)) for key in leaves.keys(True, True) if leaves.get(key).requires_grad]
    try:
        with torch.enable_grad():
            value = metric(leaves)
            if not isinstance(value, torch.Tensor) or not value.requires_grad:
                return None
            grads = torch.autograd.grad(value.sum(), [t for _, t in floats], allow_unused=True)
    except RuntimeError:
        return None
    read = [length]
    for (_, leaf), grad in zip(floats, grads, strict=True):
        if grad is None or leaf.dim() < 2 or leaf.shape[1] != length:
            if grad is not None and bool(grad.ne(0).any()):  # read, and without its positions first
                return None
            continue
        by_position = grad.ne(0).transpose(0, 1).reshape(length, -1).any(dim=1)
        if bool(by_position.any()):
            read.append(int(by_position.nonzero()[0]))
    return min(read) if min(read) < length else None


def _reads_from(metric: Callable[[TensorDictBase], torch.Tensor], outputs: TensorDict, first: int,
                length: int) -> bool:
    """Whether ``metric`` of ``outputs`` is the same, bit for bit, with every position before ``first`` changed."""
    noise = torch.Generator(device="cpu").manual_seed(0)

    def changed(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dim() < 2 or t.shape[1] != length or not t.numel():
            return t
        scale = float(t.detach().abs().max()) + 1.0
        shift = torch.randn(t[:, :first].shape, generator=noise, dtype=t.dtype).to(t.device) * scale + scale
        return torch.cat([t[:, :first] + shift, t[:, first:]], dim=1)

    try:
        with torch.no_grad():
            return bool(torch.equal(metric(_each(outputs, changed)), metric(outputs)))
    except (RuntimeError, IndexError, ValueError):
        return False
