"""``IntegratedGradients`` (``tdhook.attribution.integrated_gradients``)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase

from tdhook_fn import label
from tdhook_fn.attribution import convergence_delta, integrated_gradients

from .gradient_helpers import GradientAttributionWithBaseline
from .gradient_helpers.common import AttributionCall, PathLayout, UserFn, inherited
from .gradient_helpers.helpers import SUPPORTED_METHODS, approximation_parameters

__all__ = ["IntegratedGradients"]


def _rebatch(td: TensorDictBase, source: int, dest: int) -> TensorDict:
    """Move batch dim ``source`` of every leaf to ``dest``; the batch size is read from the leaves
    (a user function's TensorDict may have none)."""
    leaves = list(td.items(True, True))
    if not leaves:
        return TensorDict({}, batch_size=[])
    dims = max(source, dest) + 1
    shape = list(leaves[0][1].shape[:dims])
    shape.insert(dest, shape.pop(source))
    out = TensorDict({}, batch_size=shape)
    for key, value in leaves:
        out.set(key, value.movedim(source, dest))
    return out


# NOTE [moved steps]
# The path-point dim is moved twice on every call (to tdhook's layout and back): a TensorDict of tensors
# leaf by leaf into one new TensorDict (no Python call per leaf, no ``apply``), other contents
# by ``apply``, a user's TensorDict without its batch size by `_rebatch`, with the same result.


def _moved(td: TensorDictBase, source: int, dest: int, size: torch.Size, split: tuple[int, ...] = ()) -> TensorDict:
    """``td``'s batch (first reshaped to ``split``, if given) with dim ``source`` moved to ``dest``, then
    reshaped to ``size`` (NOTE [moved steps])."""
    leaves: dict[Any, torch.Tensor] = {}
    for key, value in td.items():
        if not isinstance(value, torch.Tensor):
            td = td.reshape(split) if split else td
            dims = list(td.batch_size)
            dims.insert(dest, dims.pop(source))
            applied = td.apply(partial(torch.movedim, source=source, destination=dest), batch_size=dims)
            assert applied is not None  # (None only in place)
            return applied.reshape(size)
        value = value.reshape(*split, *value.shape[td.batch_dims:]) if split else value
        moved = value.movedim(source, dest)  # (reshaped only when it must be: a view is one more autograd node)
        leaves[key] = moved if moved.shape[:len(size)] == size else moved.reshape(
            *size, *value.shape[len(split) or td.batch_dims:])
    return TensorDict(leaves, batch_size=size, device=td.device)


def steps_last(td: TensorDictBase, batch: torch.Size) -> TensorDictBase:
    """The method's ``[n, *B]`` (or ``[n * N]``) as tdhook's ``[*B, n]``."""
    size = td.batch_size
    split = () if size[1:] == batch else (size.numel() // max(batch.numel(), 1), *batch)
    return _moved(td, 0, len(batch), torch.Size((*batch, (split or size)[0])), split)


def steps_first(td: TensorDictBase, batch: torch.Size, like: torch.Size) -> TensorDictBase:
    """tdhook's ``[*B, n]`` back to the method's batch ``like``."""
    n, size = len(batch), td.batch_size
    if len(size) > n:
        return _moved(td, n, 0, like)
    out = _rebatch(td, n, 0)  # a user's TensorDict made without its batch size: read it from the leaves
    return out if out.batch_size == like else out.reshape(like)


# tdhook's integrated gradients put the path points last (NOTE [tdhook's targets, pure])
_PATH_POINTS_LAST: PathLayout = (steps_last, steps_first)


class IntegratedGradients(GradientAttributionWithBaseline):
    """Integrated gradients (and their layer variant for ``input_modules``), as tdhook computes them.

    Computed by `tdhook_fn.attribution.integrated_gradients` with ``interpolate="inputs"``. Takes
    the arguments of `GradientAttributionWithBaseline` (``multiply_by_inputs`` defaults to ``False``,
    as in tdhook), and ``method`` and ``n_steps`` of the pure function.
    """

    _layout = _PATH_POINTS_LAST

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
        compute_convergence_delta: bool = False,
        baseline_key: Any = "baseline",
        multiply_by_inputs: bool = False,
        method: str = "gausslegendre",
        n_steps: int = 50,
    ) -> None:
        super().__init__(**inherited(locals(), "method", "n_steps"))
        self._method = method
        self._n_steps = n_steps
        if method not in SUPPORTED_METHODS:
            approximation_parameters(method)  # tdhook's ValueError for an unknown method, now

    def _attribute_with_baselines(
        self, call: AttributionCall, baselines: TensorDictBase
    ) -> tuple[TensorDictBase, Any]:
        attrs = integrated_gradients(
            call.f, call.params, call.inputs, baselines, n_steps=self._n_steps, method=self._method,
            multiply_by_inputs=self._multiply_by_inputs, layers=call.layers, interpolate="inputs",
            use_inputs=call.use_inputs, input_keys=call.input_keys, **call.options(),
        )
        assert isinstance(attrs, TensorDictBase)
        if not self._compute_convergence_delta:
            return attrs, None
        # tdhook's formula: every map counts, module ones too, and the change is not weighted by init_attr_grads
        return attrs, convergence_delta(call.f, call.params, call.inputs, baselines, attrs, target=call.target,
                                        input_keys=call.input_keys, target_layers=call.target_layers,
                                        taps=call.all_taps())

    @staticmethod
    def init_attr_targets_with_labels(
        outputs: TensorDict,
        additional_init_tensors: TensorDict,
        selected_out_keys: list[NestedKey],
        label_key: Any = "label",
    ) -> TensorDict:
        """A target: for each of ``selected_out_keys``, the class ``label_key`` names.

        Use as ``init_attr_targets=functools.partial(IntegratedGradients.init_attr_targets_with_labels,
        selected_out_keys=["output"])`` with ``additional_init_keys=["label"]``; the labels (``[*B]``) are
        broadcast over the trailing path-point dim.

        Raises:
            ValueError: an output has more than one dim after the batch dims.
        """
        targets = outputs.select(*selected_out_keys)
        labels = additional_init_tensors[label_key]
        picked = TensorDict({}, batch_size=targets.batch_size)
        for key, value in targets.items(True, True):
            chosen = labels[key] if isinstance(labels, TensorDictBase) else labels
            chosen = chosen.reshape((*chosen.shape, *[1] * (targets.batch_dims - chosen.dim())))
            expected = (*targets.batch_size, value.shape[-1])
            if value.shape != expected:
                raise ValueError(f"One-hot labels shape {expected} does not match target shape {tuple(value.shape)}")
            both = TensorDict(value=value, label=chosen.expand(targets.batch_size), batch_size=targets.batch_size)
            picked.set(key, label("label", "value")(both).get("value"))
        return picked
