"""Which LRP rule runs at which module: mappings, patterns, classes, and composites."""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..._paths import PathError, name_to_path, resolve_path
from .rules import AlphaBeta, Epsilon, Ignore, Pass, Rule

__all__ = ["ACTIVATIONS", "AVG_POOLS", "BATCH_NORMS", "CONVOLUTIONS", "MAX_POOLS", "TRANSPOSED_CONVOLUTIONS",
           "EpsilonPlus", "Resolved", "RuleMapper", "Rules", "resolve_rules", "warn_missing"]

RuleMapper = Callable[[str, nn.Module], Rule | None]
Rules = Mapping[str | type[nn.Module], Rule] | RuleMapper

ACTIVATIONS: tuple[type[nn.Module], ...] = (
    nn.ELU, nn.Hardshrink, nn.Hardsigmoid, nn.Hardtanh, nn.Hardswish, nn.LeakyReLU, nn.LogSigmoid, nn.PReLU,
    nn.ReLU, nn.ReLU6, nn.RReLU, nn.SELU, nn.CELU, nn.GELU, nn.Sigmoid, nn.SiLU, nn.Softplus, nn.Softshrink,
    nn.Softsign, nn.Tanh, nn.Tanhshrink, nn.Threshold,
)
# the groups of torch.nn classes the composites give rules to (compat's ``lrp_helpers.types`` groups are these)
CONVOLUTIONS: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
TRANSPOSED_CONVOLUTIONS: tuple[type[nn.Module], ...] = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
BATCH_NORMS: tuple[type[nn.Module], ...] = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
AVG_POOLS: tuple[type[nn.Module], ...] = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d,
                                          nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)
MAX_POOLS: tuple[type[nn.Module], ...] = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d,
                                          nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)
_CONVS = (*CONVOLUTIONS, *TRANSPOSED_CONVOLUTIONS)
_PASSED = (*ACTIVATIONS, *BATCH_NORMS)
_PLAIN = (*MAX_POOLS, nn.Identity, nn.Dropout, nn.Flatten)


@dataclass(frozen=True)
class EpsilonPlus:
    """The composite EpsilonPlus, as tdhook defines it: a rule mapper ``(name, module) -> rule``.

    Convolutions get z+ (`AlphaBeta` ``(1, 0, stabilizer)``), ``nn.Linear``
    `Epsilon` ``(epsilon)``, activations and BatchNorm `Pass`, average pooling
    `Epsilon` ``(stabilizer)``; max pooling, dropout, flatten and identity
    `Ignore` (their plain gradient). Other modules get no rule.

    Args:
        epsilon (float): of the dense layers' epsilon rule. Default: ``1e-6``.
        stabilizer (float): of z+ and of average pooling. Default: ``1e-6``.
        rule_mapper (Callable | None): asked first; its non-``None`` answers win.
    """

    epsilon: float = 1e-6
    stabilizer: float = 1e-6
    rule_mapper: RuleMapper | None = None

    def __call__(self, name: str, module: nn.Module) -> Rule | None:
        rule = None if self.rule_mapper is None else self.rule_mapper(name, module)
        if rule is not None:
            return rule
        for classes, rule in self._by_class:
            if isinstance(module, classes):
                return rule
        return None

    @functools.cached_property
    def _by_class(self) -> tuple[tuple[tuple[type[nn.Module], ...], Rule], ...]:
        """The rules, made once per composite (asked once per module per call)."""
        return ((_CONVS, AlphaBeta(1.0, 0.0, self.stabilizer)), ((nn.Linear,), Epsilon(self.epsilon)),
                (_PASSED, Pass()), (_PLAIN, Ignore()), (AVG_POOLS, Epsilon(self.stabilizer)))


