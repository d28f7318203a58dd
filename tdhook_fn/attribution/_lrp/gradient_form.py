"""A gradient-form rule (NOTE [gradient-form rules]) as the chain walk applies it, read off the rule once."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, cast

import torch

from .rules import Rule

__all__ = ["NO_RULE", "GradientForm", "gradient_form"]


@dataclass(frozen=True)
class GradientForm:
    """``R_in = [x *] J^T (R / share)`` (``divides``) or ``J^T (R * share)``, ``share(path, n_inputs, output)``.

    ``share`` ``None``: no output factor (a module without a rule: its plain gradient).
    """

    share: Callable[..., torch.Tensor] | None
    divides: bool
    scales_inputs: bool


NO_RULE = GradientForm(None, False, False)


def gradient_form(rule: Rule | None) -> GradientForm | None:
    """How the walk applies ``rule`` (`NO_RULE` for none); ``None`` where it is not of the gradient form."""
    if rule is None:
        return NO_RULE
    output_factor = getattr(rule, "output_factor", None)
    if not callable(output_factor):
        return None
    scales = bool(getattr(rule, "scales_inputs", False))
    divisor = _divisor(rule)  # one division in the walk, not 1 / d and a product
    return GradientForm(output_factor, False, scales) if divisor is None else GradientForm(divisor, True, scales)


def _divisor(rule: Any) -> Callable[..., torch.Tensor] | None:
    """``rule.output_divisor`` where its ``output_factor`` is the one defined with it (a subclass may change one)."""
    divisor = getattr(rule, "output_divisor", None)
    if not callable(divisor):
        return None
    together = _defined_together(cast(Hashable, type(rule)))
    return cast(Callable[..., torch.Tensor], divisor) if together else None


@functools.lru_cache(maxsize=256)  # a fact about a class, asked per layer per call on the shadow
def _defined_together(cls: Any) -> bool:
    """Whether ``cls`` takes ``output_divisor`` and ``output_factor`` from the same class of its MRO."""
    owners = [next((c for c in cls.__mro__ if name in c.__dict__), None)
              for name in ("output_divisor", "output_factor")]
    return owners[0] is owners[1]
