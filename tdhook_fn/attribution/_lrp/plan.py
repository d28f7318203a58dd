"""What lrp works out about a model and its rules once (NOTE [plans per model]): the rules, and the walk."""

from __future__ import annotations

import functools
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, cast

from torch import nn

from ..._model_plans import plan_for
from ..._params import check_attribution_modes
from . import rules as _lrp_rules
from .composites import EpsilonPlus, Resolved, Rules, resolve_rules, warn_missing
from .model_chain import Link, model_chain

__all__ = ["LrpPlan", "ModesChecked", "lrp_plan"]


@dataclass
class ModesChecked:
    """A plan that asks once whether the model's modes are fit for an attribution (the plan's snapshot sees a
    mode change)."""

    modes_checked: bool = field(default=False, kw_only=True)

    def check_modes(self, model: nn.Module, caller: str) -> None:
        if not self.modes_checked:
            check_attribution_modes(model, caller)
            self.modes_checked = True


@dataclass
class LrpPlan(ModesChecked):
    """The rule at each module (``ruled``), and the chain the walk runs (``links``; ``None``: not a chain)."""

    ruled: Resolved
    links: list[Link] | None
    walk: Any = None  # what `chain` plans of the links, made there at the first walk


def _scalar_fields(value: Any) -> bool:
    """A rule or composite of this package whose fields are plain numbers: a value, held safely by a plan."""
    names = _field_names(cast(Hashable, type(value)))
    return names is not None and all(isinstance(getattr(value, name), (int, float, type(None))) for name in names)


@functools.lru_cache(maxsize=64)
def _field_names(cls: Any) -> tuple[str, ...] | None:
    """The fields of a dataclass of this package's rules or composites; ``None`` for any other class."""
    if cls.__module__ not in (_lrp_rules.__name__, EpsilonPlus.__module__) or not is_dataclass(cls):
        return None
    return tuple(f.name for f in fields(cls))


def _rules_key(rules: Rules) -> Hashable | None:
    """``rules`` as part of a plan's key, where they are a value; ``None``: the rules decide anew at each call.

    A mapping of paths, patterns and classes to this package's rules, or `EpsilonPlus`
    (without a ``rule_mapper``): their answers depend on the model alone. Any other
    callable may answer differently at each call, and is asked at each call.
    """
    if type(rules) is EpsilonPlus:  # (its fields' numbers as the key: a tuple of them hashes and compares in C)
        epsilon, stabilizer = rules.epsilon, rules.stabilizer
        if rules.rule_mapper is None and isinstance(epsilon, (int, float)) and isinstance(stabilizer, (int, float)):
            return ("composite", epsilon, stabilizer)
        return None
    if isinstance(rules, Mapping):
        items = tuple(rules.items())
        if all(isinstance(k, (str, type)) and _scalar_fields(r) for k, r in items):
            return ("mapping", items)
    return None


def _rule_on_root_or_below(links: list[Link], ruled: Resolved) -> bool:
    """A rule on the root, or inside a link (a non-Sequential block) where the walk would not see it."""
    by_module = ruled.by_module
    return any(id(m) in by_module for _, link in links if link._modules for m in link.modules() if m is not link)


def _build(model: nn.Module, rules: Rules) -> LrpPlan:
    ruled = resolve_rules(model, rules, warn_on_missing_rule=False)
    by_module = ruled.by_module
    links = None if id(model) in by_module else model_chain(model, lambda _name, module: id(module) in by_module)
    if links is not None and _rule_on_root_or_below(links, ruled):
        links = None
    return LrpPlan(ruled, links)


def lrp_plan(model: nn.Module, rules: Rules, *, warn_on_missing_rule: bool) -> LrpPlan:
    """The plan of ``model`` under ``rules``, from the cache where the rules are a value; warns as asked.

    Raises what `resolve_rules` raises.
    """
    key = _rules_key(rules)
    plan = _build(model, rules) if key is None else plan_for(model, ("lrp", key), lambda: _build(model, rules))
    if warn_on_missing_rule:
        warn_missing(plan.ruled, "lrp", stacklevel=3)
    return plan
