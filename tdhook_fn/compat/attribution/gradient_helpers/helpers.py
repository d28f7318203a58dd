"""Integration rules of integrated gradients (``tdhook.attribution.gradient_helpers.helpers``).

The numbers come from `tdhook_fn.attribution.quadrature` (captum's nodes and weights).
"""

from __future__ import annotations

from collections.abc import Callable

from tdhook_fn.attribution import SUPPORTED_METHODS as _METHODS
from tdhook_fn.attribution import quadrature

__all__ = ["SUPPORTED_METHODS", "SUPPORTED_RIEMANN_METHODS", "approximation_parameters"]

SUPPORTED_METHODS: list[str] = list(_METHODS)
SUPPORTED_RIEMANN_METHODS: list[str] = [method for method in _METHODS if method.startswith("riemann_")]

StepsFn = Callable[[int], list[float]]


def approximation_parameters(method: str) -> tuple[StepsFn, StepsFn]:
    """``(step_sizes, alphas)`` of ``method`` as functions of ``n``: `tdhook_fn.attribution.quadrature`'s
    weights and nodes.

    Args:
        method (str): one of `SUPPORTED_METHODS`; ``ValueError`` now for another.

    Examples:
        >>> step_sizes, alphas = approximation_parameters("riemann_trapezoid")
        >>> alphas(3), step_sizes(3)
        ([0.0, 0.5, 1.0], [0.16666666666666666, 0.3333333333333333, 0.16666666666666666])
    """
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"Invalid integral approximation method name: {method}")

    def step_sizes(n: int) -> list[float]:
        return list(quadrature(method, n)[1])

    def alphas(n: int) -> list[float]:
        return list(quadrature(method, n)[0])

    return step_sizes, alphas
