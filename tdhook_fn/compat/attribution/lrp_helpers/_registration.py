"""tdhook's rule API on the module the user hands over: ``Rule.register(module)`` and its handle.

# NOTE [registered rules]
Registering on the module the user gives is the documented job of ``Rule.register``
(like ``compat.hooks``' ``register_hook_to_module``), so it registers one forward hook
there; nothing else on the module changes (its ``forward`` is not swapped, as tdhook
does). When the module runs with an input that requires grad, the hook returns, in
place of the module's own output, the output of the core's pure call of the module
(`tdhook_fn.call_with_taps`) with the rule's tap from `tdhook_fn.attribution.rule_taps`
on its root: the same modified VJP as `tdhook_fn.attribution.lrp`, on the module's
parameters detached. So the parameters are constants under a rule, as in tdhook: no
gradient reaches them, and an output whose inputs do not require grad does not
require grad. The module runs twice per such call (itself, then the pure call); a
module that writes its input in place is refused, since the pure call must see the
input the module was given.

The pure call runs the module's shadow, which carries a copy of this hook; the copy
stands aside in that call (a context variable names the registration running). Any
other run of a copy is refused: a ruled module inside another ruled module (the core
refuses rules that nest), or inside a pure function of `tdhook_fn` or a compat
context (give the rule to `LRP`'s ``rule_mapper`` there).
"""

from __future__ import annotations

import contextvars
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tdhook_fn import call_with_taps, functional, params
from tdhook_fn.attribution import rule_taps

if TYPE_CHECKING:
    from .rules import Rule

__all__ = ["RemovableRuleHandle", "raise_for_unconserved_rel_factory", "register_rule", "unregister_rule"]

_RUNNING: contextvars.ContextVar[_Registration | None] = contextvars.ContextVar("tdhook_fn_rule_running",
                                                                                   default=None)
_LOCK = threading.Lock()
# each module's registration (one rule a module); the module is held weakly
_REGISTERED: weakref.WeakKeyDictionary[nn.Module, tuple[_Registration, RemovableHandle]] = (
    weakref.WeakKeyDictionary())


def _requires_grad(args: tuple[Any, ...]) -> bool:
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


class _Registration:
    """The forward hook of one rule on one module (NOTE [registered rules])."""

    def __init__(self, rule: Rule, module: nn.Module) -> None:
        self.rule = rule
        self.module_id = id(module)  # (an id, not the module: the shadow's copy of this hook must not reach it)
        self.module_name = type(module).__name__

    def hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        running = _RUNNING.get()
        if running is self:
            return None  # the pure call below, running this module's shadow: its rule tap does the work
        name = type(self.rule).__name__
        if running is not None:
            raise ValueError(f"{name}: a {self.module_name} with this rule registered runs inside a "
                             f"{running.module_name} with {type(running.rule).__name__} registered; rules may not "
                             "nest: remove one of them")
        if id(module) != self.module_id:
            raise RuntimeError(f"{name}: a {self.module_name} with this rule registered runs inside a tdhook_fn "
                               "pure function or a compat context; remove the rule there (handle.remove()) and give "
                               "it to LRP's rule_mapper or to tdhook_fn.attribution.lrp's rules instead")
        self.rule._check_call(args, output)
        if not _requires_grad(args):  # no relevance can flow: the output as a constant, as tdhook's
            return output.detach() if isinstance(output, torch.Tensor) else None
        rule = self.rule.rule()
        taps = rule_taps(functional(module), lambda path, _m: rule if path == "" else None, warn_on_missing_rule=False)
        token = _RUNNING.set(self)
        try:
            ruled, _ = call_with_taps(module, params(module), taps, *args, **kwargs)
        finally:
            _RUNNING.reset(token)
        return ruled


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
    if getattr(module, "inplace", False) is True:
        raise ValueError(f"{name}.register: {type(module).__name__} writes its input in place (inplace=True), so "
                         "the rule could not see the input it was given; build the module with inplace=False")
    registration = _Registration(rule, module)
    with _LOCK:
        held = _REGISTERED.get(module)
        if held is not None:
            raise ValueError(f"{name}.register: this {type(module).__name__} already has "
                             f"{type(held[0].rule).__name__} registered; remove it first (its handle's remove(), or "
                             "rule.unregister(module))")
        hook = module.register_forward_hook(registration.hook, prepend=True, with_kwargs=True)
        _REGISTERED[module] = (registration, hook)
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
    held[1].remove()
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
