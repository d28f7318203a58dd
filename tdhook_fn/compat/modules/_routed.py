"""The working module a context hands to ``_prepare_module``: the model, routed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase, TensorDictModuleWrapper
from torch import nn

from tdhook_fn._functional import Functional, functional
from tdhook_fn._params import params as params_of
from tdhook_fn._paths import resolve_path
from tdhook_fn._taps import Tap

from ._scope import SCOPE, Replacement, active_hooks, entered, replaced_params, route, taps_for, unseen

__all__ = ["RoutedModule"]


class RoutedModule(TensorDictModuleWrapper):
    """Runs a context's TensorDictModule on the core, with the scope's hooks and replacements.

    Behaves like the wrapped module, but every call runs on a private shadow of it with the
    model's live tensors (NOTE [one scope]). Every factory's ``_prepare_module`` receives one;
    `model`, `functional` and `params` give a method the model as a pure function at call time.

    Args:
        td_module (TensorDictModuleBase): the context's module: the user's
            TensorDictModule, or the TensorDictModule wrapping the user's ``nn.Module``.
        extra_relative_path (str): the path of the user's model inside ``td_module``
            (``"module"`` for a wrapped ``nn.Module``, ``""`` otherwise). Default: ``""``.
        replacements (Iterable[Replacement]): ``(tensor, fn)`` pairs giving some of the
            model's tensors other values in this module's calls. Default: none.
        runner (TensorDictModuleBase | None): what `forward` calls instead of routing
            ``td_module`` (a module that routes the model itself: a pre-factory's hooked
            module, or what an earlier factory of a composite prepared). Default: none.
    """

    _extra_relative_path: str
    model: nn.Module  # the user's model: the module hook keys with ``relative=True`` start from
    _replacements: tuple[Replacement, ...]
    _runner: TensorDictModuleBase | None

    def __init__(
        self,
        td_module: TensorDictModuleBase,
        extra_relative_path: str = "",
        replacements: Iterable[Replacement] = (),
        runner: TensorDictModuleBase | None = None,
    ) -> None:
        super().__init__(td_module)
        path = extra_relative_path
        if path in ("", "module"):  # (the two paths contexts give: no need to parse them)
            model = getattr(td_module, path) if path else td_module
        else:
            model = resolve_path(td_module, path)
        if not isinstance(model, nn.Module):
            raise TypeError(f"RoutedModule: {path!r} names a {type(model).__name__} in the context's module, "
                            "not a module")
        # (in __dict__: the model and the runner are no submodules of this wrapper, which holds them already)
        self.__dict__.update(
            _extra_relative_path=extra_relative_path,
            model=model,
            _replacements=tuple(replacements),
            _runner=runner,
            _forward_attributes=True,
        )

    # NOTE [working module attributes]
    # tdhook's ``_prepare_module`` and ``_restore_module`` both receive the context's
    # TensorDictModule and may set an attribute in one and delete it in the other. Here they
    # receive this wrapper, so a public attribute it does not own is written to (deleted
    # from) ``td_module``, as reading one falls through to it; the context puts back what
    # the prepare step left (NOTE [prepared attributes] in ``tdhook_fn.compat.contexts``).

    def _forwards(self, name: str) -> bool:
        """Whether setting or deleting ``name`` acts on ``td_module`` (NOTE above)."""
        if name.startswith("_") or not self.__dict__.get("_forward_attributes", False):
            return False
        own = (self.__dict__, self._parameters, self._buffers, self._modules)
        return not any(name in names for names in own) and not hasattr(type(self), name)

    def __setattr__(self, name: str, value: Any) -> None:
        # (`_forwards`' first test inline: no call for the wrapper's own ``td_module`` on construction)
        if "_forward_attributes" in self.__dict__ and self._forwards(name):
            setattr(self.td_module, name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if self._forwards(name):
            delattr(self.td_module, name)
        else:
            super().__delattr__(name)

    def replacing(self, replacements: Iterable[Replacement]) -> RoutedModule:
        """This routed module, whose calls also give the tensors of ``replacements`` their values."""
        return RoutedModule(self.td_module, self._extra_relative_path, (*self._replacements, *replacements),
                            self._runner)

    @staticmethod
    def of(module: TensorDictModuleBase) -> RoutedModule:
        """``module`` routed: itself when it is a RoutedModule already."""
        return module if isinstance(module, RoutedModule) else RoutedModule(module)

    def running(self, runner: TensorDictModuleBase) -> RoutedModule:
        """This routed model, whose `forward` calls ``runner`` (itself when it is a RoutedModule)."""
        if isinstance(runner, RoutedModule):
            return runner
        return RoutedModule(self.td_module, self._extra_relative_path, self._replacements, runner)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The live call: the model's own tensors (gradients reach them), replacements applied."""
        with entered(replacements=self._replacements):
            if self._runner is not None:
                return self._runner(*args, **kwargs)
            return route(self.td_module, lambda root: root(*args, **kwargs))

    def params(self, *, detach: bool = False) -> TensorDictBase:
        """The model's tensors, live, with the replacements active now (``detach``: a detached snapshot)."""
        params = params_of(self.model, detach=detach)
        scoped = SCOPE.get().replacements
        if not (scoped or self._replacements):
            return params
        replacements = (*scoped, *unseen(scoped, self._replacements)) if self._replacements else scoped
        return replaced_params(self.model, params, replacements, detach=detach)

    def taps(self) -> tuple[Tap, ...]:
        """The virtual hooks active now, as taps with paths relative to `model`."""
        return taps_for(self.model, active_hooks())

    def functional(self) -> Functional:
        """The model as ``f(params, td) -> td`` with the virtual hooks active now.

        Call it while the hooked module runs (inside a prepared module's forward): the
        hooks registered on the hooked module at that moment become ``f``'s taps, run as
        they are, side effects included (a caching hook writes on every call of ``f``).
        ``params`` are keyed like `params`; ``td`` needs the context's ``in_keys`` (a dict
        of them passes keywords, as the context's TensorDictModule does).
        """
        f: Functional | None = self.__dict__.get("_functional")
        if f is None:  # (built once: the model and the keys are this module's for good)
            model, wrapper = self.model, self.td_module
            if model is wrapper:
                f = functional(model)
            else:
                keywords = getattr(wrapper, "_kwargs", None)  # tensordict's keyword names, in in_keys order
                in_keys = dict(zip(wrapper.in_keys, keywords, strict=True)) if keywords else list(wrapper.in_keys)
                f = functional(model, in_keys, list(wrapper.out_keys))
            self.__dict__["_functional"] = f
        for registry in SCOPE.get().hooks:  # (no call when no hook is recorded: the usual case)
            if registry.recorded:  # (its dict read without the lock: emptiness is one atomic read)
                taps = self.taps()
                return f.with_taps(*taps) if taps else f
        return f

