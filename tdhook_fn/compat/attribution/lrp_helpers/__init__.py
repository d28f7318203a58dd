"""``tdhook.attribution.lrp_helpers``: tdhook's LRP rule classes, the ``Sum`` layer and module types.

The rule classes stand for the rules of `tdhook_fn.attribution` (``EpsilonRule()``
is `tdhook_fn.attribution.Epsilon`); see `.rules`.
"""

from . import layers, rules, types

__all__ = ["layers", "rules", "types"]
