"""``tdhook.attribution.lrp_helpers.rules``: tdhook's rule classes and composites, as tdhook_fn rules.

Each rule class takes tdhook's arguments and defaults and stands for a rule of
`tdhook_fn.attribution` (`Rule.rule`); differences are listed in ``docs/compat.md``.

Examples:
    >>> import torch
    >>> EpsilonPlus()("0", torch.nn.Conv2d(1, 2, 3)).rule()
    AlphaBeta(alpha=1.0, beta=0.0, stabilizer=1e-06)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, cast

import torch
from torch import nn

from tdhook_fn import attribution

from ._registration import RemovableRuleHandle, raise_for_unconserved_rel_factory, register_rule, unregister_rule
from .layers import Sum
from .types import BatchNorm, Linear

__all__ = [
    "AHQKVRule",
    "AlphaBetaRule",
    "BaseRuleMapper",
    "EpsilonPlus",
    "EpsilonRule",
    "FlatRule",
    "IgnoreRule",
    "LayerNormRule",
    "PassRule",
    "PseudoIdentityRule",
    "RemovableRuleHandle",
    "Rule",
    "SoftmaxEpsilonRule",
    "StopRule",
    "UniformEpsilonRule",
    "UniformRule",
    "WSquareRule",
    "raise_for_unconserved_rel_factory",
    "stabilize",
]

RuleMapper = Callable[[str, nn.Module], Any]


def stabilize(tensor: torch.Tensor, epsilon: float = 1e-6) -> torch.Tensor:
    """``tensor`` moved ``epsilon`` away from zero, zero counting as positive (`tdhook_fn.attribution.stabilize`)."""
    return attribution.stabilize(tensor, epsilon)


class Rule:
    """Base of tdhook's rule classes: tdhook's arguments for one tdhook_fn rule, its ``_core`` class.

    Examples:
        >>> import torch
        >>> layer = torch.nn.Linear(3, 2, bias=False)
        >>> handle = EpsilonRule(1e-9).register(layer)
        >>> x = torch.tensor([1.0, -2.0, 0.5], requires_grad=True)
        >>> layer(x).backward(torch.tensor([0.3, 0.7]))
        >>> round(x.grad.sum().item(), 4)  # conserved: LRP-0 without a bias
        1.0
        >>> handle.remove()
    """

    # the tdhook_fn rule (a dataclass) this class stands for; its fields are read from this object's attributes
    _core: ClassVar[type[Any] | None] = None
    _one_input: ClassVar[bool] = False  # tdhook raises NotImplementedError for a module called with more

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        """Put this rule on ``module`` (one at a time) until the handle is removed (NOTE [registered rules]);
        TypeError: no ``nn.Module``, or no tdhook_fn rule; ValueError: ``module`` already has a rule."""
        return register_rule(self, module)

    def unregister(self, module: nn.Module) -> None:
        """Take this rule off ``module``; ValueError when it is not registered there."""
        unregister_rule(self, module)

    def _check_call(self, args: tuple[Any, ...], output: Any) -> None:
        """Raise tdhook's error where a registered module's call does not fit this rule."""
        if self._one_input and len(args) != 1:
            raise NotImplementedError(f"{type(self).__name__} does not support multiple inputs: the module was "
                                      f"called with {len(args)} positional arguments; register it on a module called "
                                      "with one")

    def rule(self) -> attribution.Rule:
        """The `tdhook_fn.attribution` rule this object stands for, with its current settings."""
        if self._core is None:
            raise TypeError(f"{type(self).__name__} stands for no tdhook_fn rule: tdhook_fn runs rules as modified "
                            "VJPs, not as autograd Functions with forward/backward; return an object with a "
                            "relevance(call, grad) method (see tdhook_fn.attribution.Rule) from the rule mapper")
        settings = {field.name: getattr(self, field.name) for field in dataclasses.fields(self._core)}
        return cast(attribution.Rule, self._core(**settings))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


class EpsilonRule(Rule):
    """LRP-epsilon: `tdhook_fn.attribution.Epsilon`. ``epsilon`` may be changed later."""

    _core: ClassVar[type[Any] | None] = attribution.Epsilon

    def __init__(self, epsilon: float = 1e-6) -> None:
        self.epsilon = epsilon


class UniformEpsilonRule(EpsilonRule):
    """LRP-epsilon split over the inputs: `tdhook_fn.attribution.UniformEpsilon`."""

    _core = attribution.UniformEpsilon


class SoftmaxEpsilonRule(EpsilonRule):
    """LXT's softmax rule: `tdhook_fn.attribution.SoftmaxEpsilon` (``epsilon`` unused, as in tdhook)."""

    _core = attribution.SoftmaxEpsilon


class PassRule(Rule):
    """Relevance passes unchanged: `tdhook_fn.attribution.Pass` (one input, of the output's shape)."""

    _core, _one_input = attribution.Pass, True

    def _check_call(self, args: tuple[Any, ...], output: Any) -> None:
        outputs = output if isinstance(output, tuple) else (output,)
        if len(args) != len(outputs):
            raise ValueError(f"PassRule requires the number of inputs and outputs to be the same, got {len(args)} "
                             f"inputs and {len(outputs)} outputs")
        for index, (i, o) in enumerate(zip(args, outputs, strict=True)):
            if getattr(i, "shape", None) != getattr(o, "shape", None):
                raise ValueError(f"Input (shape={getattr(i, 'shape', None)}) and output "
                                 f"(shape={getattr(o, 'shape', None)}) have different shapes at index {index}")
        super()._check_call(args, output)


class IgnoreRule(Rule):
    """The module's plain gradient: `tdhook_fn.attribution.Ignore`; registering it changes nothing."""

    _core = attribution.Ignore

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        """Nothing to put on ``module`` (its plain gradient is the rule); a handle all the same."""
        return RemovableRuleHandle(self, module)

    def unregister(self, module: nn.Module) -> None:
        """Nothing to take off ``module``."""


