"""Base classes of gradient attributions (``tdhook.attribution.gradient_helpers``)."""

from .common import GradientAttribution, GradientAttributionWithBaseline

__all__ = ["GradientAttribution", "GradientAttributionWithBaseline"]
