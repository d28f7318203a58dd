"""DeepLiftShap: DeepLift averaged over a distribution of references, every pair in one batch.

On a chain the walk knows, the inputs and the references go forward once and the
backward runs on every pair (NOTE [pairs on the chain]); elsewhere every pair is
expanded into its own rows of `deeplift`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from .._targets import Target
from .._types import NestedKey, PureFn
from .._vjp import untransformed
from ._baselines import attributed_keys
from ._chain_walk import WalkPlan, holds_only, tensor_plan, walk_plan, walked_map
from ._deeplift import by_tensor_path, checked_functional, deeplift_as
from ._deeplift_chain import chain_deeplift
from ._deeplift_rules import EPS
from ._engine import unflatten
from ._inputs import UNSET, accepts_tensors_via
from ._lrp.checks import never_traced

__all__ = ["deeplift_shap"]



def _distribution(inputs: TensorDictBase, baselines: TensorDictBase | torch.Tensor,
                  keys: Sequence[NestedKey]) -> TensorDictBase | torch.Tensor:
    """The references: a TensorDict of batch ``[K]``, or as given, a tensor ``[K, ...]`` of the one attributed key;
    each key shaped like one sample of its input."""
    distribution = "deeplift_shap: baselines must be a distribution of K >= 1 references: a tensor [K, ...] " \
                   "shaped like one sample of the input, or a TensorDict of batch [K]"
    if isinstance(baselines, torch.Tensor):
        if len(keys) != 1:
            raise TypeError(f"deeplift_shap: a tensor of baselines fits one attributed input, but {len(keys)} are "
                            f"attributed {list(keys)}; pass a TensorDict of batch [K] holding each of them")
        if baselines.dim() == 0 or baselines.shape[0] < 1:
            raise TypeError(distribution)
        _check_shape(inputs.get(keys[0]).shape[inputs.batch_dims:], keys[0], baselines)
        return baselines
    if not isinstance(baselines, TensorDictBase) or baselines.batch_dims != 1 or baselines.batch_size[0] < 1:
        raise TypeError(distribution)
    for key in keys:
        if key not in baselines.keys(True, True):
            raise KeyError(f"deeplift_shap: the baselines hold no {key!r}; give one reference of each attributed input")
        _check_shape(inputs.get(key).shape[inputs.batch_dims:], key, baselines.get(key))
    return baselines


def _check_shape(want: torch.Size, key: NestedKey, references: torch.Tensor) -> None:
    """``references`` must be ``[K, *want]``, ``want`` one sample's shape of the input ``key``."""
    if references.shape[1:] != want:
        raise ValueError(f"deeplift_shap: baselines {key!r} has shape {list(references.shape)}; each of "
                         f"its K references must have one sample's shape {list(want)}, i.e. [K, *{list(want)}]")


def _deeplift_shap_of_tensor(f: PureFn, params: TensorDictBase, key: NestedKey, x: torch.Tensor,
                             baselines: TensorDictBase | torch.Tensor | None = None, *unknown: Any,
                             target: Target = UNSET, multiply_by_inputs: bool = True, eps: float = EPS,
                             per_target: bool = False, input_keys: NestedKey | Sequence[NestedKey] | None = None,
                             **unknown_keywords: Any) -> torch.Tensor | None:
    """`deeplift_shap`'s map of the tensor ``x`` against a tensor of references, by the chain walk on the pairs
    (NOTE [pairs on the chain]); ``None``: the TensorDict's way (which checks what is not as taken here)."""
    if unknown or unknown_keywords or target is UNSET or input_keys is not None \
            or not isinstance(baselines, torch.Tensor) or baselines.dim() == 0 or baselines.shape[0] < 1:
        return None
    _check_shape(x.shape[1:], key, baselines)
    plan = tensor_plan("deeplift_shap", f, params, x, eps, input_keys)
    if plan is None:
        return None
    return _pairs_maps(plan, params, x, 1, x.shape[:1], baselines, target, multiply_by_inputs, eps, per_target)


