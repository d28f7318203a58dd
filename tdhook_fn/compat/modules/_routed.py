"""The working module a context hands to ``_prepare_module``: the model, routed.

A RoutedModule also applies params transforms (see NOTE [params transforms] in
``_transforms.py``): methods give it other weights for its calls, never the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase, TensorDictModuleWrapper
from torch import nn

from tdhook_fn._functional import Functional, functional
from tdhook_fn._params import params as params_of
from tdhook_fn._paths import resolve_path
from tdhook_fn._taps import Tap

from ._transforms import ParamsTransform, active_transforms, replaced
from ._virtual import active_hooks, module_path, route, taps_for

__all__ = ["RoutedModule"]


class RoutedModule(TensorDictModuleWrapper):
    """Runs a context's TensorDictModule on the core, with the active virtual hooks.

    Behaves like the wrapped module (same ``in_keys``, ``out_keys``, attributes, and
    ``forward`` writing into the given TensorDict), but every call runs on a private
    shadow of it with the model's live tensors, so the model
    never carries a hook. Contexts give one to ``_prepare_module``; its methods give a
    method the model as a pure function at call time.

    Args:
        td_module (TensorDictModuleBase): the context's module: the user's
            TensorDictModule, or the TensorDictModule wrapping the user's ``nn.Module``.
        extra_relative_path (str): the path of the user's model inside ``td_module``
            (``"module"`` for a wrapped ``nn.Module``, ``""`` otherwise). Default: ``""``.
        params_transforms (Sequence[ParamsTransform]): applied to the params of every
            call, after the active ones. Default: none.
    """

    def __init__(
        self,
        td_module: TensorDictModuleBase,
        extra_relative_path: str = "",
        params_transforms: Sequence[ParamsTransform] = (),
    ) -> None:
        super().__init__(td_module)
        self._extra_relative_path = extra_relative_path
        self._params_transforms = tuple(params_transforms)
        self._forward_attributes = True

    # NOTE [working module attributes]
    # In tdhook a factory's ``_prepare_module`` and ``_restore_module`` both receive the
    # context's TensorDictModule, so ``setattr(module, "flag", 1)`` in one and
    # ``delattr(module, "flag")`` in the other act on that module, and the flag is visible
    # on it while the context is open. Here they receive this wrapper, so a public
    # attribute the wrapper does not own is written to (and deleted from) ``td_module``,
    # as reading one already falls through to it. Private names and the wrapper's own
    # attributes stay on the wrapper. The context puts back, on exit, whatever
    # ``_prepare_module`` changed on its TensorDictModule and ``_restore_module`` left
    # (see NOTE [prepared attributes] in ``tdhook_fn.compat.contexts``); the user's
    # ``nn.Module`` inside it is never written.

    def _forwards(self, name: str) -> bool:
        """Whether setting or deleting ``name`` acts on ``td_module`` (NOTE above)."""
        if name.startswith("_") or not self.__dict__.get("_forward_attributes", False):
            return False
        own = (self.__dict__, self._parameters, self._buffers, self._modules)
        return not any(name in names for names in own) and not hasattr(type(self), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if self._forwards(name):
            setattr(self.td_module, name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if self._forwards(name):
            delattr(self.td_module, name)
        else:
            super().__delattr__(name)

    def with_params_transform(self, transform: ParamsTransform) -> RoutedModule:
        """This routed module, whose calls also apply ``transform`` to their params."""
        return RoutedModule(self.td_module, self._extra_relative_path, (*self._params_transforms, transform))

    @property
    def model(self) -> Any:
        """The user's model: the module hook keys with ``relative=True`` start from."""
        return resolve_path(self.td_module, self._extra_relative_path)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return route(self.td_module, lambda root: root(*args, **kwargs), overrides=self.overrides(self._prefix()))

    def forward_with_params(self, params: TensorDictBase, *args: Any, **kwargs: Any) -> Any:
        """`forward` with ``params`` in place of the model's own tensors.

        No params transform applies: ``params`` are used as given.

        Args:
            params (TensorDict): keyed like `params` (relative to `model`).
        """
        return route(self.td_module, lambda root: root(*args, **kwargs), self._nest(params))

    def params(self, *, detach: bool = False) -> TensorDictBase:
        """The params calls run with, passed through the params transforms active now.

        Args:
            detach (bool): start from `tdhook_fn.params` of the model (detached,
                buffers copied) instead of its own tensors, live (gradients reach the
                model). Default: ``False``.
        """
        transformed = self._transformed(detach=detach)
        return params_of(self.model, detach=detach) if transformed is None else transformed[1]

    def overrides(self, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any] | None:
        """What the active params transforms replace, for a live call: keyed from `model`, after ``prefix``.

        ``None`` when no transform applies.
        """
        transformed = self._transformed()
        return None if transformed is None else replaced(*transformed, prefix)

    def _transformed(self, *, detach: bool = False) -> tuple[TensorDictBase, TensorDictBase] | None:
        """``(params, after every transform)``, or ``None`` when no transform applies."""
        transforms = (*active_transforms(), *self._params_transforms)
        if not transforms:
            return None
        model = self.model
        start = params_of(model, detach=detach)
        params: TensorDictBase = start
        for transform in transforms:
            params = transform(model, params)
        return start, params.detach() if detach else params

    def taps(self) -> tuple[Tap, ...]:
        """The virtual hooks active now, as taps with paths relative to `model`."""
        return taps_for(self.model, active_hooks())

    def functional(self) -> Functional:
        """The model as ``f(params, td) -> td`` with the virtual hooks active now.

        Call it while the hooked module runs (inside a prepared module's forward): the
        hooks registered on the hooked module at that moment become ``f``'s taps.
        ``params`` are keyed like `params`; ``td`` needs the context's ``in_keys``
        and the result holds its ``out_keys``.

        The taps run the recorded tdhook hooks as they are, side effects included: a
        caching hook writes to its cache on every call of ``f``, and inside
        ``torch.func`` transforms it would store transformed (batched) tensors. Hooks
        that only replace values (``set``) compose with transforms; backward hooks
        (``*_grad``) fire under ``torch.autograd`` only.

        ``in_keys`` given as a dict (keyword inputs, e.g. a Hugging Face model's
        ``attention_mask``) pass each key as the keyword the context's TensorDictModule
        passes it as.
        """
        model, wrapper = self.model, self.td_module
        if model is wrapper:
            f = functional(model)
        else:
            keywords = getattr(wrapper, "_kwargs", None)  # tensordict's keyword names, in in_keys order
            in_keys = dict(zip(wrapper.in_keys, keywords, strict=True)) if keywords else list(wrapper.in_keys)
            f = functional(model, in_keys, list(wrapper.out_keys))
        return f.with_taps(*self.taps())

    def _prefix(self) -> tuple[str, ...]:
        """The model's key inside `td_module` (``()`` when the model is the root)."""
        path = module_path(self.td_module, self.model) if isinstance(self.model, nn.Module) else None
        return tuple(part[1:-1] for part in path.split(".")) if path else ()

    def _nest(self, params: TensorDictBase) -> TensorDictBase:
        prefix = self._prefix()
        if not prefix:
            return params
        nested = TensorDict({}, batch_size=[])
        nested.set(prefix, params)
        return nested