class StopRule(Rule):
    """No relevance goes back: `tdhook_fn.attribution.Stop`."""

    _core = attribution.Stop


class UniformRule(Rule):
    """The output relevance split evenly over the inputs: `tdhook_fn.attribution.Uniform`."""

    _core = attribution.Uniform


class WSquareRule(Rule):
    """LRP-w²: `tdhook_fn.attribution.WSquare`."""

    _core = attribution.WSquare

    def __init__(self, stabilizer: float = 1e-6) -> None:
        self.stabilizer = stabilizer


class FlatRule(WSquareRule):
    """LRP-flat: `tdhook_fn.attribution.Flat`."""

    _core = attribution.Flat


class AlphaBetaRule(Rule):
    """LRP-alpha-beta: `tdhook_fn.attribution.AlphaBeta`; ``alpha=1, beta=0`` is z+.

    Raises:
        ValueError: ``alpha`` or ``beta`` is negative, or ``alpha - beta != 1``.
    """

    _core, _one_input = attribution.AlphaBeta, True

    def __init__(self, alpha: float = 2.0, beta: float = 1.0, stabilizer: float = 1e-6) -> None:
        if alpha < 0 or beta < 0:  # tdhook's messages; the core's own check follows
            raise ValueError(f"AlphaBetaRule: Both alpha and beta parameters must be non-negative, got alpha={alpha}, "
                             f"beta={beta}")
        if alpha - beta != 1.0:
            raise ValueError(f"AlphaBetaRule: The difference of parameters alpha - beta must equal 1, got "
                             f"alpha={alpha}, beta={beta}")
        self.alpha, self.beta, self.stabilizer = alpha, beta, stabilizer
        self.rule()


class LayerNormRule(Rule):
    """LXT's layer-norm rule: `tdhook_fn.attribution.LayerNorm`."""

    _core, _one_input = attribution.LayerNorm, True


class PseudoIdentityRule(Rule):
    """An activation as a rescaled identity: `tdhook_fn.attribution.PseudoIdentity`."""

    _core, _one_input = attribution.PseudoIdentity, True

    def __init__(self, stabilizer: float = 1e-6) -> None:
        self.stabilizer = stabilizer


class AHQKVRule(Rule):
    """LXT's rule for a fused q/k/v projection: `tdhook_fn.attribution.AHQKV`."""

    _core = attribution.AHQKV


# the tdhook rule class standing for each rule the composite below answers
_TDHOOK_RULE: dict[type[Any], type[Rule]] = {cls._core: cls for cls in (EpsilonRule, AlphaBetaRule, PassRule,
                                                                         IgnoreRule) if cls._core is not None}


class BaseRuleMapper:
    """A rule mapper ``(name, module) -> rule | None``: the rules of `tdhook_fn.attribution.EpsilonPlus`
    but its dense layers', as tdhook's rule objects (and `EpsilonRule` ``(stabilizer)`` at `Sum`).

    Args:
        stabilizer (float): epsilon of the sum and average-pooling rule. Default: ``1e-6``.
        rule_mapper (Callable | None): asked first; its non-``None`` answers win.
    """

    def __init__(self, stabilizer: float = 1e-6, rule_mapper: RuleMapper | None = None) -> None:
        self._stabilizer = stabilizer
        self._rule_mapper = rule_mapper or (lambda name, module: None)
        self._composite = attribution.EpsilonPlus(stabilizer=stabilizer, rule_mapper=self._tdhook_layers)
        # one tdhook rule object per rule of the composite (as tdhook's mappers hold theirs), keyed by the rule's
        # value: the pure rules are frozen dataclasses, and a rule made at each question gets the same object
        self._shared: dict[attribution.Rule, Rule] = {}

    def _tdhook_layers(self, name: str, module: nn.Module) -> attribution.Rule | None:
        """The rules of the layers tdhook's composites know and the core's do not (`Sum`, FrozenBatchNorm2d)."""
        if isinstance(module, Sum):
            return attribution.Epsilon(self._stabilizer)
        return attribution.Pass() if isinstance(module, BatchNorm) else None

    def _answer(self, name: str, module: nn.Module) -> Rule | None:
        """The composite's rule for ``module``, as a tdhook rule object."""
        rule = self._composite(name, module)
        if rule is None:
            return None
        if rule not in self._shared:
            self._shared[rule] = _TDHOOK_RULE[type(rule)](**vars(rule))
        return self._shared[rule]

    def _call(self, name: str, module: nn.Module) -> Any:
        return None if isinstance(module, Linear) else self._answer(name, module)

    def __call__(self, name: str, module: nn.Module) -> Any:
        rule = self._rule_mapper(name, module)
        return self._call(name, module) if rule is None else rule


class EpsilonPlus(BaseRuleMapper):
    """The composite of `tdhook_fn.attribution.EpsilonPlus` as tdhook's rule objects, plus the epsilon rule at ``Sum``.

    Args:
        epsilon (float): of the linear layers' epsilon rule. Default: ``1e-6``.
        stabilizer (float): of z+, average pooling and ``Sum``. Default: ``1e-6``.
        rule_mapper (Callable | None): asked first; its non-``None`` answers win.
    """

    def __init__(self, epsilon: float = 1e-6, stabilizer: float = 1e-6, rule_mapper: RuleMapper | None = None) -> None:
        super().__init__(stabilizer, rule_mapper)
        self._composite = attribution.EpsilonPlus(epsilon, stabilizer, self._tdhook_layers)

    def _call(self, name: str, module: nn.Module) -> Any:
        return self._answer(name, module)
