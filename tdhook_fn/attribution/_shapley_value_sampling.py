"""Shapley value sampling: marginal contributions along random orders of the features, averaged."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from .._targets import Target
from .._types import NestedKey, PureFn
from ._baselines import Baselines
from ._engine import flat_inputs
from ._feature_masks import FeatureMask, features
from ._inputs import accepts_tensors
from ._metric_samples import check_count
from ._perturbation import checked_keys, evaluate, flat_baselines, per_sample_views

__all__ = ["shapley_value_sampling"]

_CALLER = "shapley_value_sampling"


@accepts_tensors
def shapley_value_sampling(
    f: PureFn,
    params: TensorDictBase,
    inputs: TensorDictBase,
    baselines: Baselines = 0.0,
    *,
    target: Target,
    n_samples: int = 25,
    feature_mask: FeatureMask = None,
    per_target: bool = False,
    chunk_size: int | None = None,
    input_keys: NestedKey | Sequence[NestedKey] | None = None,
    generator: torch.Generator | None = None,
) -> TensorDict:
    """Shapley values estimated from ``n_samples`` random orders of the features (Castro et al. 2009).

    captum's ``ShapleyValueSampling``: starting from the baselines, the features of
    ``feature_mask`` are switched to their input values one at a time in a random order;
    each feature's share is the change of the target its switch makes, averaged over the
    orders, and every element of a group gets the group's share. The shares of one order
    sum to ``F(x) - F(baselines)`` (efficiency), so their mean does too. Every state of
    every order (``n_samples * P`` copies of the batch) is built once and goes through
    ``f`` in batched forwards of at most ``chunk_size`` states. The orders are shared by
    all samples, as captum's.

    Args:
        f (Functional | Callable): pure ``f(params, td) -> td``.
        params (TensorDict): parameters for ``f``.
        inputs (TensorDict | Tensor): inputs, any batch size ``[*B]``; or a tensor, batch
            first, for an ``f`` with one in_key (the result is then a tensor).
        baselines (TensorDict | Tensor | float): where the features start, as in
            `feature_ablation`. Default: ``0.0``.
        target (int | tuple[int, ...] | Tensor | Callable): see `tdhook_fn.as_target`.
        n_samples (int): number of random orders. Default: ``25`` (captum's).
        feature_mask (Tensor | TensorDict | dict | None): integer feature ids ``0 .. P - 1``
            per element, as in `feature_ablation` (ids missing from the mask are features
            without elements, as in captum: their share is 0). Default: every element its
            own feature.
        per_target (bool): one map per target on a new leading dim ``T``. Default: the
            targets' sum.
        chunk_size (int | None): at most this many states per forward (captum's
            ``perturbations_per_eval``). Default: ``None``,
            equal chunks whose widest activation stays near 8 MiB on the CPU (probed
            once per ``f``): every copy in one forward for a narrow model, forwards that
            keep a wide one's activations in cache.
        input_keys (Sequence | None): the inputs whose features are switched. Default:
            ``f.in_keys``.
        generator (torch.Generator | None): the random generator the orders are drawn from
            (``torch.randperm`` per order). Default: torch's global one, so that a seeded
            call draws captum's orders.

    Returns:
        TensorDict: keyed like the perturbed inputs, batch ``[*B]`` (``[T, *B]`` with
        ``per_target``), in the target values' dtype. A tensor for tensor ``inputs``.

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
        >>> f, p = tdhook_fn.pure(net)
        >>> x = TensorDict(input=torch.randn(5, 4), batch_size=[5])
        >>> g = torch.Generator().manual_seed(0)
        >>> phi = shapley_value_sampling(f, p, x, 0.0, target=1, n_samples=8, generator=g)["input"]
        >>> change = net(x["input"])[:, 1] - net(torch.zeros(1, 4))[:, 1]
        >>> torch.allclose(phi.sum(-1), change, atol=1e-5)  # efficiency
        True
    """
    check_count(_CALLER, "n_samples", n_samples)
    keys = checked_keys(_CALLER, f, params, inputs, target, input_keys, chunk_size)
    batch = inputs.batch_size
    starts = flat_baselines(_CALLER, inputs, baselines, keys)
    flat = flat_inputs(inputs)
    groups = features(_CALLER, inputs, keys, feature_mask, dense=True)
    n_features = len(groups.ids)
    xs = per_sample_views(inputs, keys, inputs.batch_dims)
    device = xs[keys[0]].device
    orders = torch.stack([torch.randperm(n_features, generator=generator) for _ in range(n_samples)]).to(device)
    ranks = torch.argsort(orders, dim=1)  # [S, P]: where each feature comes in each order

    def build(lo: int, hi: int) -> dict[NestedKey, torch.Tensor]:
        # row 0: the baselines; row 1 + s * P + i: order s after its first i + 1 switches
        state = torch.arange(lo, hi, device=device) - 1
        order, step = state.div(n_features, rounding_mode="floor").clamp(min=0), state % n_features
        step = torch.where(state < 0, -1, step)
        out = {}
        for key in keys:
            pos = groups.positions[key]
            rank = ranks[order][:, pos.reshape(-1)].reshape(hi - lo, *pos.shape)  # [p, N or 1, *feat]
            switched = rank <= step.reshape(-1, *[1] * pos.dim())
            out[key] = torch.where(switched, xs[key], starts[key])
        return out

    values = evaluate(f, params, flat, target, rows=1 + n_samples * n_features, build=build, chunk_size=chunk_size,
                      per_target=per_target, caller=_CALLER,
                      baselines=list(starts.values()))
    states = values[1:].reshape(n_samples, n_features, *values.shape[1:])  # [S, P, N, T]
    before = torch.cat([values[:1].expand(n_samples, 1, *values.shape[1:]), states[:, :-1]], 1)
    steps = states - before  # [S, P, N, T]: the change of step i of order s
    index = ranks[:, :, None, None].expand(-1, -1, *values.shape[1:])
    shares = steps.gather(1, index).mean(0).permute(2, 1, 0)  # [T, N, P]: feature p's mean change
    return groups.maps(shares, keys, batch, per_target)
