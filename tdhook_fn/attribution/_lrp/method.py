"""Layer-wise relevance propagation (Bach et al. 2015) as modified VJPs on one pure forward."""

# NOTE [lrp as modified vjps]
# LRP replaces each module's backward by a rule's redistribution of relevance; here that
# is a VJP, never a swapped ``forward``, and the model is never touched. For every module
# with a rule, a tap on the call's shadow module sees the module's inputs ``x`` and output
# ``y`` and replaces ``y`` by ``_RuleVJP(y, x, tensors)``: an ``autograd.Function`` whose
# forward returns ``y`` unchanged and whose backward sends nothing back through ``y``'s own
# graph and gives ``x`` the rule's relevance ``rule.relevance(call, R)``, ``R`` being what
# arrives at the output. The tensors the rule needs (the module's parameters and buffers as
# the *call* sees them, i.e. the params given to `lrp`) are inputs of the function, so
# every transform (``vmap``, ``grad``, the engine's ``vjp``) sees them; the module's
# structure travels as a `Template` because the
# shadow is emptied when the forward returns, before the backward runs. Rules of the
# form ``R_i = x_i (J^T (factor * R))_i`` (epsilon) skip that second forward: they only
# scale gradients around the module's own backward (NOTE [gradient-form rules]). The
# rule's hook runs before any other hook on the module's output (``prepend``), so that a
# layer perturbation or a user intervention acts on the rule's output, and its input
# hook after all others (the rule taps come last), so that it sees what the module
# sees. Modules without a rule (and those with `Ignore`) keep their plain gradient.
#
# NOTE [zero-valued carriers]
# An ``autograd.Function`` under ``torch.func`` costs about 0.6 ms of Python per call
# (measured: it made lrp 1.8x slower than tdhook on an MLP). Where a rule only scales or
# forwards gradients (Pass, the gradient form), it is written with plain ops instead:
# ``t.detach() + (u - u.detach())`` has exactly the value of ``t`` (``u - u.detach()`` is
# exactly zero for finite ``u``) and the gradient of ``u``; a gradient scaled by ``w`` is
# ``lerp(t.detach(), t, w)``, one op. Only the rules that need their
# own backward (z+, alpha-beta, w², flat, ...) use ``_RuleVJP``.
#
# The "gradient" the engine pulls back to the inputs is then relevance: one forward, one
# pullback (per target: one-hot cotangents), as for every gradient method
# (NOTE [attribution engine]). The rules multiply by their inputs themselves (``R_i = x_i c_i``
# in the epsilon rule), so the result is *not* multiplied by the inputs again, as in
# tdhook. The relevance put in at the targets is the cotangent: ones (tdhook's default),
# one-hots with ``per_target``, or ``cotangents(targets)``. So relevances are those of the
# textbook formulation divided by the target value: with LRP-0 on a bias-free ReLU network
# the input relevance is ``x * grad / f(x)`` and sums to 1 per target (conservation).

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..._functional import Functional
from ..._in_place import Handed, handed, writes_in_place, written_back
from ..._params import leaves
from ..._taps import Captured, Handles, Tap
from ..._targets import Target
from ..._types import NestedKey
from ..._vjp import untransformed
from .._engine import Cotangents, gradients, input_keys_of
from .._inputs import accepts_tensors, check_layers
from .._replaced_derivatives import as_values, refuse_level_zero_graph
from .chain import chain_lrp
from .checks import check_module_call, check_pass, never_traced, raise_unless_conserved
from .composites import Rules, resolve_rules
from .module_call import ModuleCall, Template
from .plan import lrp_plan
from .rules import Pass, Rule

__all__ = ["lrp", "rule_taps", "ruled_gradients"]


@dataclass(frozen=True)
class _Site:
    """What a rule's backward needs besides tensors: the rule, the path, the structure."""

    rule: Rule
    path: str
    template: Template
    kwargs: dict[str, Any]
    n_inputs: int
    caller: str  # the method whose rules these are, which errors name


class _RuleVJP(torch.autograd.Function):
    """Identity forward on a module's output; the backward is the rule's, to the module's inputs."""

    generate_vmap_rule = True

    @staticmethod
    def forward(output: torch.Tensor, site: _Site, *tensors: torch.Tensor) -> torch.Tensor:
        # a copy, not a view: what reads it may write it in place (``out += identity``), which
        # autograd forbids on a Function's view (the saved output stays the module's own)
        return output.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.site = inputs[1]
        ctx.save_for_backward(inputs[0], *inputs[2:])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        site: _Site = ctx.site
        output, *tensors = ctx.saved_tensors
        inputs, state = tuple(tensors[: site.n_inputs]), tuple(tensors[site.n_inputs :])
        call = ModuleCall(site.path, inputs, output, site.template, state, site.kwargs, site.caller)
        relevances = list(site.rule.relevance(call, grad))
        if len(relevances) != len(inputs):
            raise ValueError(f"{site.caller}: the rule at {site.path!r} returned {len(relevances)} relevances for "
                             f"{len(inputs)} inputs")
        return (None, None, *relevances, *(None,) * len(state))


