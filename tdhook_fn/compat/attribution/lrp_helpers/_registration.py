"""tdhook's rule API on the module the user hands over: ``Rule.register(module)`` and its handle."""

# NOTE [registered rules]
# Registering on the module the user gives is the documented job of ``Rule.register``
# (like ``compat.hooks``' ``register_hook_to_module``), so it registers hooks there;
# nothing else on the module changes (its ``forward`` is not swapped, as tdhook does).
# The relevance is the core's: the rule's tap from `tdhook_fn.attribution.rule_taps`,
# attached to the module (its ``Tap.attach``), puts the modified VJP of
# `tdhook_fn.attribution.lrp` at the module's output. The rule is always run by its
# ``relevance`` (the rule's definition), never by the gradient form
# (NOTE [gradient-form rules]): that form scales gradients around the module's own backward,
# which would reach the module's parameters and show torch's full backward hooks the
# unscaled gradient. So the parameters are constants under a rule, as in tdhook: no
# gradient reaches them, and an output whose inputs do not require grad does not
# require grad (a last hook detaches it).
#
# Around the tap, a pre-hook refuses a ruled module running inside another (the core
# refuses rules that nest; a context variable names the ruled module running) and a
# copy of these hooks on a shadow (the module inside a pure function of `tdhook_fn` or a
# compat context, where the rule would act besides that call's own rules); a first
# forward hook raises tdhook's errors for calls the rule does not fit.

from __future__ import annotations

import contextvars
import dataclasses
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tdhook_fn import attribution, functional
from tdhook_fn.attribution import ModuleCall, rule_taps

__all__ = ["RemovableRuleHandle", "raise_for_unconserved_rel_factory", "register_rule", "unregister_rule"]

_RUNNING: contextvars.ContextVar[_Registration | None] = contextvars.ContextVar("tdhook_fn_rule_running",
                                                                                   default=None)
_LOCK = threading.Lock()
# each module's registration and the handles of its hooks (one rule a module); the module is held weakly
_REGISTERED: weakref.WeakKeyDictionary[nn.Module, tuple[_Registration, list[RemovableHandle]]] = (
    weakref.WeakKeyDictionary())


class Rule(Protocol):
    """What registering needs of a compat rule (``rules.Rule``, which imports this module)."""

    def rule(self) -> attribution.Rule: ...

    def _check_call(self, args: tuple[Any, ...], output: Any) -> None: ...


def _requires_grad(args: tuple[Any, ...]) -> bool:
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


@dataclass(frozen=True)
class _ByRelevance:
    """The compat rule's core rule, read at each backward, run by its ``relevance`` only (NOTE [registered rules]).

    The module's parameters and output reach it detached: constants, so that a relevance taken
    with ``create_graph`` (or under ``torch.func.grad``) carries no graph to them.
    """

    rule: Rule

    def relevance(self, call: ModuleCall, grad: torch.Tensor) -> Sequence[torch.Tensor | None]:
        constants = dataclasses.replace(call, output=call.output.detach(),
                                        tensors=tuple(t.detach() for t in call.tensors))
        return self.rule.rule().relevance(constants, grad)


