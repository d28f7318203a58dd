"""What the factories hooking the modules a regex names share: the pattern and the names they see."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from tdhook_fn import resolve_path
from tdhook_fn.compat.hooks import MultiHookManager
from tdhook_fn.compat.modules import HookedModule

__all__ = ["KeyPatternHooks"]


class KeyPatternHooks:
    """A settable ``key_pattern`` kept in step with the hook manager, and the modules it is matched against.

    The factory sets ``_key_pattern``, ``_hook_manager`` (which holds the compiled
    pattern) and ``_relative``.
    """

    _key_pattern: str
    _hook_manager: MultiHookManager
    _relative: bool

    @property
    def key_pattern(self) -> str:
        return self._key_pattern

    @key_pattern.setter
    def key_pattern(self, key_pattern: str) -> None:
        self._hook_manager.pattern = key_pattern
        self._key_pattern = key_pattern

    def _named(self, module: HookedModule) -> Iterator[tuple[str, nn.Module]]:
        """The modules hooks may target, under tdhook's names (see the factory's module docstring)."""
        context = module.hooking_context
        root = getattr(context, "_module", None)
        if not isinstance(root, nn.Module):
            root = module.td_module
        if self._relative:
            yield from resolve_path(root, getattr(context, "_extra_relative_path", "")).named_modules()
        else:
            for name, submodule in root.named_modules():
                yield ("td_module." + name if name else "td_module"), submodule
