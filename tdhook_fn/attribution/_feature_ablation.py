"""Feature ablation: the change of the target when a group of features is set to its baseline."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from .._targets import Target
from .._types import NestedKey, PureFn
from ._baselines import Baselines
from ._engine import flat_inputs
from ._feature_masks import FeatureMask, features, selected
from ._inputs import accepts_tensors
from ._perturbation import checked_keys, evaluate, flat_baselines, per_sample_views

__all__ = ["feature_ablation"]

_CALLER = "feature_ablation"


@accepts_tensors
def feature_ablation(
    f: PureFn,
    params: TensorDictBase,
    inputs: TensorDictBase,
    baselines: Baselines = 0.0,
    *,
    target: Target,
    feature_mask: FeatureMask = None,
    per_target: bool = False,
    chunk_size: int | None = None,
    input_keys: NestedKey | Sequence[NestedKey] | None = None,
) -> TensorDict:
    """``F(x) - F(x with feature group g set to its baseline)`` on every element of ``g``.

    captum's ``FeatureAblation``: every group of ``feature_mask`` is ablated on its own,
    and each element gets the change of its group. All ablated copies of the batch are
    built once and go through ``f`` in batched forwards of at most ``chunk_size`` groups,
    the unablated inputs riding with the first.

    Args:
        f (Functional | Callable): pure ``f(params, td) -> td``.
        params (TensorDict): parameters for ``f``.
        inputs (TensorDict | Tensor): inputs, any batch size ``[*B]``; or a tensor, batch
            first, for an ``f`` with one in_key (the result is then a tensor).
        baselines (TensorDict | Tensor | float): what an ablated element becomes: a
            baseline per perturbed key with the input's shape, a tensor that broadcasts to
            the one perturbed input, or a number. Integer inputs (token ids) take an id.
            Default: ``0.0``.
        target (int | tuple[int, ...] | Tensor | Callable): see `tdhook_fn.as_target`.
        feature_mask (Tensor | TensorDict | dict | None): integer feature ids per element,
            broadcasting to each perturbed input (one sample's shape groups all samples
            alike); an id shared by several keys is one group. Default: every element
            its own feature.
        per_target (bool): one map per target on a new leading dim ``T``. Default: the
            targets' sum.
        chunk_size (int | None): at most this many ablated copies of the batch per forward
            (captum's ``perturbations_per_eval``). Default: ``None``,
            equal chunks whose widest activation stays near 8 MiB on the CPU (probed
            once per ``f``): every copy in one forward for a narrow model, forwards that
            keep a wide one's activations in cache.
        input_keys (Sequence | None): the inputs to ablate. Default: ``f.in_keys``.

    Returns:
        TensorDict: keyed like the perturbed inputs, batch ``[*B]`` (``[T, *B]`` with
        ``per_target``), in the target values' dtype. A tensor for tensor ``inputs``.

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
        >>> f, p = tdhook_fn.pure(net)
        >>> x = TensorDict(input=torch.randn(5, 4), batch_size=[5])
        >>> groups = torch.tensor([[0, 0, 1, 1]])  # two features of two elements
        >>> attr = feature_ablation(f, p, x, 0.0, target=1, feature_mask=groups)
        >>> attr["input"].shape, bool((attr["input"][:, 0] == attr["input"][:, 1]).all())
        (torch.Size([5, 4]), True)
        >>> per_sample = torch.vmap(lambda td: feature_ablation(f, p, td, target=1))(x)
        >>> torch.allclose(per_sample["input"], feature_ablation(f, p, x, target=1)["input"], atol=1e-6)
        True
    """
    keys = checked_keys(_CALLER, f, params, inputs, target, input_keys, chunk_size)
    batch = inputs.batch_size
    starts = flat_baselines(_CALLER, inputs, baselines, keys)
    flat = flat_inputs(inputs)
    groups = features(_CALLER, inputs, keys, feature_mask)
    xs = per_sample_views(inputs, keys, inputs.batch_dims)

    def build(lo: int, hi: int) -> dict[NestedKey, torch.Tensor]:
        return {key: torch.where(selected(groups.positions[key], lo, hi), starts[key], xs[key]) for key in keys}

    values = evaluate(f, params, flat, target, rows=len(groups.ids) + 1, build=build, chunk_size=chunk_size,
                      per_target=per_target, caller=_CALLER,
                      baselines=list(starts.values()))
    change = (values[:1] - values[1:]).permute(2, 1, 0)  # [T, N, P]
    return groups.maps(change, keys, batch, per_target)
