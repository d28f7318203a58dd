"""``GradientAttribution`` and ``GradientAttributionWithBaseline`` (``tdhook.attribution.gradient_helpers``), and
one call of a prepared attribution module phrased in the terms of the pure methods (`AttributionCall`).

Differences from tdhook 0.1.3 are listed in ``docs/compat.md``.
"""

# NOTE [tdhook's targets, pure]
# tdhook hands ``init_attr_targets(targets, additional)`` the model outputs (``use_outputs``)
# and the ``target_modules`` activations keyed by path; the pure methods give their target
# callable the outputs and the ``target_layers`` activations under their path, from which
# `make_target` rebuilds tdhook's call. Two details keep user callables seeing what tdhook
# shows them:
#
# - Layout. tdhook's integrated gradients put the path points on a *trailing* batch dim
#   (``[*B, n]``); the pure method puts them first (``[n, *B]``, or ``[n * N]`` for the two
#   ends of the convergence delta). A factory's ``_layout`` moves them for the callables.
# - Convergence delta. tdhook evaluates ``init_attr_targets`` on the plain model outputs at
#   the baselines and the inputs, so a target TensorDict holding no target-layer key takes
#   the outputs, which is what the pure method's delta offers without target layers.

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase, unravel_key_list
from tensordict.nn import TensorDictModuleBase

from tdhook_fn import Functional, Tap, resolve_path
from tdhook_fn._types import GradFn
from tdhook_fn.attribution import saliency
from tdhook_fn.compat.contexts import UNTOUCHING_PREPARES, HookingContextFactory, under
from tdhook_fn.compat.hooks import HookFactory
from tdhook_fn.compat.modules import RoutedModule
from tdhook_fn.compat.modules._hooked import ContextWork, switch_on
from tdhook_fn.compat.modules._wrappers import check_td

from ._hook_callbacks import CACHE_OUT, CachedOutput, OwnHook, activations, grad_output_hook, placed

__all__ = [
    "Attributing",
    "AttributionCall",
    "GradFn",
    "GradientAttribution",
    "GradientAttributionWithBaseline",
    "PathLayout",
    "UserFn",
    "inherited",
    "make_cotangents",
    "make_target",
    "returned_td",
]

UserFn = Callable[[TensorDict, TensorDict], TensorDict]
TdFn = Callable[[TensorDictBase], TensorDictBase]
# a method's batch in tdhook's layout, ``(td, tdhook's batch)``, and back, ``(td, tdhook's batch, the method's)``
PathLayout = tuple[Callable[[TensorDictBase, torch.Size], TensorDictBase],
                   Callable[[TensorDictBase, torch.Size, torch.Size], TensorDictBase]]


# NOTE [the user's hooks after the method's]
# tdhook registers a context's own hooks (at input_modules, target_modules, output_grad_callbacks)
# when the context is entered, so on one module they run after the hooks registered before
# (a pre-factory's, an outer context's) and before those the user registers on the hooked
# module afterwards (unless ``prepend=True`` puts one first): the method reads and
# differentiates the module's output as the earlier hooks left it, and a later hook changes
# only what the rest of the model sees. Here the prepared module takes a mark of the
# registration order on entry (`order_mark`, from `switch_on`); the virtual hooks recorded
# before it are ``f``'s taps, those recorded after it are taps the pure method is handed last
# (``AttributionCall.hooks``), after the taps it makes for its layers and targets: the same
# order, on every forward the method runs. Backward hooks are the exception torch makes: a
# module's backward pre-hooks run on the gradient of its output as every forward hook left
# it, and its backward hooks in registration order, whatever wraps its tensors. So where the
# user hooked a module after entry, the context's own backward hooks there (guided
# backprop's, ``output_grad_callbacks``) are torch hooks too, registered first
# (`_hook_callbacks.placed`); elsewhere they are gradient maps, which also work on a module
# that writes its input in place (a torch backward hook there fails, in tdhook too).