def _mapper(model: nn.Module, rules: Mapping[Any, Any], caller: str) -> RuleMapper:
    """A mapping as a mapper: exact paths first, then patterns (in order), then classes (in order)."""
    by_module: dict[int, Rule] = {}
    patterns: list[tuple[re.Pattern[str], Rule]] = []
    classes: list[tuple[type[nn.Module], Rule]] = []
    names = [name for name, _ in model.named_modules()]
    for key, rule in rules.items():
        if isinstance(key, type) and issubclass(key, nn.Module):
            classes.append((key, rule))
            continue
        if not isinstance(key, str):
            raise TypeError(f"{caller}: a rules key must be a path, a pattern or an nn.Module class, got {key!r}")
        try:
            found = resolve_path(model, key)
        except PathError:
            found = None
        if isinstance(found, nn.Module):
            by_module.setdefault(id(found), rule)
            continue
        try:
            pattern = re.compile(key)
        except re.error as e:
            raise ValueError(f"{caller}: rules key {key!r} is neither a submodule path nor a regex ({e})") from e
        if not any(pattern.fullmatch(name) for name in names):
            raise ValueError(f"{caller}: rules key {key!r} names no submodule (as a path or a pattern over "
                             f"module names such as {names[1:4]})")
        patterns.append((pattern, rule))

    def mapper(name: str, module: nn.Module) -> Rule | None:
        if id(module) in by_module:
            return by_module[id(module)]
        for pattern, rule in patterns:
            if pattern.fullmatch(name):
                return rule
        for cls, rule in classes:
            if isinstance(module, cls):
                return rule
        return None

    return mapper


class Resolved(dict[str, Rule]):
    """The rule of each ruled submodule by path; ``by_module`` gives ``(path, rule)`` by module identity."""

    def __init__(self) -> None:
        super().__init__()
        self.by_module: dict[int, tuple[str, Rule]] = {}
        self.missing: list[tuple[str, str]] = []  # (name, class name) of each leaf module without a rule


def warn_missing(resolved: Resolved, caller: str, stacklevel: int) -> None:
    """Warn for each leaf module without a rule (its plain gradient is used)."""
    for name, cls in resolved.missing:
        warnings.warn(f"{caller}: no rule for module {name!r} ({cls}); relevance goes through it by its plain "
                      "gradient", stacklevel=stacklevel + 1)


def resolve_rules(model: nn.Module, rules: Rules, *, warn_on_missing_rule: bool = True,
                  caller: str = "lrp") -> Resolved:
    """The rule of each submodule that has one (not `Ignore`), by path (and by module).

    Raises:
        TypeError: ``rules`` is neither a mapping nor a callable, or a rule has no
            ``relevance`` method.
        ValueError: a key names no submodule, or two ruled modules nest.
    """
    if isinstance(rules, Mapping):
        mapper = _mapper(model, rules, caller)
    elif callable(rules):
        mapper = rules
    else:
        raise TypeError(f"{caller}: rules must be a mapping or a callable (name, module) -> rule, got "
                        f"{type(rules).__name__}")
    found: dict[str, Rule] = {}
    modules: dict[str, nn.Module] = {}
    missing: list[tuple[str, str]] = []
    for name, module in model.named_modules():
        rule = mapper(name, module)
        if rule is None:
            if not any(True for _ in module.children()):
                missing.append((name, type(module).__name__))
            continue
        if not callable(getattr(rule, "relevance", None)):
            raise TypeError(f"{caller}: the rule for {name!r} is a {type(rule).__name__}, which has no relevance "
                            "method (see tdhook_fn.attribution.Epsilon)")
        if not isinstance(rule, Ignore):
            found[name], modules[name] = rule, module
    resolved = Resolved()
    resolved.missing = missing
    if warn_on_missing_rule:
        warn_missing(resolved, caller, stacklevel=3)
    nested = [(outer, inner) for inner in found if inner for outer in _ancestors(inner) if outer in found]
    if nested:
        outer, inner = nested[0]
        raise ValueError(f"{caller}: modules {outer or '<root>'!r} and {inner!r} both have a rule, and the second "
                         "runs inside the first; give rules to one of them only (the outer rule would hide the inner)")
    for name, rule in found.items():
        path = name_to_path(name)
        resolved[path] = rule
        resolved.by_module[id(modules[name])] = (path, rule)
    return resolved


def _ancestors(name: str) -> list[str]:
    """The module names above ``name``, the root (``""``) first: one lookup each, not a pass over all rules."""
    parts = name.split(".")
    return ["", *(".".join(parts[:i]) for i in range(1, len(parts)))]
