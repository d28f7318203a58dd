"""KernelSHAP (Lundberg and Lee 2017): Shapley values as a weighted linear fit on random coalitions."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from .._targets import Target
from .._types import NestedKey, PureFn
from ._baselines import Baselines
from ._inputs import accepts_tensors
from ._surrogate import FeatureMask, evaluate, interpretable_samples, maps, prepare
from ._surrogate_fit import least_squares

__all__ = ["kernel_shap", "shapley_kernel_samples"]

_CALLER = "kernel_shap"
_END_WEIGHT = 1e6  # captum's stand-in for the infinite weight of the empty and the full coalition


@accepts_tensors
def kernel_shap(
    f: PureFn,
    params: TensorDictBase,
    inputs: TensorDictBase,
    baselines: Baselines = 0.0,
    *,
    target: Target,
    feature_mask: FeatureMask | None = None,
    n_samples: int | None = None,
    samples: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    per_target: bool = False,
    chunk_size: int | None = None,
    input_keys: NestedKey | Sequence[NestedKey] | None = None,
) -> TensorDict:
    """KernelSHAP attributions: Shapley values of the features, estimated by a weighted least-squares fit.

    captum's ``KernelShap``: the first interpretable samples are the full and the empty
    coalition (weight 1e6, standing in for infinity, so the values sum to
    ``F(x) - F(baseline)``), the others draw a coalition size ``k`` with probability
    proportional to ``(F - 1) / (k (F - k))`` and then ``k`` features uniformly (weight
    1), and least squares with an intercept fits the target values. Under that sampling
    the fit converges to the Shapley values as ``n_samples`` grows. The draws are batched
    (one call per kind of draw, see `shapley_kernel_samples`), so they differ from
    captum's interleaved ones; pass ``samples`` (e.g. captum's) to get captum's
    numbers. Every perturbed input runs through ``f`` in one batched forward
    (``chunk_size`` per input sample at a time) and every sample's and target's fit is
    one batched least-squares solve. The maps are differentiable in ``params``.

    Args:
        f (Callable): pure ``f(params, td) -> td``, e.g. from ``tdhook_fn.pure(model)``.
        params (TensorDict): parameters for ``f``.
        inputs (TensorDict | Tensor): inputs with any batch size ``[*B]``; or a tensor whose
            first dim is the batch (then the map comes back as a tensor).
        baselines (TensorDict | Tensor | float): what an absent feature's elements become:
            a TensorDict keyed like the attributed inputs, a tensor (one attributed input;
            its shape or one sample's) or a number. Token ids take an id. Default: ``0.0``.
        target (int | tuple[int, ...] | Tensor | Callable): see `tdhook_fn.as_target`.
        feature_mask (Tensor | TensorDict | dict | None): integer feature index of every
            element, per attributed key, broadcasting to the input (one sample's shape, or
            captum's ``[1, ...]``). Default: every element its own feature.
        n_samples (int | None): coalitions per input sample, the two end points included.
            Default: ``25`` (captum's), or the rows of ``samples``.
        samples (Tensor | None): the coalitions themselves, zeros and ones, ``[n, F]`` for
            every input sample or ``[*B, n, F]``; a row of all ones or all zeros gets the
            end-point weight. Default: drawn by `shapley_kernel_samples`.
        generator (torch.Generator | None): the generator the coalitions are drawn from.
            Default: torch's global one.
        per_target (bool): one map per target along a new leading dim ``T``, from the same
            forwards and one solve. Default: ``False`` (the targets' sum).
        chunk_size (int | None): at most this many perturbed inputs per input sample in
            one forward (captum's ``perturbations_per_eval``). Default: ``None``, all.
        input_keys (Sequence | None): the inputs perturbed. Default: every input ``f``
            reads; other entries pass unchanged.

    Returns:
        TensorDict: one map per attributed key, shaped like it, batch ``[*B]`` (``[T, *B]``
        with ``per_target``); for a tensor ``inputs``, the map as a tensor.

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        >>> f, p = tdhook_fn.pure(net)
        >>> x = TensorDict(input=torch.randn(3, 4), batch_size=[3])
        >>> g = torch.Generator().manual_seed(0)
        >>> phi = kernel_shap(f, p, x, target=1, n_samples=200, generator=g)["input"]
        >>> gap = net(x["input"])[:, 1] - net(torch.zeros(3, 4))[:, 1]
        >>> torch.allclose(phi.sum(-1), gap, atol=1e-3)  # efficiency
        True
        >>> per_sample = lambda td: kernel_shap(f, p, td, target=1, n_samples=50)["input"]
        >>> torch.vmap(per_sample, randomness="different")(x).shape
        torch.Size([3, 4])
    """
    surrogate = prepare(_CALLER, f, params, inputs, baselines, target, feature_mask, input_keys, chunk_size)
    n_features = surrogate.n_features
    samples = interpretable_samples(_CALLER, surrogate, samples, n_samples,
                                    lambda batch, n: shapley_kernel_samples(n_features, n, batch, generator=generator))
    values, _ = evaluate(_CALLER, f, params, surrogate, samples, target, per_target, chunk_size)
    sizes = samples.sum(-1)
    ends = (sizes == 0) | (sizes == n_features)
    weights = torch.where(ends, _END_WEIGHT, 1.0).to(values.dtype)
    return maps(surrogate, least_squares(samples.to(values.dtype), values, weights), per_target)


def shapley_kernel_samples(n_features: int, n_samples: int, batch: Sequence[int] = (), *,
                           generator: torch.Generator | None = None) -> torch.Tensor:
    """KernelSHAP's coalitions: the full one, the empty one, then ``n_samples - 2`` drawn.

    A drawn coalition has ``k`` features (``0 < k < F``) with probability proportional to
    ``(F - 1) / (k (F - k))`` (captum's sampling), its members uniform among the
    ``F`` (the ``k`` largest of ``F`` standard normal draws). All sizes are drawn in one
    call, then all normals.

    Args:
        n_features (int): ``F``, at least 2.
        n_samples (int): coalitions per input sample, the two end points included.
        batch (Sequence[int]): the input samples' batch shape ``[*B]``. Default: ``()``.
        generator (torch.Generator | None): the generator drawn from. Default: torch's global one.

    Returns:
        Tensor: bool ``[*B, n_samples, F]``, True where a feature is present.

    Examples:
        >>> s = shapley_kernel_samples(5, 6, generator=torch.Generator().manual_seed(0))
        >>> s.shape, s[0].all().item(), s[1].any().item()
        (torch.Size([6, 5]), True, False)
        >>> bool(((s[2:].sum(-1) > 0) & (s[2:].sum(-1) < 5)).all())
        True
    """
    if isinstance(n_features, bool) or not isinstance(n_features, int) or n_features < 2:
        raise ValueError(f"{_CALLER}: needs at least 2 features to sample coalitions, got {n_features!r}; with "
                         "one feature its Shapley value is F(x) - F(baseline)")
    batch = tuple(batch)
    ends = torch.stack([torch.ones(n_features, dtype=torch.bool), torch.zeros(n_features, dtype=torch.bool)])
    drawn = max(n_samples - 2, 0)
    sizes = torch.arange(1, n_features, dtype=torch.float64)
    probs = (n_features - 1) / (sizes * (n_features - sizes))
    count = int(torch.Size(batch).numel()) * drawn
    k = torch.multinomial(probs, count, replacement=True, generator=generator) + 1 if count else \
        torch.zeros(0, dtype=torch.long)
    normals = torch.randn(count, n_features, generator=generator)
    ranks = normals.argsort(-1).argsort(-1)  # 0 for the smallest
    members = ranks >= n_features - k.unsqueeze(-1)
    rows = torch.cat([ends.expand(*batch, 2, n_features)[..., :n_samples, :],
                      members.reshape(*batch, drawn, n_features)], -2)
    return rows
