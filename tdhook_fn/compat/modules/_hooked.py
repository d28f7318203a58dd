"""The two modules a context works with: `RoutedModule`, the model routed through the scope (what
``_prepare_module`` receives), and `HookedModule`, what a context hands back, with virtual hooks
(NOTE [virtual hooks])."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictModuleBase, TensorDictModuleWrapper
from torch import nn

from tdhook_fn._functional import Functional, functional
from tdhook_fn._params import params as params_of
from tdhook_fn._paths import resolve_path
from tdhook_fn._taps import Tap
from tdhook_fn.compat.hooks._registration import NO_HOOKS, RemovableHandleProtocol, VirtualHooks, order_mark

from ._run import HookedModuleRun
from ._scope import (
    SCOPE,
    Made,
    Replacement,
    Scope,
    active_hooks,
    entered,
    made,
    replaced_params,
    route,
    taps_for,
    unseen,
)
from ._submodule_hooks import SubmoduleHooks
from ._wrappers import layout

__all__ = ["ContextWork", "HookedModule", "RoutedModule", "switch_on"]


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
        replacements (Iterable[Made]): replacements giving some of the model's tensors
            other values in this module's calls, as `replacing` makes them. Default: none.
        runner (TensorDictModuleBase | None): what `forward` calls instead of routing
            ``td_module`` (a module that routes the model itself: a pre-factory's hooked
            module, or what an earlier factory of a composite prepared). Default: none.
    """

    _extra_relative_path: str
    model: nn.Module  # the user's model: the module hook keys with ``relative=True`` start from
    _replacements: tuple[Made, ...]
    _runner: TensorDictModuleBase | None

    def __init__(
        self,
        td_module: TensorDictModuleBase,
        extra_relative_path: str = "",
        replacements: Iterable[Made] = (),
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

    @property
    def runner(self) -> TensorDictModuleBase | None:
        """What `forward` calls instead of routing ``td_module``: a hooked module this one was prepared over."""
        return self._runner

    def replacing(self, replacements: Iterable[Replacement]) -> RoutedModule:
        """This routed module, whose calls also give the tensors of ``replacements`` (``(tensor, fn)`` pairs)
        their values, after the replacements made before now (NOTE [one scope])."""
        return RoutedModule(self.td_module, self._extra_relative_path, (*self._replacements, *made(replacements)),
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

    def running_alone(self) -> RoutedModule:
        """This routed model with its replacements, whose forward routes the model itself (no runner)."""
        alone: RoutedModule | None = self.__dict__.get("_alone")
        if alone is None:  # (kept: its functional is built once)
            alone = RoutedModule(self.td_module, self._extra_relative_path, self._replacements)
            self.__dict__["_alone"] = alone
        return alone

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The live call: the model's own tensors (gradients reach them), replacements applied."""
        with entered(replacements=self._replacements):
            if self._runner is not None:
                return self._runner(*args, **kwargs)
            return route(self.td_module, lambda root: root(*args, **kwargs))

    # NOTE [runners' effects]
    # A working module whose forward runs a pre-factory's hooked module (``running``) computes,
    # live, with that hooked module's hooks and its routed module's replacements (and those of
    # the hooked module it runs in turn). `params` and `functional` give a method the same
    # model: they add those registries and replacements to the scope while they read it. A
    # runner that is something else (a prepared module computing more than the model: an
    # attribution, a wrapper of the outputs) is no pure function of the model's params: a
    # method cannot differentiate it, so both refuse it, naming its class.

    @contextmanager
    def _runners_entered(self) -> Iterator[RoutedModule]:
        """The model alone (`running_alone`), with the effects of the hooked modules this module runs in the
        scope (NOTE [runners' effects])."""
        scope = SCOPE.get()
        hooks, replacements = list(scope.hooks), list(scope.replacements)
        runner = self._runner
        while runner is not None:
            if not isinstance(runner, HookedModule):
                raise _more_than_the_model(runner, "this factory's module")
            runs = runner.routed_runs()
            if runner._virtual_hooks not in hooks:
                hooks.append(runner._virtual_hooks)
            replacements += unseen(replacements, runs._replacements)
            runner = runs._runner
        token = SCOPE.set(Scope(tuple(hooks), scope.recording, tuple(replacements)))
        try:
            yield self.running_alone()
        finally:
            SCOPE.reset(token)

    def params(self, *, detach: bool = False) -> TensorDictBase:
        """The model's tensors, live, with the replacements active now (``detach``: a detached snapshot)."""
        if self._runner is not None:  # (NOTE [runners' effects])
            with self._runners_entered() as alone:
                return alone.params(detach=detach)
        params = params_of(self.model, detach=detach)
        scoped = SCOPE.get().replacements
        if not (scoped or self._replacements):
            return params
        replacements = (*scoped, *unseen(scoped, self._replacements)) if self._replacements else scoped
        return replaced_params(self.model, params, replacements, detach=detach)

    def functional(self) -> Functional:
        """The model as ``f(params, td) -> td`` with the virtual hooks active now.

        Call it while the hooked module runs (inside a prepared module's forward): the
        hooks registered on the hooked module at that moment become ``f``'s taps, run as
        they are, side effects included (a caching hook writes on every call of ``f``).
        ``params`` are keyed like `params`; ``td`` needs the context's ``in_keys`` (a dict
        of them passes keywords, as the context's TensorDictModule does).
        """
        return self.functional_and_hooks()[0]

    def functional_and_hooks(self, since: int = sys.maxsize) -> tuple[Functional, tuple[Tap, ...]]:
        """`functional` with the virtual hooks active now that were recorded before the mark ``since``
        (`order_mark`; default: all), and those recorded after it as taps, apart: a method attaches them after its
        own taps (NOTE [the user's hooks after the method's])."""
        if self._runner is not None:  # (NOTE [runners' effects])
            with self._runners_entered() as alone:
                return alone.functional_and_hooks(since)
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
            if registry:  # (read without the lock: a dict's emptiness is one atomic read)
                earlier, later = taps_for(self.model, active_hooks(), since)
                return (f.with_taps(*earlier) if earlier else f), later
        return f, ()


def _more_than_the_model(module: nn.Module, runner: str) -> NotImplementedError:
    return NotImplementedError(
        f"{runner} runs {type(module).__name__}, a module that computes more than the model (another method's, "
        "prepared before): a method that takes the model as a pure function cannot compute through it. Prepare "
        "the context over the model itself")


# NOTE [a context's own hooks]
# tdhook's method contexts do their work with hooks registered on entry (guided backprop's
# ReLUs, ``output_grad_callbacks``, patching's cache and patch), which
# ``disable_context_hooks`` removes for a while and registers anew after: then they run
# after the hooks the user recorded in between. Here that work is the prepared module's
# (a `ContextWork`): the context's ``_hook_module`` is `switch_on`, which turns it on and
# takes its place in the registration order (``entered``; see
# NOTE [the user's hooks after the method's]); removing the handle turns it off, and the
# module does what tdhook's does without those hooks.


class ContextWork:
    """Mixin of a prepared module doing what tdhook does with its context's own hooks: on from `switch_on` until
    ``remove()``, ``entered`` their place in the registration order (NOTE [a context's own hooks])."""

    on = False
    entered = sys.maxsize

    def remove(self) -> None:
        """Turn it off (`switch_on` returns the module as the handle of the context's hooks)."""
        self.on = False


def switch_on(module: HookedModule) -> RemovableHandleProtocol:
    """A context's ``_hook_module`` where a `ContextWork` under ``module`` does the work of its hooks: turn it on,
    placed after every hook recorded so far; it is its own handle, whose ``remove()`` turns it off
    (NOTE [a context's own hooks])."""
    for work in module.td_module.modules():
        if isinstance(work, ContextWork):
            work.on, work.entered = True, order_mark()
            return work
    return NO_HOOKS


HookingContext = Any  # a `tdhook_fn.compat.contexts.HookingContext` (whose module imports this one)


class HookedModule(SubmoduleHooks, TensorDictModuleWrapper):
    """A TensorDictModule whose submodules can be hooked without touching them (virtual hooks).

    Args:
        td_module (TensorDictModuleBase): the module to run.
        hooking_context (HookingContext | None): the context that made this module;
            it must be active when the module is called.
        relative_path (str): reported as in tdhook. Keys with ``relative=True`` start
            at the user's model (for a contextual module, the model the context was
            prepared with; otherwise the module ``relative_path`` names).
            Default: ``"td_module"``.
    """

    _runs: TensorDictModuleBase
    _hooking_context: HookingContext | None
    _relative_path: str
    _virtual_hooks: VirtualHooks

    def __init__(
        self,
        td_module: TensorDictModuleBase,
        hooking_context: HookingContext | None = None,
        relative_path: str = "td_module",
    ) -> None:
        super().__init__(td_module)
        # (in __dict__ as nn.Module puts them, without its checks; `_runs` out of the module tree: a context's
        # prepared module routes the model, a module of one's own is routed here)
        runs = td_module if hooking_context is not None else RoutedModule.of(td_module)
        self.__dict__.update(_hooking_context=hooking_context, _relative_path=relative_path,
                             _virtual_hooks=VirtualHooks(), _runs=runs)

    @property
    def relative_path(self) -> str:
        return self._relative_path

    @property
    def hooking_context(self) -> HookingContext | None:
        return self._hooking_context

    def __repr__(self) -> str:
        return layout(self, f"td_module={self.td_module},\nin_keys={self.in_keys},\nout_keys={self.out_keys}")

    @classmethod
    def from_module(
        cls,
        module: Callable[..., Any],
        in_keys: list[Any],
        out_keys: list[Any],
        *,
        hooking_context: HookingContext | None = None,
        **kwargs: Any,
    ) -> HookedModule:
        """Wrap ``module`` in a ``TensorDictModule(module, in_keys, out_keys, **kwargs)``."""
        return cls(TensorDictModule(module, in_keys, out_keys, **kwargs), hooking_context=hooking_context)

    def run(
        self,
        data: TensorDict,
        cache: TensorDict | None = None,
        run_name: str | None = None,
        run_sep: str | None = None,
        run_cache: TensorDict | None = None,
        grad_enabled: bool = False,
        run_callback: Callable[..., Any] | None = None,
    ) -> HookedModuleRun:
        """A `HookedModuleRun` of this module on ``data``."""
        return HookedModuleRun(self, data, cache, run_name, run_sep, run_cache, grad_enabled, run_callback)

    def routed_runs(self) -> RoutedModule:
        """The routed model this module runs; NotImplementedError where it runs more than the model (an
        attribution context's module: NOTE [runners' effects])."""
        runs = self._runs
        if not isinstance(runs, RoutedModule):
            raise _more_than_the_model(runs, "this hooked module")
        return runs

    def routed_model(self) -> RoutedModule:
        """The model this module runs, routed, whose forward is this module's (NOTE [runners' effects]): what a
        context prepared over this module works with."""
        # (its keys start at the TensorDictModule this module runs, as tdhook's, whose hooked module forwards to it)
        return RoutedModule(self.routed_runs().td_module).running(self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        context = self._hooking_context
        if context is not None and not context._in_context:
            raise RuntimeError("Contextual HookedModule must be called in context")
        # this module's hooks join the scope for the call (NOTE [one scope]), inline: a call on every forward
        scope, hooks = SCOPE.get(), self._virtual_hooks
        if hooks in scope.hooks:  # (an outer call of this module made them active)
            return self._runs(*args, **kwargs)
        token = SCOPE.set(Scope((*scope.hooks, hooks), scope.recording, scope.replacements))
        try:
            return self._runs(*args, **kwargs)
        finally:
            SCOPE.reset(token)

    @contextmanager
    def disable_context_hooks(self) -> Iterator[None]:
        """Remove the context's own hooks for the duration (``HookingContext.disable_hooks``)."""
        if self._hooking_context is None:
            raise RuntimeError("No hooking context provided to this module")
        with self._hooking_context.disable_hooks():
            yield

    @contextmanager
    def disable_context(self) -> Iterator[Any]:
        """Yield the raw model with the context's hooks off (``HookingContext.disable``)."""
        if self._hooking_context is None:
            raise RuntimeError("No hooking context provided to this module")
        with self._hooking_context.disable() as raw_module:
            yield raw_module

    def restore(self) -> None:
        """Exit the context of a module made with ``prepare(..., return_context=False)``."""
        context = self._hooking_context
        if context is None:
            raise RuntimeError("No hooking context provided to this module")
        if not context._in_context:
            raise RuntimeError("Context is not active")
        if context._managed_by_context_manager:
            raise RuntimeError("Cannot call restore() when context is managed by a context manager. ")
        context.__exit__(None, None, None)
