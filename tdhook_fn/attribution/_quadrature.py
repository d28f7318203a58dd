"""Quadrature rules for integrated gradients, with captum's exact nodes and weights.

``riemann_*`` nodes are ``torch.linspace`` in the default float32 dtype, read back as
Python floats, and the weights ``1 / n`` (halved at both ends for the trapezoid), as in
captum 0.9. ``gausslegendre`` takes numpy's ``leggauss`` (numpy is a dependency of
tensordict) rescaled from ``[-1, 1]`` to ``[0, 1]``.
"""

from __future__ import annotations

import functools

import torch

from .._traced import trace_constant

__all__ = ["SUPPORTED_METHODS", "quadrature"]

SUPPORTED_METHODS = ("riemann_left", "riemann_right", "riemann_middle", "riemann_trapezoid", "gausslegendre")


def _riemann(method: str, n: int) -> tuple[list[float], list[float]]:
    weights = [1 / n] * n
    if method == "riemann_trapezoid":
        weights[0] /= 2
        weights[-1] /= 2
        nodes = torch.linspace(0, 1, n)
    elif method == "riemann_left":
        nodes = torch.linspace(0, 1 - 1 / n, n)
    elif method == "riemann_middle":
        nodes = torch.linspace(1 / (2 * n), 1 - 1 / (2 * n), n)
    else:
        nodes = torch.linspace(1 / n, 1, n)
    return nodes.tolist(), weights


def _gauss_legendre(n: int) -> tuple[list[float], list[float]]:
    import numpy as np

    points, weights = np.polynomial.legendre.leggauss(n)
    return (0.5 * (1 + points)).tolist(), (0.5 * weights).tolist()


def quadrature(method: str, n_steps: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Nodes ``alphas`` in ``[0, 1]`` and weights ``steps`` of a quadrature rule.

    Args:
        method (str): one of `SUPPORTED_METHODS`.
        n_steps (int): number of nodes; at least 2 for the Riemann rules, 1 for
            ``gausslegendre``.

    Returns:
        tuple: ``(alphas, steps)``, each ``n_steps`` floats.

    Raises:
        ValueError: unknown method (the supported ones are listed) or too few steps.

    Examples:
        >>> quadrature("riemann_trapezoid", 3)
        ((0.0, 0.5, 1.0), (0.16666666666666666, 0.3333333333333333, 0.16666666666666666))
    """
    if not isinstance(method, str) or method not in SUPPORTED_METHODS:
        raise ValueError(f"unknown integration method {method!r}; supported: {list(SUPPORTED_METHODS)}")
    least = 1 if method == "gausslegendre" else 2
    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < least:
        raise ValueError(f"n_steps must be an int >= {least} for {method!r}, got {n_steps!r}")
    return _nodes(method, n_steps)


@trace_constant  # Dynamo cannot trace numpy's leggauss: the rule is a constant of the trace
def _nodes(method: str, n_steps: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    return _cached_nodes(method, n_steps)


@functools.lru_cache(maxsize=64)
def _cached_nodes(method: str, n_steps: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    nodes, weights = _gauss_legendre(n_steps) if method == "gausslegendre" else _riemann(method, n_steps)
    return tuple(nodes), tuple(weights)
