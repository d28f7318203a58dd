"""Integration rules of integrated gradients (``tdhook.attribution.gradient_helpers.helpers``).

The numbers come from `tdhook_fn.attribution.quadrature` (captum's nodes and
weights). Unlike tdhook, too few steps raise ``ValueError`` rather than ``AssertionError``.
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
    """The step sizes and the alphas of ``method``, each as a function of ``n_steps``.

    Args:
        method (str): one of `SUPPORTED_METHODS`.

    Returns:
        tuple: ``(step_sizes, alphas)``; ``step_sizes(n)`` are the quadrature weights,
        ``alphas(n)`` the nodes in ``[0, 1]``.

    Raises:
        ValueError: unknown method (now), too few steps (when called).

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
