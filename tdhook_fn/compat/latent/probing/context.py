"""``Probing`` and the ``Probe`` protocol of ``tdhook.latent.probing.context`` (tdhook 0.1.3).

On entering the context, ``probe_factory(name, direction)`` is called once per module
whose name matches ``key_pattern`` and per direction, in tdhook's order (directions,
then modules as ``named_modules`` lists them). Each call of the hooked module then
hands each probe the module's value in its direction, ``probe.step(value, **items)``,
where ``items`` are the ``additional_keys`` entries of the input TensorDict (tdhook
passes ``labels`` and ``step_type`` this way). The probes are called from reading
hooks recorded as *virtual* hooks of the hooked module (see `tdhook_fn.compat.modules`):
they fire on the private shadow each call runs on; the model never carries a hook and
is left as it was, after an exception too. No number is computed here: the values are
the model's own, the probes (for the compat estimators, pure functions of
`tdhook_fn.latent`) do the maths.

Differences from tdhook 0.1.3 are listed in ``docs/compat.md``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import nn

from tdhook_fn.compat.contexts import HookingContextFactory
from tdhook_fn.compat.hooks import (
    DIRECTION_TO_RETURN,
    HookDirection,
    HookFactory,
    MultiHookHandle,
    MultiHookManager,
    RemovableHandleProtocol,
)
from tdhook_fn.compat.modules import HookedModule
from tdhook_fn.compat.modules._scope import module_path

from .._key_pattern import KeyPatternHooks, register_all

__all__ = ["Probe", "Probing"]

class _Items:
    """The ``additional_keys`` entries of the last call, per thread.

    Threads calling one hooked module at once each see their own call's items. A
    backward hook run by an autograd worker thread (on an accelerator) sees the last
    items of any thread, as every hook does in tdhook.
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self._latest: TensorDictBase | None = None

    def keep(self, items: TensorDictBase) -> None:
        self._local.items = self._latest = items

    def last(self) -> TensorDictBase | dict[str, Any]:
        found = getattr(self._local, "items", None)
        found = self._latest if found is None else found
        return {} if found is None else found


class Probe(Protocol):
    """What `Probing` calls: ``step(value, **items)`` once per module, direction and call."""

    def step(self, data: Any, **kwargs: Any) -> Any: ...


class Probing(KeyPatternHooks, HookingContextFactory):
    """Probing the activations of the modules whose name matches a pattern.

    Linear probes (Alain and Bengio, 2018) and concept activation vectors (Kim et al.,
    2018): each matching module's value goes to a probe made for it.

    Args:
        key_pattern (str): a regular expression matched (``re.match``, so a prefix) against
            module names.
        probe_factory (Callable[[str, str], Probe]): ``(name, direction) -> probe``, called
            on entering the context for each matching module and direction.
        relative (bool): names relative to the model (``"linear2"``); ``False``: to the
            hooked module (``"td_module.module.linear2"``). Default: ``True``.
        directions (list[str] | None): among ``"fwd"``, ``"bwd"``, ``"fwd_pre"``,
            ``"bwd_pre"``, ``"fwd_kwargs"``, ``"fwd_pre_kwargs"``; the probe gets the
            output, ``grad_input``, ``args`` or ``grad_output``. Default: ``["fwd"]``.
        additional_keys (list[str] | None): entries of the input TensorDict passed to every
            ``step`` as keyword arguments (e.g. ``["labels", "step_type"]``).
        classes_to_hook (list[type] | None): only modules of these classes. Default:
            ``nn.Module``.
        classes_to_skip (list[type] | None): never modules of these classes. Default:
            ``nn.ModuleList``, ``nn.Sequential`` and TensorDict modules.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> class Seen:
        ...     def step(self, data, **kwargs):
        ...         print(tuple(data.shape), sorted(kwargs))
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
        >>> with Probing("0", lambda name, direction: Seen(), additional_keys=["labels"]).prepare(net) as hooked:
        ...     _ = hooked(TensorDict(input=torch.randn(2, 3), labels=torch.zeros(2), batch_size=[2]))
        (2, 4) ['labels']
    """

    default_classes_to_hook: tuple[type[nn.Module], ...] = (nn.Module,)
    default_classes_to_skip: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.Sequential, TensorDictModuleBase)

    def __init__(
        self,
        key_pattern: str,
        probe_factory: Callable[[str, str], Probe],
        relative: bool = True,
        directions: list[HookDirection] | None = None,
        additional_keys: list[str] | None = None,
        classes_to_hook: list[type[nn.Module]] | None = None,
        classes_to_skip: list[type[nn.Module]] | None = None,
    ) -> None:
        super().__init__()
        self._key_pattern = key_pattern
        hook = tuple(classes_to_hook or self.default_classes_to_hook)
        skip = tuple(classes_to_skip or self.default_classes_to_skip)
        self._hook_manager = MultiHookManager(key_pattern, hook, skip)  # holds the compiled pattern
        self._relative = relative
        self._probe_factory = probe_factory
        self._directions: list[HookDirection] = list(directions or ["fwd"])
        self._additional_keys = additional_keys

    def _items_reader(self, module: HookedModule) -> tuple[RemovableHandleProtocol, _Items]:
        """A hook keeping the input TensorDict's ``additional_keys`` entries before each call."""
        keys = list(self._additional_keys or ())
        wrapper = getattr(module.hooking_context, "_module", None)
        path = module_path(module, wrapper) if isinstance(wrapper, nn.Module) else None
        if path is None:
            raise TypeError(
                "Probing: additional_keys are read from the input TensorDict of the context's module; prepare the "
                "Probing context with .prepare(model) and call the hooked module it yields"
            )
        items = _Items()

        def select(**kwargs: Any) -> None:
            td = kwargs["args"][0]
            present = td.keys(include_nested=True)  # (a nested key selects its top entry, as in tdhook)
            missing = [key for key in keys if key not in present]
            if missing:
                raise KeyError(
                    f"Probing: additional_keys {missing} are not in the input TensorDict (it holds "
                    f"{sorted(map(str, present))}); add them to the TensorDict or drop them from additional_keys"
                )
            items.keep(td.select(*keys))

        hook = HookFactory.make_reading_hook(callback=select, direction="fwd_pre")
        return module.register_submodule_hook(path, hook, "fwd_pre", relative=False), items

    def _reading_hook(self, name: str, direction: HookDirection, items: _Items | None) -> Callable[..., Any]:
        probe = self._probe_factory(name, direction)
        value_name = DIRECTION_TO_RETURN[direction]

        def callback(**kwargs: Any) -> Any:
            extra = items.last() if items is not None else {}
            return probe.step(kwargs[value_name], **extra)

        return HookFactory.make_reading_hook(callback=callback, direction=direction)

    def _hook_module(self, module: HookedModule) -> MultiHookHandle:
        handles: list[RemovableHandleProtocol] = []
        items = None
        if self._additional_keys is not None:
            handle, items = self._items_reader(module)
            handles.append(handle)

        def hooks() -> Iterator[tuple[nn.Module, Callable[..., Any], HookDirection]]:
            selected = self._selected(module)
            for direction in self._directions:
                for name, submodule in selected:
                    hook = self._reading_hook(name, direction, items)
                    if not isinstance(submodule, (nn.ModuleList, nn.ModuleDict)):
                        yield submodule, hook, direction  # (a container never runs: its probe exists, as in tdhook)

        return register_all(module, hooks(), handles)