class _Registration:
    """The hooks of one rule on one module around the core's tap (NOTE [registered rules])."""

    def __init__(self, rule: Rule, module: nn.Module) -> None:
        self.rule = rule
        self.module_id = id(module)  # (an id, not the module: a shadow's copy of these hooks must not reach it)
        self.module_name = type(module).__name__

    def before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        name = type(self.rule).__name__
        if id(module) != self.module_id:
            raise RuntimeError(f"{name}: a {self.module_name} with this rule registered runs inside a tdhook_fn "
                               "pure function or a compat context; remove the rule there (handle.remove()) and give "
                               "it to LRP's rule_mapper or to tdhook_fn.attribution.lrp's rules instead")
        running = _RUNNING.get()
        if running is not None:
            raise ValueError(f"{name}: a {self.module_name} with this rule registered runs inside a "
                             f"{running.module_name} with {type(running.rule).__name__} registered; rules may not "
                             "nest: remove one of them")
        _RUNNING.set(self)

    def check(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        self.rule._check_call(args, output)
        if not isinstance(output, torch.Tensor) or not all(isinstance(a, torch.Tensor) for a in args) or any(
                isinstance(v, torch.Tensor) for v in kwargs.values()):
            raise TypeError(f"{type(self.rule).__name__}: the {self.module_name} it is registered on was called "
                            f"with non-tensor positional or tensor keyword arguments, or returned a "
                            f"{type(output).__name__}; a rule needs tensors as positional arguments and one tensor "
                            "returned (register it on the sublayers)")

    def after(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        _RUNNING.set(None)  # (always called: also when the forward or a hook raised)
        if isinstance(output, torch.Tensor) and output.requires_grad and not _requires_grad(args):
            return output.detach()  # no relevance can flow: a constant, as tdhook's
        return None

    def attach(self, module: nn.Module) -> list[RemovableHandle]:
        """Register the hooks on ``module``; their handles.

        They run as: ``before`` (first pre-hook), the forward, ``check``, the tap's hook,
        the hooks already there, ``after`` (always called).
        """
        f = functional(module)
        (tap,) = rule_taps(f, lambda path, _m: _ByRelevance(self.rule) if path == "" else None,
                           warn_on_missing_rule=False)
        handles = [module.register_forward_pre_hook(self.before, prepend=True, with_kwargs=True),
                   module.register_forward_hook(self.after, with_kwargs=True, always_call=True)]
        handles.append(tap.attach(module, {}))  # (prepends its forward hook)
        handles.append(module.register_forward_hook(self.check, prepend=True, with_kwargs=True))  # before it
        return handles


class RemovableRuleHandle:
    """What ``Rule.register`` returns: ``remove()`` (or leaving a ``with`` block) takes the rule off.

    Removing twice, or after the module is gone, does nothing.

    Args:
        rule (Rule): the registered rule.
        module (nn.Module): the module it is registered on (held weakly).

    Examples:
        >>> import torch
        >>> from tdhook_fn.compat.attribution.lrp_helpers.rules import EpsilonRule
        >>> layer = torch.nn.Linear(3, 2)
        >>> with EpsilonRule(1e-6).register(layer):
        ...     x = torch.ones(3, requires_grad=True)
        ...     layer(x).backward(torch.ones(2))
        >>> len(layer._forward_hooks_with_kwargs)
        0
    """

    def __init__(self, rule: Rule, module: nn.Module) -> None:
        self._rule = rule
        self._module_ref: Callable[[], nn.Module | None] = weakref.ref(module)
        self._registration: _Registration | None = None

    def __enter__(self) -> RemovableRuleHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        """Take the rule off the module, if it is still there."""
        module = self._module_ref()
        if module is not None:
            _take_off(module, self._rule, self._registration)


def register_rule(rule: Rule, module: nn.Module) -> RemovableRuleHandle:
    """Register ``rule`` on ``module`` (NOTE [registered rules]); see ``Rule.register``."""
    name = type(rule).__name__
    if not isinstance(module, nn.Module):
        raise TypeError(f"{name}.register: module must be an nn.Module, got {type(module).__name__}")
    rule.rule()  # a rule class standing for no tdhook_fn rule says so now
    registration = _Registration(rule, module)
    with _LOCK:
        held = _REGISTERED.get(module)
        if held is not None:
            raise ValueError(f"{name}.register: this {type(module).__name__} already has "
                             f"{type(held[0].rule).__name__} registered; remove it first (its handle's remove(), or "
                             "rule.unregister(module))")
        _REGISTERED[module] = (registration, registration.attach(module))
    handle = RemovableRuleHandle(rule, module)
    handle._registration = registration
    return handle


def unregister_rule(rule: Rule, module: nn.Module) -> None:
    """Take ``rule`` off ``module``; see ``Rule.unregister``."""
    if not _take_off(module, rule, None):
        raise ValueError(f"{type(rule).__name__}.unregister: this rule is not registered on this "
                         f"{type(module).__name__}; unregister the module it was registered on")


def _take_off(module: nn.Module, rule: Rule, registration: _Registration | None) -> bool:
    """Remove ``rule``'s registration (``registration`` if given) from ``module``; whether there was one."""
    with _LOCK:
        held = _REGISTERED.get(module)
        if held is None or held[0].rule is not rule or (registration is not None and held[0] is not registration):
            return False
        del _REGISTERED[module]
    for hook in held[1]:
        hook.remove()
    return True


Relevances = torch.Tensor | tuple[torch.Tensor | None, ...]


def _total(relevances: Relevances) -> torch.Tensor:
    parts = relevances if isinstance(relevances, tuple) else (relevances,)
    sums = [r.sum() for r in parts if r is not None]
    return torch.stack(sums).sum() if sums else torch.zeros(())


def raise_for_unconserved_rel_factory(
    atol: float = 1e-6, rtol: float = 1e-6
) -> Callable[[nn.Module, Relevances, Relevances], None]:
    """A full backward hook raising ``RuntimeError`` where a module does not conserve relevance.

    The hook, ``(module, in_relevances, out_relevances) -> None`` (torch's
    ``register_full_backward_hook`` order: the inputs' gradients first), compares the
    sum of the relevance at the module's inputs with that at its outputs (tuples are
    summed over their tensors; ``None`` entries hold nothing) by ``torch.isclose``.

    Args:
        atol (float): absolute tolerance of the comparison. Default: ``1e-6``.
        rtol (float): relative tolerance of the comparison. Default: ``1e-6``.

    Returns:
        Callable: the hook.

    Examples:
        >>> import torch
        >>> from tdhook_fn.compat.attribution.lrp_helpers.rules import PassRule
        >>> relu = torch.nn.ReLU()
        >>> _ = relu.register_full_backward_hook(raise_for_unconserved_rel_factory())
        >>> x = torch.tensor([-1.0, 2.0], requires_grad=True)
        >>> with PassRule().register(relu):
        ...     relu(x).backward(torch.ones(2))  # Pass conserves: no error
        >>> x.grad
        tensor([1., 1.])
    """

    def raise_for_unconserved_rel(module: nn.Module, in_relevances: Relevances, out_relevances: Relevances) -> None:
        got, put = _total(in_relevances), _total(out_relevances)
        if not bool(torch.isclose(got, put.to(got.dtype), atol=atol, rtol=rtol)):
            raise RuntimeError(f"Unconserved relevance for module {type(module).__name__}: the inputs hold "
                               f"{got.item():.6g}, the outputs {put.item():.6g} (atol={atol}, rtol={rtol})")

    return raise_for_unconserved_rel