# (torch declares Function.apply untyped: its signature here, stated once)
_rule_vjp: Callable[..., Any] = _RuleVJP.apply


def _scaled(t: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``t`` unchanged, its gradient multiplied by ``factor`` on the way back (NOTE [zero-valued carriers]).

    ``lerp(t', t, w) = t' + w (t - t')`` with ``t' = t.detach()`` is ``t`` exactly (``t - t'``
    is zero) and its gradient with respect to ``t`` is ``w``: one op, where
    ``t' + (t w - (t w)')`` takes three.
    """
    return torch.lerp(t.detach(), t, factor.detach())


def _passed(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y`` unchanged, the gradient arriving at it sent to ``x`` as it is (the Pass rule)."""
    return y.detach() + (x - x.detach())


class _Originals:
    """The inputs a module that writes them in place (``inplace=True``) was called with, kept unwritten.

    Such a module gets copies (the last pre-hook), and the rule sees the originals: Pass
    on a ``ReLU(inplace=True)`` would otherwise pass relevance through the ReLU's own
    backward (its input *is* its output then), and a rule's backward would read the
    written values as its inputs. Where the module wrote its copy, the rule's result is
    written back into the original (NOTE [replaced derivatives of in-place modules]), so
    a rule's Function keeps copies of them. Other modules are left alone.
    """

    def __init__(self, module: nn.Module):
        self.stack: list[tuple[tuple[Any, ...], Handed | None]] = []
        self.handles: tuple[RemovableHandle, ...] = ()
        if writes_in_place(module):
            self.handles = (module.register_forward_pre_hook(self._copy),)

    def _copy(self, _m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        copies = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        self.stack.append((args, handed(args[0], copies[0]) if args else None))
        return copies

    def take(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], Handed | None]:
        """The module's inputs before it ran, and what `written` needs."""
        return self.stack.pop() if self.handles else (args, None)

    def kept(self, originals: tuple[Any, ...]) -> tuple[Any, ...]:
        """What a rule's Function keeps of ``originals``: copies where they are written back after."""
        if not self.handles:
            return originals
        return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in originals)


@dataclass(frozen=True)
class _RuleTap(Tap):
    """A tap putting ``rule``'s VJP at the module's output (see NOTE [lrp as modified vjps])."""

    rule: Rule | None = field(default=None)
    caller: str = field(default="lrp")  # the method whose rules these are, which errors name

    def attach(self, module: nn.Module, captured: Captured) -> RemovableHandle:
        rule, path, caller = self.rule, self.path, self.caller
        assert rule is not None

        # (an in-place module takes the rule's definition: its input is written back after)
        if callable(getattr(rule, "output_factor", None)) and not writes_in_place(module):
            return self._attach_gradient_form(module, rule)
        seen = _Originals(module)
        if isinstance(rule, Pass):
            return cast(RemovableHandle, Handles(self._attach_pass(module, seen), *seen.handles))

        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            args, run = seen.take(args)
            check_module_call(caller, path, args, kwargs, output)
            tensors: list[torch.Tensor] = []
            template = Template.of(mod, tensors)
            site = _Site(rule, path, template, dict(kwargs), len(args), caller)
            return written_back(run, _rule_vjp(output, site, *seen.kept(args), *tensors))

        handle = module.register_forward_hook(hook, prepend=True, with_kwargs=True)
        return cast(RemovableHandle, Handles(handle, *seen.handles))

    def _attach_pass(self, module: nn.Module, seen: _Originals) -> RemovableHandle:
        path, caller = self.path, self.caller

        def post(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            args, run = seen.take(args)
            check_module_call(caller, path, args, kwargs, output)
            check_pass(caller, path, args, output)
            return written_back(run, _passed(args[0], output))

        return module.register_forward_hook(post, prepend=True, with_kwargs=True)

    def _attach_gradient_form(self, module: nn.Module, rule: Any) -> RemovableHandle:
        """Scale the gradient at the inputs (last pre-hook) and output (first hook): NOTE [gradient-form rules]."""
        path, caller = self.path, self.caller

        def pre(_m: nn.Module, args: tuple[Any, ...]) -> Any:
            return tuple(_scaled(a, a) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)

        def post(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            check_module_call(caller, path, args, kwargs, output)
            return _scaled(output, rule.output_factor(path, len(args), output))

        handles = [module.register_forward_hook(post, prepend=True, with_kwargs=True)]
        if getattr(rule, "scales_inputs", False):
            handles.append(module.register_forward_pre_hook(pre))
        return cast(RemovableHandle, Handles(*handles))


def rule_taps(f: Functional, rules: Rules, *, warn_on_missing_rule: bool = True) -> list[Tap]:
    """One tap per module with a rule (not `Ignore`), for ``f.with_taps`` or any method's ``taps``.

    Args:
        f (Functional): pure function of a model (`tdhook_fn.functional`).
        rules (Mapping | Callable): which rule runs where, as in `lrp`.
        warn_on_missing_rule (bool): warn for each leaf module without a rule. Default: ``True``.
    """
    return _rule_taps(resolve_rules(f.model, rules, warn_on_missing_rule=warn_on_missing_rule))


def _rule_taps(ruled: Mapping[str, Rule], caller: str = "lrp") -> list[Tap]:
    return [_RuleTap(path, "custom", rule=rule, caller=caller) for path, rule in ruled.items()]


def _given(targets: TensorDictBase | None) -> Callable[[], TensorDictBase]:
    assert targets is not None  # (the engine's walk, which gives none, never runs with taps)
    return lambda: targets


@never_traced
@accepts_tensors
def lrp(
    f: Callable[[TensorDictBase, TensorDictBase], TensorDictBase],
    params: TensorDictBase,
    inputs: TensorDictBase,
    *,
    target: Target,
    rules: Rules,
    per_target: bool = False,
    layers: Sequence[str] = (),
    target_layers: Sequence[str] = (),
    use_inputs: bool = True,
    input_keys: NestedKey | Sequence[NestedKey] | None = None,
    warn_on_missing_rule: bool = True,
    check_conservation: bool = False,
    taps: Sequence[Tap] = (),
    cotangents: Cotangents | None = None,
    layer_calls: Mapping[str, int] | None = None,
) -> TensorDict:
    """Relevance of the inputs (and layer activations) for the target, by LRP rules.

    Each module with a rule passes relevance back by that rule (a modified backward of
    that module); the others by their plain gradient. The relevance put in at the targets is
    the cotangent (ones; one-hots with ``per_target``), so a map sums to about 1 per
    target where the rules conserve relevance, as in tdhook. Only the attributed inputs
    and the layer perturbations are differentiated; ``params`` are constants.

    Args:
        f (Functional): pure function of a model (`tdhook_fn.functional`).
        params (TensorDict): parameters for ``f``; the rules compute with these.
        inputs (TensorDict | Tensor): inputs with any batch size ``[*B]``; or a tensor,
            batch first (the result is then a tensor; see `saliency`).
        target (int | tuple[int, ...] | Tensor | Callable): see `tdhook_fn.as_target`.
        rules (Mapping | Callable): which rule runs where. A mapping from a submodule path
            (``"[0]"``), a regex over module names (``r"features\\.\\d+"``, full match) or
            an ``nn.Module`` class to a rule; exact paths win over patterns, patterns
            over classes, and earlier keys over later ones. Or a callable
            ``(name, module) -> rule | None`` such as `EpsilonPlus` (tdhook's
            ``rule_mapper``). Rules may not nest (a module with a rule inside another).
        per_target (bool): one map per target along a new leading dim ``T``, as in `saliency`.
            Default: ``False``.
        layers (Sequence[str]): paths attributed too, as in `saliency`; the result at a layer path is
            the relevance of that module's output.
        target_layers (Sequence[str]): paths whose activations the target sees, as in `saliency`.
        use_inputs (bool): attribute the inputs, as in `saliency`. Default: ``True``.
        input_keys (Sequence | None): which inputs, as in `saliency`. Default: ``f.in_keys``.
        taps (Sequence[Tap]): any further taps for the call, as in `saliency`.
        cotangents (Callable | None): the gradients fed back from the targets, as in `saliency`.
            Default: ones.
        layer_calls (Mapping[str, int] | None): the run to attribute of a layer whose module runs
            more than once, as in `saliency`.
        warn_on_missing_rule (bool): warn for each leaf module without a rule (its plain
            gradient is used). Default: ``True``, as tdhook.
        check_conservation (bool): raise ``RuntimeError`` unless the input relevance of
            each sample (and target) sums to the relevance put in at the targets (rtol
            and atol ``1e-4``; ``1e-6`` in float64). Holds for conserving rules on
            bias-free models; needs an eager call (not under ``vmap``). Default: ``False``.

    Returns:
        TensorDict: relevance keyed like the attributed inputs (and layer paths), batch
        ``[*B]`` or ``[T, *B]``.

    Raises:
        TypeError: ``f`` is not a Functional, ``rules`` is malformed, or a ruled module
            does not take and return tensors (the path is named).
        ValueError: a rules key names no submodule, rules nest, or a rule does not fit
            its module (``Pass`` on a shape-changing layer; the path is named).
        NotImplementedError: called under ``torch.func.grad``/``vjp``/``jvp``, with params
            that require grad, or with a closed-over tensor that makes the maps require
            grad (LRP maps are not differentiable); ``torch.no_grad()`` or detached
            params avoid it. Inputs that require grad are fine: they are read as values
            (the maps never require grad).
        RuntimeError: ``check_conservation`` and relevance is not conserved.

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> from tdhook_fn.attribution import Epsilon, Pass, lrp
        >>> _ = torch.manual_seed(0)
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4, bias=False), torch.nn.ReLU(),
        ...                           torch.nn.Linear(4, 2, bias=False)).double()
        >>> f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
        >>> x = TensorDict(input=torch.randn(5, 3, dtype=torch.float64), batch_size=[5])
        >>> rules = {torch.nn.Linear: Epsilon(1e-12), torch.nn.ReLU: Pass()}
        >>> r = lrp(f, p, x, target=1, rules=rules)
        >>> r["input"].shape
        torch.Size([5, 3])
        >>> r["input"].sum(-1)  # conserved: LRP-0 without biases sums to the relevance 1 put in
        tensor([1.0000, 1.0000, 1.0000, 1.0000, 1.0000], dtype=torch.float64)
        >>> per_sample = torch.func.vmap(lambda td: lrp(f, p, td, target=1, rules=rules))(x)
        >>> torch.allclose(per_sample["input"], r["input"])
        True
    """
    if not isinstance(f, Functional):
        raise TypeError("lrp needs f to be a tdhook_fn.Functional (it puts a rule on each module of f.model)")
    maps, targets = ruled_gradients(
        "lrp", f, params, inputs, target, rules, per_target=per_target, layers=layers, target_layers=target_layers,
        use_inputs=use_inputs, input_keys=input_keys, warn_on_missing_rule=warn_on_missing_rule, taps=taps,
        cotangents=cotangents, layer_calls=layer_calls)
    if check_conservation:
        keys = input_keys_of(f, inputs, input_keys) if use_inputs else ()
        raise_unless_conserved(maps.select(*keys), targets(), per_target, cotangents, inputs.batch_size)
    return maps


def ruled_gradients(caller: str, f: Functional, params: TensorDictBase, inputs: TensorDictBase, target: Target,
                    rules: Rules, *, per_target: bool = False, layers: Sequence[str] = (),
                    target_layers: Sequence[str] = (), use_inputs: bool = True,
                    input_keys: NestedKey | Sequence[NestedKey] | None = None, warn_on_missing_rule: bool = True,
                    taps: Sequence[Tap] = (), cotangents: Cotangents | None = None,
                    layer_calls: Mapping[str, int] | None = None) -> tuple[TensorDict, Callable[[], TensorDictBase]]:
    """`lrp`'s maps, and what gives the target values, for ``caller`` (`lrp`, or a method on its rules: DeepLift),
    whose name its errors carry."""
    values = leaves(params) if isinstance(params, TensorDictBase) else None  # (read once: checks and the walk)
    inputs = as_values(caller, params, inputs, values)
    keys = input_keys_of(f, inputs, input_keys) if use_inputs else ()
    check_layers(caller, layers)
    check_layers(caller, target_layers, "target_layers")
    plan = lrp_plan(f.model, rules, warn_on_missing_rule=warn_on_missing_rule)
    if len(keys) == 1 and not (per_target or taps or layers or target_layers or layer_calls) and untransformed():
        walked = chain_lrp(caller, f, params, inputs, keys[0], target, plan, cotangents, values)
        if walked is not None:
            return walked  # (the walk's maps never require grad: it runs without a graph, NOTE [lrp on a chain])
    result = gradients(
        f, params, inputs, target, input_keys=keys, layers=dict.fromkeys(layers), target_layers=target_layers,
        taps=[*taps, *_rule_taps(plan.ruled, caller)], per_target=per_target, cotangents=cotangents,
        layer_calls=layer_calls, caller=caller,
    )
    refuse_level_zero_graph(caller, result.grads)
    return result.grads, _given(result.targets)
