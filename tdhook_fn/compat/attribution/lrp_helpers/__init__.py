"""``tdhook.attribution.lrp_helpers``: tdhook's LRP rule classes, the ``Sum`` layer and module types."""

from . import layers, rules, types

__all__ = ["layers", "rules", "types"]
