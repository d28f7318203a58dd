"""How each module on the LRP chain walk hands relevance back (NOTE [lrp on a chain]).

Each record keeps what its module's step saw in the forward; ``back(relevance)`` gives
the relevance of the module's input from that of its output. A record raises
`NotAChain` where the walk cannot give the taps' numbers (a tensor it reads was
written in place since), and the call takes the general path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._types import Pullback
from .affine import Affine
from .fused import fused
from .gradient_form import GradientForm
from .max_pool import to_maxima
from .module_call import ModuleCall
from .rules import Rule
from .stack_cache import StackCache

__all__ = ["AffineLocal", "Fused", "Local", "NotAChain", "Passed", "Pooled", "Record", "Reshaped", "Ruled",
           "affine_record"]

# (plain slotted dataclasses: a frozen one costs ~4x as much to make, and the walk makes one per module per call)


class NotAChain(Exception):
    """This call takes the general path (NOTE [lrp on a chain])."""


# NOTE [versions on the walk]
# A record leaves the walk for the general path (`NotAChain`) where a later module wrote
# in place a tensor it reads: each compares its tensors' versions with those it saw, inline
# (a helper and a generator cost more Python calls than the whole comparison).


@dataclass(slots=True, eq=False)
class Local:
    """A module's own Jacobian from ``x`` to ``y``; the relevance scaled by ``factor`` before, by ``x`` after."""

    x: torch.Tensor
    y: torch.Tensor
    factor: torch.Tensor | None
    scales_inputs: bool
    version: int

    def back(self, relevance: torch.Tensor) -> torch.Tensor:
        if self.y._version != self.version:  # NOTE [versions on the walk]
            raise NotAChain
        share = relevance if self.factor is None else relevance * self.factor
        (c,) = torch.autograd.grad(self.y, self.x, share, allow_unused=True, materialize_grads=True)
        return self.x.detach() * c if self.scales_inputs else c


@dataclass(slots=True, eq=False)
class Passed:
    """Pass: the relevance as it is, unless a later module wrote the output in place (the taps differ then)."""

    y: torch.Tensor
    version: int

    def back(self, relevance: torch.Tensor) -> torch.Tensor:
        if self.y._version != self.version:  # NOTE [versions on the walk]
            raise NotAChain
        return relevance


@dataclass(slots=True, eq=False)
class Ruled:
    """A rule's relevance on what its module saw; the tensors' versions as they were then."""

    rule: Rule
    call: ModuleCall
    versions: tuple[int, ...]

    def back(self, relevance: torch.Tensor) -> torch.Tensor:
        (x,), y = self.call.inputs, self.call.output
        if (x._version, y._version) != self.versions:  # NOTE [versions on the walk]
            raise NotAChain
        relevances = list(self.rule.relevance(self.call, relevance))
        if len(relevances) != 1:
            raise ValueError(f"{self.call.caller}: the rule at {self.call.path!r} returned {len(relevances)} "
                             "relevances for 1 input")
        return torch.zeros_like(x) if relevances[0] is None else relevances[0]


@dataclass(slots=True, eq=False)
class AffineLocal:
    """`Local` for a linear layer or a convolution: ``J^T`` is one op (NOTE [affine modules]).

    The rule's output divisor or factor (``form``) is asked in the backward, of the output
    ``y``: fewer tensors alive at once.
    """

    x: torch.Tensor
    y: torch.Tensor
    pullback: Pullback
    path: str
    form: GradientForm
    versions: tuple[int, int]

    def back(self, relevance: torch.Tensor) -> torch.Tensor:
        x, y = self.x, self.y
        if (x._version, y._version) != self.versions:  # NOTE [versions on the walk]
            raise NotAChain
        form = self.form
        if form.share is not None:
            by = form.share(self.path, 1, y)
            relevance = relevance / by if form.divides else relevance * by
        c = self.pullback(relevance)
        return x * c if form.scales_inputs else c


@dataclass(slots=True, eq=False)
class Fused:
    """A rule's relevance by a pullback prepared in the forward (NOTE [fused alpha-beta])."""

    pull: Pullback
    x: torch.Tensor
    y: torch.Tensor
    versions: tuple[int, ...]

    def back(self, relevance: torch.Tensor) -> torch.Tensor:
        if (self.x._version, self.y._version) != self.versions:  # NOTE [versions on the walk]
            raise NotAChain
        return self.pull(relevance)


@dataclass(slots=True, eq=False)
class Reshaped:
    """A flatten, unflatten or identity: the relevance reshaped back to the input's shape."""

    shape: torch.Size

    def back(self, relevance: torch.Tensor) -> torch.Tensor:
        return relevance.reshape(self.shape)


@dataclass(slots=True, eq=False)
class Pooled:
    """Max pooling: each window's relevance goes to the input its maximum came from, as its gradient does."""

    shape: torch.Size
    indices: torch.Tensor  # of each maximum, flat within its channel's input plane
    dims: int  # of the plane

    def back(self, relevance: torch.Tensor) -> torch.Tensor:
        return to_maxima(relevance, self.shape, self.indices, self.dims)


Record = Local | AffineLocal | Passed | Ruled | Fused | Reshaped | Pooled


def affine_record(affine: Affine, form: GradientForm | None, rule: Rule | None, path: str, x: torch.Tensor,
                  weight: torch.Tensor, bias: torch.Tensor | None, stacks: StackCache | None = None,
                  ) -> tuple[torch.Tensor, Record] | None:
    """A linear layer's or a convolution's output and record, without a graph: a gradient-form rule (``form``;
    `NO_RULE` for none) or fused alpha-beta; ``None`` where neither applies (the rule's own step). ``stacks``: see
    `fused`."""
    if form is None:
        done = None if rule is None else fused(rule, affine, x, weight, bias, stacks)
        if done is None:
            return None
        y, pull = done
        return y, Fused(pull, x, y, (x._version, y._version))
    y = affine.run(x, weight, bias)
    return y, AffineLocal(x, y, affine.pullback(weight, x.shape, y.shape), path, form, (x._version, y._version))
