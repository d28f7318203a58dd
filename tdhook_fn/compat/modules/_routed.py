"""The working module a context hands to ``_prepare_module``: the model, routed."""

from __future__ import annotations

from typing import Any

from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase, TensorDictModuleWrapper
from torch import nn

from tdhook_fn._functional import Functional, functional
from tdhook_fn._params import params as params_of
from tdhook_fn._paths import resolve_path
from tdhook_fn._taps import Tap

from ._virtual import active_hooks, module_path, route, taps_for

__all__ = ["RoutedModule"]


class RoutedModule(TensorDictModuleWrapper):
    """Runs a context's TensorDictModule on the core, with the active virtual hooks.

    Behaves like the wrapped module (same ``in_keys``, ``out_keys``, attributes, and
    ``forward`` writing into the given TensorDict), but every call runs on a private
    shadow of it (see NOTE [virtual hooks]) with the model's live tensors, so the model
    never carries a hook. Contexts give one to ``_prepare_module``; its methods give a
    method the model as a pure function at call time.

    Args:
        td_module (TensorDictModuleBase): the context's module: the user's
            TensorDictModule, or the TensorDictModule wrapping the user's ``nn.Module``.
        extra_relative_path (str): the path of the user's model inside ``td_module``
            (``"module"`` for a wrapped ``nn.Module``, ``""`` otherwise). Default: ``""``.
    """

    def __init__(self, td_module: TensorDictModuleBase, extra_relative_path: str = "") -> None:
        super().__init__(td_module)
        self._extra_relative_path = extra_relative_path

    @property
    def model(self) -> Any:
        """The user's model: the module hook keys with ``relative=True`` start from."""
        return resolve_path(self.td_module, self._extra_relative_path)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return route(self.td_module, lambda root: root(*args, **kwargs))

    def forward_with_params(self, params: TensorDictBase, *args: Any, **kwargs: Any) -> Any:
        """:meth:`forward` with ``params`` in place of the model's own tensors.

        Args:
            params (TensorDict): keyed like :meth:`params` (relative to :attr:`model`).
        """
        return route(self.td_module, lambda root: root(*args, **kwargs), self._nest(params))

    def params(self) -> TensorDict:
        """The model's own parameters and buffers, live: gradients reach the model."""
        return params_of(self.model, detach=False)

    def taps(self) -> tuple[Tap, ...]:
        """The virtual hooks active now, as taps with paths relative to :attr:`model`."""
        return taps_for(self.model, active_hooks())

    def functional(self) -> Functional:
        """The model as ``f(params, td) -> td`` with the virtual hooks active now.

        Call it while the hooked module runs (inside a prepared module's forward): the
        hooks registered on the hooked module at that moment become ``f``'s taps.
        ``params`` are keyed like :meth:`params`; ``td`` needs the context's ``in_keys``
        and the result holds its ``out_keys``.

        The taps run the recorded tdhook hooks as they are, side effects included: a
        caching hook writes to its cache on every call of ``f``, and inside
        ``torch.func`` transforms it would store transformed (batched) tensors. Hooks
        that only replace values (``set``) compose with transforms; backward hooks
        (``*_grad``) fire under ``torch.autograd`` only.

        Raises:
            ValueError: the context's ``in_keys`` map keys to keyword arguments.
        """
        model, wrapper = self.model, self.td_module
        if model is wrapper:
            f = functional(model)
        else:
            if getattr(wrapper, "_kwargs", None):
                raise ValueError("functional: in_keys given as a dict (keyword arguments) are not supported")
            f = functional(model, list(wrapper.in_keys), list(wrapper.out_keys))
        return f.with_taps(*self.taps())

    def _nest(self, params: TensorDictBase) -> TensorDictBase:
        prefix = module_path(self.td_module, self.model) if isinstance(self.model, nn.Module) else None
        if not prefix:
            return params
        nested = TensorDict({}, batch_size=[])
        nested.set(tuple(part[1:-1] for part in prefix.split(".")), params)
        return nested