@never_traced  # (NOTE [lrp is never traced])
@accepts_tensors_via(_deeplift_shap_of_tensor)
def deeplift_shap(
    f: PureFn,
    params: TensorDictBase,
    inputs: TensorDictBase,
    baselines: TensorDictBase | torch.Tensor,
    *,
    target: Target,
    multiply_by_inputs: bool = True,
    eps: float = EPS,
    per_target: bool = False,
    input_keys: NestedKey | Sequence[NestedKey] | None = None,
) -> TensorDict:
    """DeepLift of every input against every reference of a distribution, averaged: captum 0.9's ``DeepLiftShap``.

    The ``N`` inputs and ``K`` references make ``N K`` pairs, and the maps are averaged
    over the references. Where `deeplift` takes its chain walk (a chain of the modules it
    knows, an index target), the ``N + K`` rows go forward once and the modified backward
    runs on the pairs; elsewhere the pairs go through `deeplift` as one batch (one
    forward of ``2 N K`` rows, one modified backward). With ``multiply_by_inputs`` the map of one sample sums to
    ``F(x) - mean_k F(b_k)`` on the models where `deeplift` is complete.

    Args:
        f (Functional): pure function of a model (`tdhook_fn.functional`).
        params (TensorDict): parameters for ``f`` (constants here).
        inputs (TensorDict | Tensor): inputs with any batch size ``[*B]``, as in `deeplift`.
        baselines (Tensor | TensorDict): ``K`` references: a tensor ``[K, ...]`` shaped
            like one sample of the attributed input, or a TensorDict of batch ``[K]``
            holding each attributed key.
        target (int | tuple[int, ...] | Tensor | Callable): see `tdhook_fn.as_target`; a
            callable sees the outputs of batch ``[*B, K]``.
        multiply_by_inputs (bool): multiply by ``inputs - baselines`` before averaging. Default: ``True``.
        eps (float): as in `deeplift`. Default: ``1e-10``.
        per_target (bool): one map per target along a new leading dim ``T``. Default: ``False``.
        input_keys (Sequence | None): which inputs the baselines replace. Default: ``f.in_keys``.

    Returns:
        TensorDict: keyed like the attributed inputs, batch ``[*B]`` or ``[T, *B]``.

    Raises:
        TypeError: the baselines are not a distribution of references (or do not match the keys).
        ValueError: a reference's shape differs from one sample's.

    Examples:
        >>> import torch, tdhook_fn
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
        >>> f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
        >>> x, refs = torch.randn(5, 3, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
        >>> attr = deeplift_shap(f, p, x, refs, target=0)
        >>> gap = net(x)[:, 0] - net(refs)[:, 0].mean()
        >>> torch.allclose(attr.sum(-1), gap)
        True
    """
    walked = by_tensor_path(_deeplift_shap_of_tensor, f, params, inputs, baselines, target=target,
                            per_target=per_target, multiply_by_inputs=multiply_by_inputs, eps=eps,
                            input_keys=input_keys)
    if walked is not None:
        return walked
    keys = attributed_keys("deeplift_shap", f, inputs, input_keys)
    distribution = _distribution(inputs, baselines, keys)
    if len(keys) == 1 and inputs.batch_dims and untransformed() and holds_only(inputs, keys[0]):
        references = distribution if isinstance(distribution, torch.Tensor) else distribution.get(keys[0])
        walked = _pairs_walked(f, params, inputs, references, keys[0], target, multiply_by_inputs, eps, per_target)
        if walked is not None:
            return walked
    if isinstance(distribution, torch.Tensor):
        distribution = TensorDict({keys[0]: distribution}, batch_size=distribution.shape[:1])
    batch, k = inputs.batch_size, distribution.batch_size[0]
    pairs = inputs.unsqueeze(-1).expand(*batch, k)
    references = distribution.select(*keys).expand(*batch, k)
    if isinstance(target, torch.Tensor) and target.dim() > 0:
        target = target.unsqueeze(-1).expand(*target.shape, k)
    maps = deeplift_as("deeplift_shap", f, params, pairs, references, target=target,
                       multiply_by_inputs=multiply_by_inputs, eps=eps, per_target=per_target, input_keys=list(keys))
    lead = 1 if per_target else 0
    return TensorDict({key: value.mean(lead + len(batch)) for key, value in maps.items(True, True)},
                      batch_size=maps.batch_size[: lead + len(batch)])


def _pairs_walked(f: PureFn, params: TensorDictBase, inputs: TensorDictBase, references: torch.Tensor,
                  key: NestedKey, target: Target, multiply: bool, eps: float, per_target: bool) -> TensorDict | None:
    """The maps by the chain walk on every pair (NOTE [pairs on the chain]); ``None``: not a chain the walk knows,
    or a target it does not read as the expanded pairs' path does (that path then decides)."""
    caller = "deeplift_shap"
    fn = checked_functional(caller, f, eps)
    plan = walk_plan(fn)
    if plan is None or plan.links is None:
        return None
    x, lead, batch = inputs.get(key), inputs.batch_dims, inputs.batch_size
    if not isinstance(x, torch.Tensor) or not isinstance(params, TensorDictBase):
        return None  # (what `check_call` would refuse, or the walk not read: the expanded pairs' path says so)
    plan.check_modes(fn.model, caller)
    maps = _pairs_maps(plan, params, x, lead, batch, references, target, multiply, eps, per_target)
    if maps is None:
        return None
    return walked_map(key, maps, batch, per_target)


def _pairs_maps(plan: WalkPlan, params: TensorDictBase, x: torch.Tensor, lead: int, batch: torch.Size,
                references: torch.Tensor, target: Target, multiply: bool, eps: float,
                per_target: bool) -> torch.Tensor | None:
    """The maps of ``x`` (``lead`` batch dims ``batch``) by the walk on the pairs, averaged over the references;
    ``None``: the walk does not apply, or a target it does not read as the expanded pairs' path does."""
    if isinstance(target, torch.Tensor) and target.dim() and target.shape != batch:
        return None  # (a label tensor of another shape: the expanded pairs' path reads or refuses it)
    if references.dtype != x.dtype or references.device != x.device:
        return None  # (what `check_call` would refuse, or the walk not read: the expanded pairs' path says so)
    flat = x if lead == 1 else x.reshape(-1, *x.shape[lead:])
    if not flat.shape[0]:
        return None  # (no pair: the expanded pairs' path gives the empty maps)
    walked = chain_deeplift(plan, params, flat, references, target, eps, per_target, pairs=True)
    if walked is None:
        return None
    first = 1 if per_target else 0
    n, k = flat.shape[0], references.shape[0]
    each = walked.view(*walked.shape[:first], n, k, *flat.shape[1:])  # (pair (i, j) at row i k + j)
    with torch.no_grad():  # (not differentiable, as `deeplift`'s maps)
        if multiply:  # (in place: the walk's maps are its own new tensor)
            each = each.mul_(flat.unsqueeze(1) - references)
        maps = each.mean(first + 1)
    return maps if lead == 1 else unflatten(maps, first, batch)
