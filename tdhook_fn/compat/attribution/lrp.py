"""``LRP`` (``tdhook.attribution.lrp``): layer-wise relevance propagation by a rule mapper.

Differences from tdhook 0.1.3 are listed in ``docs/compat.md``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, cast

from tensordict import NestedKey, TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictModuleBase
from torch import nn

from tdhook_fn import attribution
from tdhook_fn.attribution import lrp, rule_taps
from tdhook_fn.compat.modules._hooked import RoutedModule

from .gradient_helpers import GradientAttribution
from .gradient_helpers.common import AttributionCall, UserFn, inherited
from .lrp_helpers.rules import Rule

__all__ = ["LRP"]

_ByModule = dict[int, attribution.Rule]


def _as_rule(rule: Any, name: str) -> attribution.Rule:
    if isinstance(rule, Rule):
        return rule.rule()
    if callable(getattr(rule, "relevance", None)):
        return cast(attribution.Rule, rule)
    raise TypeError(f"LRP: the rule mapper gave module {name!r} a {type(rule).__name__}; give a rule of "
                    "tdhook_fn.compat.attribution.lrp_helpers.rules or of tdhook_fn.attribution, or None")


class LRP(GradientAttribution):
    """Layer-wise relevance propagation (Bach et al. 2015) with per-module rules.

    Computed by `tdhook_fn.attribution.lrp` (the relevance put in at the targets is ones, or
    ``init_attr_grads``). Takes the arguments of `GradientAttribution`, and:

    Args:
        rule_mapper (Callable | None): ``(name, module) -> rule | None``, e.g. `EpsilonPlus`;
            a rule of ``lrp_helpers.rules`` or of `tdhook_fn.attribution`. Default: no rules.
        warn_on_missing_rule (bool): warn, on entering the context, for each module
            (containers included) without a rule that ``skip_modules`` does not skip.
            Default: ``True``.
        skip_modules (Callable | None): ``(name, module) -> bool``: modules not given to the
            rule mapper, e.g. `default_skip`. Default: none skipped.

    Raises:
        NotImplementedError: ``output_grad_callbacks`` are given.
        TypeError, ValueError: (on entering a context) the rule mapper returns something
            that is not a rule, a rule for a module outside the model, or rules that nest.
    """

    def __init__(
        self,
        use_inputs: bool = True,
        use_outputs: bool = True,
        input_modules: list[str] | None = None,
        target_modules: list[str] | None = None,
        init_attr_targets: UserFn | None = None,
        init_attr_inputs: UserFn | None = None,
        init_attr_cache_in: UserFn | None = None,
        init_attr_grads: UserFn | None = None,
        additional_init_keys: list[NestedKey] | None = None,
        output_grad_callbacks: dict[str, Callable[..., Any]] | None = None,
        attribution_key: Any = "attr",
        clean_intermediate_keys: bool = True,
        cache_callback: Callable[..., Any] | None = None,
        rule_mapper: Callable[[str, nn.Module], Any] | None = None,
        warn_on_missing_rule: bool = True,
        skip_modules: Callable[[str, nn.Module], bool] | None = None,
    ) -> None:
        if output_grad_callbacks:
            raise NotImplementedError("LRP: output_grad_callbacks are not supported: the rules replace the "
                                      "modules' backward; give the module a custom rule instead")
        super().__init__(**inherited(locals(), "rule_mapper", "warn_on_missing_rule", "skip_modules"))
        self._rule_mapper = rule_mapper or (lambda name, module: None)
        self._warn_on_missing_rule = warn_on_missing_rule
        self._skip_modules = skip_modules

    @staticmethod
    def default_skip(name: str, module: nn.Module) -> bool:
        """Skip the wrappers (``""``, ``"td_module"``, ``"module"``) and containers (``ModuleList``,
        ``Sequential``, ``TensorDictModule``)."""
        return name in ("", "td_module", "module") or isinstance(module, (nn.ModuleList, nn.Sequential,
                                                                          TensorDictModule))

    def _prepare_module(
        self, module: RoutedModule, in_keys: list[NestedKey], out_keys: list[NestedKey], extra_relative_path: str
    ) -> TensorDictModuleBase:
        model = module.model
        inside = {id(m) for m in model.modules()}
        chosen: _ByModule = {}
        for name, child in module.td_module.named_modules():  # tdhook's names: those of the wrapping module
            if self._skip_modules is not None and self._skip_modules(name, child):
                continue
            rule = self._rule_mapper(name, child)
            if rule is None:
                if self._warn_on_missing_rule:
                    warnings.warn(f"No rule found for module `{name}` ({type(child).__name__})", stacklevel=2)
                continue
            if id(child) not in inside:
                raise ValueError(f"LRP: the rule mapper gave a rule to {name!r} ({type(child).__name__}), which is "
                                 "a wrapper around the model, not a module of it; give rules to the model's modules")
            chosen[id(child)] = _as_rule(rule, name)
        rule_taps(module.functional(), self._mapper(chosen), warn_on_missing_rule=False)  # nesting fails now
        # the rules chosen now live in this context's prepared module, never on the factory
        return self._attributing(module, in_keys, out_keys, functools.partial(self._attribute_with, chosen))

    @staticmethod
    def _mapper(chosen: _ByModule) -> Callable[[str, nn.Module], attribution.Rule | None]:
        return lambda name, module: chosen.get(id(module))

    def _attribute_with(self, chosen: _ByModule, call: AttributionCall, td: TensorDict) -> TensorDictBase:
        options = call.options()
        options.pop("grad_fns")
        options["taps"] = (*call.taps, *call.hooks)  # (LRP's own backward: tdhook's output_grad_callbacks do not apply)
        return lrp(
            call.f, call.params, call.inputs, rules=self._mapper(chosen), layers=call.layers,
            use_inputs=call.use_inputs, input_keys=call.input_keys, warn_on_missing_rule=False, **options,
        )

    def _grad_attr(self, grads: TensorDict, inputs: TensorDict) -> TensorDict:
        """The gradients are the relevances: returned as they are."""
        return grads