@dataclass(frozen=True)
class AttributionCall:
    """What one call of a prepared module passes to a pure method: ``f`` (with the active virtual hooks
    recorded before the context was entered), detached ``params``, the ``in_keys`` and
    ``additional_init_keys`` entries (``[*B]``), the pure methods' options, the context's own hooks
    (``output_grad_callbacks``) as taps (``grad_hooks``), extra ``taps`` (``cache_callback`` captures), the virtual
    hooks recorded since, as taps (``hooks``, attached last: NOTE [the user's hooks after the method's]), and
    whether the context's hooks are on (``hooks_on``: NOTE [a context's own hooks])."""

    f: Functional
    params: TensorDictBase
    inputs: TensorDictBase
    input_keys: tuple[Any, ...]
    use_inputs: bool
    layers: tuple[str, ...]
    target_layers: tuple[str, ...]
    target: TdFn
    cotangents: TdFn | None
    grad_hooks: tuple[Tap, ...]
    taps: tuple[Tap, ...]
    hooks: tuple[Tap, ...]
    hooks_on: bool

    def options(self) -> dict[str, Any]:
        """Keyword arguments every pure method takes."""
        return {
            "target": self.target,
            "target_layers": self.target_layers,
            "grad_fns": None,
            "taps": self.all_taps() if self.grad_hooks or self.hooks else self.taps,  # (inline: on every call)
            "cotangents": self.cotangents,
        }

    def all_taps(self) -> tuple[Tap, ...]:
        """The context's hooks, the other taps, then the user's hooks. A hook at a module the forward never runs
        does nothing, as tdhook's callback never fires (the pure ``grad_fns`` refuse such a module)."""
        return (*self.grad_hooks, *self.taps, *self.hooks)


def returned_td(name: str, result: Any) -> TensorDictBase:
    """``result`` of the user's ``name`` callable, which must be a TensorDict (tdhook's ValueError)."""
    if not isinstance(result, TensorDictBase):
        raise ValueError(f"{name} function must return a TensorDict")
    return result


def make_target(
    out_keys: Sequence[Any],
    target_modules: Sequence[str],
    use_outputs: bool,
    init_attr_targets: UserFn | None,
    additional: TensorDict,
    layout: PathLayout | None,
    renamed: Mapping[str, str] | None = None,
) -> TdFn:
    """tdhook's target construction as a target callable (NOTE [tdhook's targets, pure]).

    ``additional`` holds the caller's ``additional_init_keys`` entries; ``layout``: the method's batch as tdhook
    lays it out and back (``None``: the same); ``renamed``: private capture key -> path (``cache_callback``).
    """
    batch = additional.batch_size

    def target(seen: TensorDictBase) -> TensorDictBase:
        like = seen.batch_size
        if layout is not None:
            seen = layout[0](seen, batch)
        if renamed:
            seen = seen.copy()
            for private, path in renamed.items():
                if private in seen.keys():
                    seen.set(path, seen.get(private))
        keys = list(out_keys) if use_outputs else []
        present = False
        for path in target_modules:  # (a loop: no call when there are none)
            if path in seen.keys():
                keys.append(path)
                present = True
        targets = seen.select(*(keys if present or use_outputs else out_keys))
        if init_attr_targets is not None:
            targets = init_attr_targets(targets, additional)
            if not isinstance(targets, TensorDictBase):
                returned_td("init_attr_targets", targets)  # raises
        return layout[1](targets, batch, like) if layout is not None else targets

    return target


def make_cotangents(init_attr_grads: UserFn, additional: TensorDict, layout: PathLayout | None) -> TdFn:
    """tdhook's ``init_attr_grads`` as the pure methods' ``cotangents``, with tdhook's checks."""
    batch = additional.batch_size

    def cotangents(values: TensorDictBase) -> TensorDictBase:
        targets = layout[0](values, batch) if layout is not None else values
        grads = returned_td("init_attr_grads", init_attr_grads(targets, additional))
        if grads.batch_size != targets.batch_size:
            raise ValueError("init_grads should have the same batch size as targets")
        if set(grads.keys(True, True)) != set(targets.keys(True, True)):
            raise ValueError("Targets and init_grads must have the same keys")
        return layout[1](grads, batch, values.batch_size) if layout is not None else grads

    return cotangents


_unravel: Callable[[list[NestedKey]], list[NestedKey]] = unravel_key_list  # (tensordict's, untyped)


def inherited(arguments: dict[str, Any], *own: str) -> dict[str, Any]:
    """A subclass ``__init__``'s ``locals()`` less ``self`` and its ``own`` parameters: its parent's arguments
    (subclasses restate tdhook's signature and call ``super().__init__(**inherited(locals(), "my_option"))``)."""
    parent = dict(arguments)
    for name in ("self", "__class__", *own):  # (a loop: a comprehension is one more call per subclass)
        parent.pop(name, None)
    return parent


