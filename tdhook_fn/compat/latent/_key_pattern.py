"""What the factories hooking the modules a regex names share: the pattern and the names they see."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch import nn

from tdhook_fn import resolve_path
from tdhook_fn.compat.hooks import HookDirection, MultiHookHandle, MultiHookManager, RemovableHandleProtocol
from tdhook_fn.compat.hooks._registration import all_or_none
from tdhook_fn.compat.modules import HookedModule, RoutedModule
from tdhook_fn.compat.modules._scope import module_path

__all__ = ["KeyPatternHooks", "register_all"]


class KeyPatternHooks:
    """A settable ``key_pattern`` kept in step with the hook manager (set by the factory, with ``_relative``),
    and the modules it selects."""

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
        """The modules hooks may target, under tdhook's names (see ``relative`` of `ActivationCaching`)."""
        root = module._model()
        if self._relative:
            yield from _named_as_tdhook(resolve_path(root, getattr(module.hooking_context, "_extra_relative_path", "")))
        else:
            for name, submodule in _named_as_tdhook(root):
                yield ("td_module." + name if name else "td_module"), submodule

    def _selected(self, module: HookedModule) -> list[tuple[str, nn.Module]]:
        """The modules ``key_pattern`` selects, in ``named_modules`` order."""
        return [(name, sub) for name, sub in self._named(module) if self._hook_manager._selects(name, sub)]


def _named_as_tdhook(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``root.named_modules()`` with each `RoutedModule` folded into the module it routes: compat's wrapper,
    where tdhook has that module itself (a context over another's hooked module meets one)."""
    seen: set[int] = set()

    def walk(module: nn.Module, name: str) -> Iterator[tuple[str, nn.Module]]:
        while isinstance(module, RoutedModule):
            module = module.td_module
        if id(module) in seen:
            return
        seen.add(id(module))
        yield name, module
        for child_name, child in module._modules.items():
            if child is not None:
                yield from walk(child, f"{name}.{child_name}" if name else child_name)

    return walk(root, "")


def register_all(module: HookedModule, hooks: Iterable[tuple[nn.Module, Callable[..., Any], HookDirection]],
                 handles: list[RemovableHandleProtocol] | None = None) -> MultiHookHandle:
    """Registers each ``(submodule, hook, direction)`` as a virtual hook of ``module``, with ``handles``:
    all or none (`all_or_none`)."""
    def registering() -> Iterator[RemovableHandleProtocol]:
        for submodule, hook, direction in hooks:
            path = module_path(module, submodule)
            assert path is not None
            yield module.register_submodule_hook(path, hook, direction, relative=False)

    return all_or_none(registering(), handles)
