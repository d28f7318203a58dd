"""Alpha-beta (and z+) on a linear layer or a convolution with every ``z`` from one op."""

# NOTE [fused alpha-beta]
# `AlphaBeta` runs its module up to four times with modified weights (``w+ x+``,
# ``w- x-``, and their mirror for beta) and pulls back through each run. On an affine
# module (NOTE [affine modules]) these runs are one map on inputs stacked along the
# channel dim, ``[x+, x-]``, with weights stacked the same way, ``[[w+, w-], [w-, w+]]``
# (one row block per half): one forward for every ``z``, and one adjoint for every
# relevance. Where the input has no negative entry (after a ReLU) the ``x-`` half is
# exactly zero and dropped. The module's own output comes from the same op, its weight
# one more row block (``[w, w]`` on ``[x+, x-]``): the same products, summed in another
# order where the input has both signs (a difference in the last bits, as between two
# convolution algorithms; tests compare with the unfused rule in ulps).
#
# On the benchmarks' CNN (z+ on both convolutions, batch 64) this and the one-op adjoints
# took lrp from 2.0x to 1.2x a plain gradient: on the CPU a small convolution costs about
# the same with 8 or 16 output channels. It is used on the chain walk (NOTE [lrp on a chain]), which runs eagerly;
# the taps path keeps `AlphaBeta.relevance`, and tests check that both agree.
# Grouped convolutions take the rule's own path (stacked channels would cross groups).

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._types import Pullback
from . import rules as _lrp_rules
from .affine import Affine
from .rules import AlphaBeta, Rule, divide_stabilized
from .stack_cache import StackCache

__all__ = ["fused"]


def _clamped(t: torch.Tensor | None, *, positive: bool) -> torch.Tensor | None:
    if t is None:
        return None
    return t.clamp(min=0) if positive else t.clamp(max=0)


@dataclass(frozen=True)
class _Stacked:
    """The stacked weights of NOTE [fused alpha-beta] for one module, rule and input sign."""

    weight: torch.Tensor  # every row block: the module's own, then each half's z
    bias: torch.Tensor | None
    back: torch.Tensor  # the halves' blocks, whose adjoint takes their shares to the stacked inputs
    coefficients: tuple[float, ...]  # alpha, -beta (of the halves that run)


def _stack(rule: AlphaBeta, affine: Affine, weight: torch.Tensor, bias: torch.Tensor | None,
           signed: bool) -> _Stacked:
    """The weights for inputs ``[x+, x-]`` (``signed``) or ``x`` (no negative entry)."""
    pos_w, neg_w = weight.clamp(min=0), weight.clamp(max=0)
    # (coefficient, weight on x+, weight on x-, bias) of each half: alpha's by w+ x+ + w- x- + b+, beta's mirrored
    halves = [(rule.alpha, pos_w, neg_w, _clamped(bias, positive=True))]
    if rule.beta:
        halves.append((-rule.beta, neg_w, pos_w, _clamped(bias, positive=False)))
    if signed:
        back = torch.cat([torch.cat([w_pos, w_neg], 1) for _, w_pos, w_neg, _ in halves])
        stacked = torch.cat([torch.cat([weight, weight], 1), back])
    else:
        back = torch.cat([w for _, w, _, _ in halves])
        stacked = torch.cat([weight, back])
    biases = None if bias is None else torch.cat([bias, *(b for *_, b in halves if b is not None)])
    return _Stacked(stacked, biases, back, tuple(c for c, *_ in halves))


def fused(rule: Rule, affine: Affine, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          stacks: StackCache | None = None) -> tuple[torch.Tensor, Pullback] | None:
    """The module's output and the rule's pullback by NOTE [fused alpha-beta]; ``None`` where it does not apply.

    ``stacks``: the planned link's stacked weights of earlier calls (NOTE [stacked weights kept]).
    """
    dim, rows = affine.channel_dim, weight.shape[0]
    if type(rule) is not AlphaBeta or affine.groups != 1 or x.dim() < -dim or x.shape[dim] != weight.shape[1]:
        return None  # (an input that does not fit: the module's own op names it, not the stacked weights)
    signed = not _lrp_rules._no_negative_entry(x)  # (the rules' own check, one reduction)
    if stacks is None:
        stacked = _stack(rule, affine, weight, bias, signed)
    else:
        stacked = stacks.get(weight, bias, signed, lambda: _stack(rule, affine, weight, bias, signed))
    if signed:
        pos, neg = x.clamp(min=0), x.clamp(max=0)
        inputs = torch.cat([pos, neg], dim)
    else:
        inputs = x
    both = affine.run(inputs, stacked.weight, stacked.bias)
    y, *zs = (both.narrow(dim, i * rows, rows) for i in range(len(stacked.coefficients) + 1))
    adjoint = affine.pullback(stacked.back, inputs.shape, both.shape)  # (the shares' planes are both's)

    def pull(relevance: torch.Tensor) -> torch.Tensor:
        # (each share and the adjoint's product are tensors of their own: scaled in place, the same bits)
        shares = [divide_stabilized(relevance, z, rule.stabilizer) for z in zs]
        shares = [s if c == 1 else s.mul_(c) for c, s in zip(stacked.coefficients, shares, strict=True)]
        g = adjoint(torch.cat(shares, dim) if len(shares) > 1 else shares[0])
        if not signed:
            return g.mul_(x) if g.shape == x.shape else x * g
        n = x.shape[dim]
        return pos * g.narrow(dim, 0, n) + neg * g.narrow(dim, n, n)

    return y, pull
