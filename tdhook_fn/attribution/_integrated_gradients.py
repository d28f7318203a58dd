"""Integrated gradients (Sundararajan et al. 2017), in input space or in a layer's space."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from tensordict import TensorDict, TensorDictBase

from .._functional import Functional
from .._paths import resolve_path
from .._taps import Tap, capture, intervene
from .._targets import Target
from .._types import GradFn, NestedKey, PureFn
from .._vjp import untransformed
from ._baselines import (
    Baselines,
    attributed_keys,
    both_ends,
    fold,
    in_dtypes,
    interpolation,
    path_points,
    path_starts,
    quadrature,
    wide,
)
from ._convergence import delta_of
from ._engine import Cotangents, as_functional, grad_taps, gradients, scaled
from ._inputs import accepts_tensors, check_call, check_layers
from ._layer_specs import LayerSpec, StaleSpec, check_runs, run_counters, with_specs
from ._path_gradients import gradients_along_path
from ._replaced_derivatives import as_values, replaces_any
from ._target_values import target_values

__all__ = ["integrated_gradients"]


@accepts_tensors
def integrated_gradients(
    f: PureFn,
    params: TensorDictBase,
    inputs: TensorDictBase,
    baselines: Baselines,
    *,
    target: Target,
    n_steps: int = 50,
    method: str = "gausslegendre",
    multiply_by_inputs: bool = True,
    per_target: bool = False,
    chunk_size: int | None = None,
    return_convergence_delta: bool = False,
    layers: Sequence[str] = (),
    interpolate: Literal["layers", "inputs"] = "layers",
    target_layers: Sequence[str] = (),
    use_inputs: bool = True,
    input_keys: NestedKey | Sequence[NestedKey] | None = None,
    grad_fns: Mapping[str, GradFn] | None = None,
    taps: Sequence[Tap] = (),
    cotangents: Cotangents | None = None,
    layer_calls: Mapping[str, int] | None = None,
) -> TensorDict | tuple[TensorDict, torch.Tensor]:
    """Integrated gradients along the straight line from ``baselines`` to ``inputs``.

    ``attr = (x - b) * sum_k w_k * grad F(b + a_k (x - b))`` with the nodes ``a_k`` and
    weights ``w_k`` of ``method`` (captum's, see `quadrature`). All path points of a
    chunk go through ``f`` in one forward and one VJP; several targets give one map each
    with ``per_target`` (a vmapped VJP, no extra forward).

    Args:
        f (Functional | Callable): pure ``f(params, td) -> td``.
        params (TensorDict): parameters for ``f`` (constants here).
        inputs (TensorDict | Tensor): inputs, any batch size ``[*B]``; or a tensor, batch
            first, for an ``f`` with one in_key (the result is then a tensor; see
            `saliency`).
        baselines (TensorDict | Tensor | float): a baseline per attributed input key; a
            tensor for the one attributed input; or one number for all. A baseline has its
            input's shape or one that broadcasts to it (one sample's, ``[1, ...]``).
        target (int | tuple[int, ...] | Tensor | Callable): see `tdhook_fn.as_target`;
            a tensor holds one class index per sample.
        n_steps (int): number of path points. Default: 50.
        method (str): ``riemann_left|right|middle|trapezoid`` or ``gausslegendre``.
        multiply_by_inputs (bool): multiply by ``x - b`` (the integrated gradients of the
            paper; ``False`` gives the path-averaged gradient). Default: ``True``, as
            captum's ``IntegratedGradients``; the compat
            `IntegratedGradients` defaults to
            ``False``, as tdhook 0.1.3 does.
        per_target (bool): one map per target on a new leading dim ``T``. Default: the sum.
        chunk_size (int | None): path points per forward; bounds memory. The result is
            the same up to a few ulps.
        return_convergence_delta (bool): also return ``sum(attr) - (F(x) - F(b))`` per
            sample (and per target), as captum defines it, over the maps of the path's
            space: the inputs', or the layers' with ``interpolate="layers"`` (gradients
            read at layers while the inputs move are no shares of the change); with
            ``cotangents`` the change is weighted by them.
        layers (Sequence[str]): attribute activations at these paths instead.
        interpolate (str): for ``layers``, ``"layers"`` interpolates the activations
            themselves between their values at ``b`` and ``x`` (captum's
            ``LayerIntegratedGradients``; inputs are then not attributed); ``"inputs"``
            interpolates the inputs and integrates the gradients read at the layers
            (tdhook's ``IntegratedGradients`` with ``input_modules``; layer results are
            not multiplied).
        target_layers (Sequence[str]): paths whose activations the target sees, as in `saliency`.
        use_inputs (bool): attribute the inputs, as in `saliency`. Default: ``True``.
        input_keys (Sequence | None): which inputs, as in `saliency`. Default: ``f.in_keys``.
        grad_fns (Mapping[str, Callable] | None): path -> function applied to the gradient at that
            module's output, as in `saliency`.
        taps (Sequence[Tap]): any further taps for the call, as in `saliency`.
        cotangents (Callable | None): the gradients fed back from the targets, as in `saliency`.
            Default: ones.
        layer_calls (Mapping[str, int] | None): the run to attribute of a layer whose module runs
            more than once, as in `saliency`.

    Returns:
        TensorDict | tuple[TensorDict, Tensor]: attributions keyed like the attributed
        inputs (and layer paths), batch ``[*B]`` or ``[T, *B]``; with the delta, shaped
        ``[*B]`` or ``[T, *B]``. For a tensor ``inputs`` the one map is a tensor.

    Raises:
        KeyError: a baseline is missing for an attributed key.
        ValueError: baseline and input shapes differ (or do not broadcast); unknown method
            or too few steps.
        TypeError: an input to interpolate is not floating point (token ids: interpolate at
            the embedding layer with ``layers=[...]``, ``interpolate="layers"``).
        ValueError: ``f`` takes several inputs as keywords (``functional(model,
            in_keys={...})``) and ``input_keys`` does not say which the baselines replace.
        ValueError: ``return_convergence_delta`` with ``use_inputs=False`` in input space
            (no map of the path's space), or with cotangents that depend on the values.

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
        >>> x = TensorDict(input=torch.randn(5, 3), batch_size=[5])
        >>> attr, delta = integrated_gradients(f, p, x, 0.0, target=1, return_convergence_delta=True)
        >>> attr["input"].shape, bool(delta.abs().max() < 1e-3)
        (torch.Size([5, 3]), True)
        >>> f, p = tdhook_fn.pure(net)  # captum's IntegratedGradients(net).attribute(x, target=pred)
        >>> pred = net(x["input"]).argmax(-1)
        >>> integrated_gradients(f, p, x["input"], 0.0, target=pred).shape
        torch.Size([5, 3])
    """
    alphas, steps = quadrature(method, n_steps)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"integrated_gradients: chunk_size should be None or an int > 0, got {chunk_size!r}")
    in_layer_space = bool(layers) and interpolate == "layers"
    if interpolate not in ("layers", "inputs"):
        raise ValueError(f"interpolate must be 'layers' or 'inputs', got {interpolate!r}")
    if return_convergence_delta and not (in_layer_space or use_inputs):
        raise ValueError("integrated_gradients: return_convergence_delta needs the maps of the path's space: the "
                         "inputs' (use_inputs=True), or the layers' with interpolate='layers'; the gradients read at "
                         "layers while the inputs move do not sum to the change (tdhook_fn.attribution."
                         "convergence_delta sums any maps you give it)")
    if type(layers) is not tuple or layers:  # (the default () needs no check)
        check_layers("integrated_gradients", layers)
    check_call("integrated_gradients", f, params, inputs, target=target)
    base_keys = attributed_keys("integrated_gradients", f, inputs, input_keys)
    path_keys = () if in_layer_space else base_keys  # layer space: inputs stay, activations move
    _check_interpolable(inputs, path_keys)
    all_taps = grad_taps(grad_fns, taps)
    replaced = bool(all_taps) and replaces_any(all_taps)  # (asked only where there are taps)
    if replaced:  # the inputs and baselines are values (NOTE [replaced derivatives are not differentiated])
        inputs = as_values("integrated_gradients", params, inputs)
    base = path_starts(inputs, baselines, base_keys, "integrated_gradients")
    if replaced:
        base = base.detach()
    keys = () if in_layer_space or not use_inputs else base_keys
    ends: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if layers and not in_layer_space:  # the inputs move, gradients read at the layers: the layer pullbacks
        total, dtypes = gradients_along_path(
            as_functional(f), params, inputs, base, path_keys, target, layers=layers, alphas=alphas, weights=steps,
            input_keys=keys, per_target=per_target, chunk_size=chunk_size, layer_calls=layer_calls, taps=all_taps,
            target_layers=target_layers, cotangents=cotangents, caller="integrated_gradients")
    else:
        ends = _layer_ends(f, params, inputs, base, layers, all_taps, layer_calls) if in_layer_space else {}
        options: dict[str, Any] = dict(
            input_keys=keys, target_layers=target_layers, taps=all_taps, per_target=per_target,
            cotangents=cotangents, layer_calls=layer_calls, caller="integrated_gradients", checked=True)
        summed: TensorDict | None = None
        size = chunk_size or n_steps
        for start in range(0, n_steps, size):
            chunk = slice(start, min(start + size, n_steps))
            points = path_points(inputs, base, path_keys, alphas[chunk])
            replace: dict[str, Any] = {}
            for path, (start_act, end_act) in ends.items():  # (a loop: no comprehension call, on every chunk)
                replace[path] = _interpolator(start_act, end_act, alphas[chunk])
            grads = gradients(f, params, points, target, layers=replace, **options).grads
            summed = fold(summed, grads, steps[chunk], lead=1 if per_target else 0)
        assert summed is not None
        total, dtypes = summed, {}
        for key, g in grads.items(True, True):
            dtypes[key] = g.dtype
    if multiply_by_inputs:  # by x - b in the space of the path: inputs, or the layers' activations
        differences = {k: wide(inputs.get(k)) - wide(base.get(k)) for k in keys}
        differences.update({p: wide(x) - wide(b) for p, (b, x) in ends.items()})
        total = scaled(total, differences)
    attrs = in_dtypes(total, dtypes)  # half precision: rounded once, at the end
    if not return_convergence_delta:
        return attrs
    counted = attrs if in_layer_space else attrs.select(*keys)  # the path's space's maps (NOTE [convergence delta])
    values = target_values(f, params, both_ends(inputs, base), target, target_layers=target_layers, taps=all_taps)
    return attrs, delta_of(values, inputs.batch_size, counted, per_target, cotangents)


def _check_interpolable(inputs: TensorDictBase, keys: Sequence[NestedKey]) -> None:
    for key in keys:
        value = inputs.get(key, None)
        if isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex()):
            raise TypeError(
                f"integrated_gradients: input {key!r} is {value.dtype} and cannot be interpolated between baseline "
                "and input (every path point would round to the baseline). For token ids interpolate at the "
                "embedding layer: layers=['<embedding path>'], interpolate='layers'"
            )


def _layer_ends(f: PureFn, params: TensorDictBase, inputs: TensorDictBase, base: TensorDictBase,
                layers: Sequence[str], taps: Sequence[Tap],
                layer_calls: Mapping[str, int] | None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Activations at the baselines and at the inputs, for layer-space interpolation."""
    if not isinstance(f, Functional):
        raise TypeError("layer attribution needs f to be a tdhook_fn.Functional")
    batch = inputs.batch_size
    flat = both_ends(inputs, base).reshape(-1)

    def run(specs: list[LayerSpec]) -> TensorDictBase:
        runs = [0] * len(layers)
        probe = f.with_taps(*taps, *(capture(p, key=f"_tdhook_fn_end_{i}", call=spec.call)
                                     for i, (p, spec) in enumerate(zip(layers, specs, strict=True))),
                            *run_counters(layers, runs))
        out = probe(params, flat)
        check_runs(layers, specs, runs)
        for i, (path, spec) in enumerate(zip(layers, specs, strict=True)):
            act = out.get(f"_tdhook_fn_end_{i}")
            if not isinstance(act, torch.Tensor) or act.shape != spec.shape:
                raise StaleSpec(path, type(act).__name__ if not isinstance(act, torch.Tensor) else
                                f"{list(act.shape)}", f"{list(spec.shape)}")
        return out

    out = with_specs(f.with_taps(*taps), params, flat, layers, layer_calls, "integrated_gradients", run)
    if len(layers) > 1:
        _refuse_layers_in_series(f, params, flat, layers, taps, layer_calls)
    ends = {}
    for i, path in enumerate(layers):
        act = out.get(f"_tdhook_fn_end_{i}")
        act = act.reshape(2, *batch, *act.shape[1:])  # first dim: flattened [2, *B]
        ends[path] = (act[0], act[1])
    return ends


def _refuse_layers_in_series(f: Functional, params: TensorDictBase, flat: TensorDictBase, layers: Sequence[str],
                             taps: Sequence[Tap], layer_calls: Mapping[str, int] | None) -> None:
    """Raise where one interpolated layer feeds another: the later one's interpolation would cut the earlier's
    gradient (its maps all zero), or where two paths name one module.

    One probe forward in which every layer's activation is replaced by NaN after it is
    read: a layer that reads NaN depends on another (eager only: the data decide).
    """
    modules = [resolve_path(f.model, p) for p in layers]
    twice = [p for i, p in enumerate(layers) if any(m is modules[i] for m in modules[:i])]
    if twice:
        raise ValueError(f"integrated_gradients: layers {list(layers)} name one module twice ({twice[0]!r})")
    if not untransformed():
        raise ValueError("integrated_gradients: several layers in layer space need an eager call (whether one feeds "
                         "another is read from the data); under a transform give one layer per call")
    calls = dict(layer_calls or {})
    reads = [capture(p, key=f"_tdhook_fn_series_{i}", call=calls.get(p)) for i, p in enumerate(layers)]
    nans = [intervene(p, lambda a: torch.full_like(a, float("nan")), call=calls.get(p)) for p in layers]
    out = f.with_taps(*taps, *reads, *nans)(params, flat)
    fed = [p for i, p in enumerate(layers) if bool(out.get(f"_tdhook_fn_series_{i}").isnan().any())]
    if fed:
        raise ValueError(
            f"integrated_gradients: layer {fed[0]!r} depends on another of layers={list(layers)}: interpolating both "
            "would cut the gradient of the earlier one (its maps all zero). Attribute one layer per call (captum "
            "refuses this too)")


def _interpolator(
    start: torch.Tensor, end: torch.Tensor, alphas: Sequence[float]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Replaces the activation of the flattened points ``[n * N, ...]`` by the interpolation."""
    values = interpolation(start, end, alphas)

    def replace(act: torch.Tensor) -> torch.Tensor:
        return values.reshape(act.shape)

    return replace