class GradientAttribution(HookingContextFactory):
    """Base class of gradient attributions: gradients of targets w.r.t. inputs and modules.

    Subclasses implement `_attribute` (call a method of `tdhook_fn.attribution`),
    or, as in tdhook, `_grad_attr` (turn plain gradients into attributions).

    Args:
        use_inputs (bool): attribute the inputs. Default: ``True``.
        use_outputs (bool): the outputs are targets. Default: ``True``.
        input_modules (list[str] | None): module paths whose outputs are attributed, under
            ``(attribution_key, path)``. Default: none.
        target_modules (list[str] | None): module paths whose outputs are targets, seen by
            ``init_attr_targets`` under their path. Default: none.
        init_attr_targets (Callable | None): ``(targets, additional) -> TensorDict`` of
            the values to differentiate. Default: all targets.
        init_attr_inputs (Callable | None): ``(inputs, additional) -> TensorDict`` whose
            keys are the inputs attributed. Default: all ``in_keys``.
        init_attr_cache_in (Callable | None): ``(activations, additional) -> TensorDict``
            whose keys are the ``input_modules`` attributed.
        init_attr_grads (Callable | None): ``(targets, additional) -> TensorDict`` of the
            gradients fed back from the targets. Default: ones.
        additional_init_keys (list | None): keys of the input TensorDict passed to the
            callables above as ``additional``; not ``in_keys`` nor ``out_keys``.
        output_grad_callbacks (dict[str, Callable] | None): path -> callback replacing the
            gradient at that module's output (tdhook's ``set_grad_output`` callbacks).
        attribution_key (str | tuple[str, ...]): where results go. Default: ``"attr"``.
        clean_intermediate_keys (bool): accepted; there are no intermediate keys.
        cache_callback (Callable | None): ``(module, args, output, key, direction) -> value``
            giving the value of each ``target_modules`` entry.

    Raises:
        NotImplementedError: ``cache_callback`` with ``input_modules``.
        ValueError: (on entering a context) ``additional_init_keys`` overlap ``in_keys``
            or ``out_keys``; a callable's result is not a TensorDict (on calling).
    """

    _layout: PathLayout | None = None  # the method's batch as tdhook lays it out, and back (None: the same)
    _targets_of_its_own = False  # the subclass's `_call` names the targets (use_outputs and target_modules aside)

    def __init__(
        self,
        use_inputs: bool = True,
        use_outputs: bool = True,
        input_modules: list[str] | None = None,
        target_modules: list[str] | None = None,
        init_attr_targets: UserFn | None = None,
        init_attr_inputs: UserFn | None = None,
        init_attr_cache_in: UserFn | None = None,
        init_attr_grads: UserFn | None = None,
        additional_init_keys: list[NestedKey] | None = None,
        output_grad_callbacks: dict[str, Callable[..., Any]] | None = None,
        attribution_key: Any = "attr",
        clean_intermediate_keys: bool = True,
        cache_callback: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__()
        self._use_inputs = use_inputs
        self._use_outputs = use_outputs
        self._input_modules: list[str] = list(input_modules or [])
        self._target_modules: list[str] = list(target_modules or [])
        self._init_attr_targets = init_attr_targets
        self._init_attr_inputs = init_attr_inputs
        self._init_attr_cache_in = init_attr_cache_in
        self._init_attr_grads = init_attr_grads
        self._output_grad_callbacks = dict(output_grad_callbacks or {})
        self._cache_callback = cache_callback
        self._additional_init_keys: list[NestedKey] = list(additional_init_keys or [])
        self._attr_key = attribution_key
        if cache_callback is not None and self._input_modules:
            raise NotImplementedError(
                "cache_callback with input_modules is not supported: layer gradients are taken at the "
                "module output itself (cache_callback still applies to target_modules)"
            )
        for callback in self._output_grad_callbacks.values():
            HookFactory._check_callback_signature(callback, {"module", "grad_output"})
        if cache_callback is not None:
            HookFactory._check_callback_signature(cache_callback, {"module", "args", "output"})

    # -- the prepared module -------------------------------------------------------------

    def _module_keys(self, in_keys: list[NestedKey]) -> tuple[list[NestedKey], list[NestedKey]]:
        """``in_keys`` and ``out_keys`` of the prepared module."""
        return [*in_keys, *self._additional_init_keys], under(self._attr_key, in_keys)

    def _prepare_module(
        self, module: RoutedModule, in_keys: list[NestedKey], out_keys: list[NestedKey], extra_relative_path: str
    ) -> TensorDictModuleBase:
        """A module computing the attributions of ``module``'s model on each call (`_attribute`)."""
        return self._attributing(module, in_keys, out_keys, self._attribute)

    def _attributing(
        self, module: RoutedModule, in_keys: list[NestedKey], out_keys: list[NestedKey],
        method: Callable[[AttributionCall, TensorDict], TensorDictBase],
    ) -> TensorDictModuleBase:
        """A module writing ``method(call, td)`` under ``attribution_key`` on each call; ValueError (now):
        ``additional_init_keys`` overlap ``in_keys`` or ``out_keys``, or a module path does not resolve."""
        if set(self._additional_init_keys) & (set(in_keys) | set(out_keys)):
            raise ValueError("Additional init keys must not be in the in_keys or out_keys")
        if not (self._use_outputs or self._target_modules or self._targets_of_its_own):  # (tdhook: fails in autograd)
            raise ValueError(f"{type(self).__name__}: use_outputs=False and no target_modules leave nothing to "
                             "attribute: name target_modules, or keep use_outputs=True")
        model = module.model
        for path in [*self._input_modules, *self._target_modules]:
            resolve_path(model, path)  # fail on entry, as tdhook's hook registration does
        # tdhook's backward hooks registered on entry (NOTE [a context's own hooks])
        own: list[OwnHook] = []
        for path, callback in self._output_grad_callbacks.items():  # (a loop: a generator is one more call)
            own.append(grad_output_hook(path, callback, resolve_path(model, path)))
        cached: tuple[CachedOutput, ...] = ()
        if self._cache_callback is not None:
            cached = tuple(
                CachedOutput(path, "custom", self._cache_callback, key=f"{CACHE_OUT}{i}",
                             target=resolve_path(model, path))
                for i, path in enumerate(self._target_modules)
            )
        return Attributing(self, module, list(in_keys), list(out_keys), method, tuple(own), cached)

    # the context's own hooks are the prepared module's to apply: on from entry (NOTE [a context's own hooks])
    _hook_module = staticmethod(switch_on)

    def _call(self, prepared: Attributing, td: TensorDict) -> AttributionCall:
        """Everything the pure method needs for ``td`` in a call of ``prepared``."""
        module, cached, own = prepared._routed, prepared._cached, prepared._own
        in_keys, out_keys = list(prepared._context_keys[0]), list(prepared._context_keys[1])
        # the params the routed calls run with (a Pruning composed before gives pruned ones: NOTE [one scope])
        (f, hooks), params = module.functional_and_hooks(prepared.entered), module.params(detach=True)
        grad_hooks = placed(own, hooks) if own and prepared.on else ()  # (NOTE [a context's own hooks])
        additional = td.select(*self._additional_init_keys)
        inputs = td.select(*in_keys, *self._additional_init_keys)
        # (the user's choices asked for only when there is a callable: no call otherwise)
        input_keys: tuple[Any, ...]
        if self._init_attr_inputs is None:
            # the leaves under in_keys: in_keys themselves when each is a str naming a tensor (in select's order)
            for key in in_keys:  # (a loop, inline: no call per key)
                if not isinstance(key, str) or not isinstance(inputs.get(key), torch.Tensor):
                    input_keys = tuple(td.select(*in_keys).keys(True, True))
                    break
            else:
                input_keys = tuple(in_keys)
        else:
            chosen = self._init_attr_inputs(td.select(*in_keys), additional)
            input_keys = tuple(returned_td("init_attr_inputs", chosen).keys(True, True))
        layers = (tuple(self._input_modules) if self._init_attr_cache_in is None
                  else self._attributed_layers(f, hooks, params, inputs, additional))
        renamed = {tap.key: tap.path for tap in cached} if cached else None
        target = make_target(
            out_keys, self._target_modules, self._use_outputs, self._init_attr_targets, additional, self._layout,
            renamed,
        )
        cotangents = None
        if self._init_attr_grads is not None:
            cotangents = make_cotangents(self._init_attr_grads, additional, self._layout)
        return AttributionCall(
            f, params, inputs, input_keys, self._use_inputs, layers,
            () if cached else tuple(self._target_modules), target, cotangents, grad_hooks, cached, hooks, prepared.on,
        )

    def _attributed_layers(
        self, f: Functional, hooks: tuple[Tap, ...], params: TensorDictBase, inputs: TensorDictBase,
        additional: TensorDict,
    ) -> tuple[str, ...]:
        assert self._init_attr_cache_in is not None
        cache_in = activations(f, hooks, params, inputs, self._input_modules) if self._input_modules else TensorDict()
        keys = set(returned_td("init_attr_cache_in", self._init_attr_cache_in(cache_in, additional)).keys(True, True))
        unknown = keys - set(self._input_modules)
        if unknown:
            raise ValueError(
                f"init_attr_cache_in returned keys that are not input_modules: {sorted(map(str, unknown))}"
            )
        return tuple(path for path in self._input_modules if path in keys)

    # -- the method ----------------------------------------------------------------------

    def _attribute(self, call: AttributionCall, td: TensorDict) -> TensorDictBase:
        """The attributions for one call, keyed by input key and module path, batch ``[*B]``. Default:
        `_grad_attr` of the plain gradients and the attributed inputs and module activations."""
        grads = saliency(
            call.f, call.params, call.inputs, layers=call.layers, use_inputs=call.use_inputs,
            input_keys=call.input_keys, **call.options(),
        )
        values = call.inputs.select(*call.input_keys) if call.use_inputs else TensorDict({}, batch_size=td.batch_size)
        if call.layers:
            values.update(activations(call.f, call.hooks, call.params, call.inputs, call.layers).reshape(td.batch_size))
        return self._grad_attr(grads, values)

    def _grad_attr(self, grads: TensorDict, inputs: TensorDict) -> TensorDict:
        """Attributions from gradients and the values they are taken at (tdhook's hook)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _attribute or _grad_attr")


UNTOUCHING_PREPARES.add(GradientAttribution._prepare_module)  # (it builds a module, sets nothing)


class Attributing(ContextWork, TensorDictModuleBase):
    """The prepared module: ``method(call, td)`` under the factory's ``attribution_key`` on each call
    (the routed module, the context's, sits in ``__dict__``, no submodule of this one)."""

    _factory: GradientAttribution
    _routed: RoutedModule
    _context_keys: tuple[list[NestedKey], list[NestedKey]]
    _method: Callable[[AttributionCall, TensorDict], TensorDictBase]
    _own: tuple[OwnHook, ...]
    _cached: tuple[CachedOutput, ...]

    def __init__(
        self, factory: GradientAttribution, module: RoutedModule, in_keys: list[NestedKey], out_keys: list[NestedKey],
        method: Callable[[AttributionCall, TensorDict], TensorDictBase], own: tuple[OwnHook, ...],
        cached: tuple[CachedOutput, ...],
    ) -> None:
        super().__init__()
        module_in, module_out = factory._module_keys(in_keys)
        module_out = _unravel(module_out)
        # (what tensordict's in_keys/out_keys setters store, stored without nn.Module's checks per name)
        self.__dict__.update(_in_keys=_unravel(module_in), _out_keys=module_out,
                             _out_keys_apparent=module_out, _factory=factory, _routed=module,
                             _context_keys=(in_keys, out_keys), _method=method, _own=own, _cached=cached)

    def forward(self, td: TensorDict) -> TensorDict:
        factory = self._factory
        if not isinstance(td, TensorDictBase):
            check_td(type(factory).__name__, td, self._context_keys[0])  # raises
        call = factory._call(self, td)
        td.set(factory._attr_key, self._method(call, td))
        return td


class GradientAttributionWithBaseline(GradientAttribution):
    """A gradient attribution against baselines, read from ``(baseline_key, key)``.

    Takes the arguments of `GradientAttribution` (``*args``, ``**kwargs``), and:

    Args:
        compute_convergence_delta (bool): also write ``"convergence_delta"``:
            ``sum(attr) - (F(x) - F(baseline))`` per sample. Default: ``False``.
        baseline_key (str | tuple[str, ...]): where the baselines are. Default: ``"baseline"``.
        multiply_by_inputs (bool): multiply input attributions by ``x - baseline``.
            Default: ``False``.

    Raises:
        KeyError: (on calling) ``baseline_key`` is not in the TensorDict.
    """

    def __init__(
        self,
        *args: Any,
        compute_convergence_delta: bool = False,
        baseline_key: Any = "baseline",
        multiply_by_inputs: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._compute_convergence_delta = compute_convergence_delta
        self._baseline_key = baseline_key
        self._multiply_by_inputs = multiply_by_inputs

    def _module_keys(self, in_keys: list[NestedKey]) -> tuple[list[NestedKey], list[NestedKey]]:
        module_in, module_out = super()._module_keys(in_keys)
        module_in += under(self._baseline_key, in_keys)
        return module_in, module_out + (["convergence_delta"] if self._compute_convergence_delta else [])

    def _attribute(self, call: AttributionCall, td: TensorDict) -> TensorDictBase:
        baselines = td[self._baseline_key]  # KeyError naming it, as tdhook
        attrs, delta = self._attribute_with_baselines(call, baselines)
        if delta is not None:
            td.set("convergence_delta", delta)
        return attrs

    def _attribute_with_baselines(
        self, call: AttributionCall, baselines: TensorDictBase
    ) -> tuple[TensorDictBase, Any]:
        """Attributions and the convergence delta (``None`` unless asked for)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _attribute_with_baselines")
