"""LIME (Ribeiro et al. 2016): a weighted linear model of the target on random feature subsets."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from .._targets import Target
from .._types import NestedKey, PureFn
from ._baselines import Baselines
from ._inputs import accepts_tensors
from ._surrogate import FeatureMask, check_weights, evaluate, interpretable_samples, maps, prepare
from ._surrogate_fit import FitFn, lasso, least_squares, ridge

__all__ = ["lime"]

SimilarityFn = Callable[[TensorDictBase, TensorDictBase, torch.Tensor], torch.Tensor]
_CALLER = "lime"
_MODELS = ("lasso", "ridge", "linear")


@accepts_tensors
def lime(
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
    interpretable_model: str | FitFn = "lasso",
    alpha: float | None = None,
    distance_mode: str = "cosine",
    kernel_width: float = 1.0,
    similarity_func: SimilarityFn | None = None,
    per_target: bool = False,
    chunk_size: int | None = None,
    input_keys: NestedKey | Sequence[NestedKey] | None = None,
) -> TensorDict:
    """LIME attributions: the coefficients of a local linear surrogate, written on each feature's elements.

    Equal to captum's ``Lime`` with its defaults: ``n_samples`` interpretable samples of
    the ``F`` features (`feature_mask`), each feature kept with probability 1/2, the rest
    set to the baseline; weights ``exp(-d^2 / (2 kernel_width^2))`` with ``d`` the cosine
    distance between the input and the perturbed input (all attributed keys, flattened);
    a lasso (``alpha=0.01``) with an intercept. The samples are drawn in captum's order:
    for one input sample, torch's global random state seeded alike gives captum's
    samples (between input samples captum's fitting draws from that state too, so for a
    batch pass ``samples`` to get its numbers). The lasso is solved to its optimum
    (captum's scikit-learn ``Lasso`` stops at ``tol=1e-4``). Every perturbed input runs
    through ``f`` in one batched forward (``chunk_size`` per input sample at a time),
    and the models of every sample and target are fitted in one batched solve. The maps
    are differentiable in ``params``.

    Args:
        f (Callable): pure ``f(params, td) -> td``, e.g. from ``tdhook_fn.pure(model)``.
        params (TensorDict): parameters for ``f``.
        inputs (TensorDict | Tensor): inputs with any batch size ``[*B]``; or a tensor whose
            first dim is the batch (then the map comes back as a tensor).
        baselines (TensorDict | Tensor | float): what a removed feature's elements become:
            a TensorDict keyed like the attributed inputs, a tensor (one attributed input;
            its shape or one sample's) or a number. Token ids take an id. Default: ``0.0``.
        target (int | tuple[int, ...] | Tensor | Callable): see `tdhook_fn.as_target`.
        feature_mask (Tensor | TensorDict | dict | None): integer feature index of every
            element, per attributed key, broadcasting to the input (one sample's shape, or
            captum's ``[1, ...]``). Default: every element its own feature, numbered
            across the keys in order.
        n_samples (int | None): interpretable samples per input sample. Default: ``25``
            (captum's), or the rows of ``samples``.
        samples (Tensor | None): the interpretable samples themselves, zeros and ones,
            ``[n, F]`` for every input sample or ``[*B, n, F]``. Default: drawn.
        generator (torch.Generator | None): the generator the samples are drawn from.
            Default: torch's global one (as captum).
        interpretable_model (str | Callable): ``"lasso"`` (captum's default),
            ``"ridge"``, ``"linear"`` (least squares), each with an intercept and the
            similarities as sample weights (scikit-learn's objectives); or a callable
            ``(X [*B, n, F], y [*B, n, T], weights [*B, n]) -> coefficients [*B, T, F]``.
            Default: ``"lasso"``.
        alpha (float | None): the lasso's or ridge's penalty. Default: ``0.01`` for the
            lasso (captum's), ``1.0`` for ridge (scikit-learn's).
        distance_mode (str): ``"cosine"`` or ``"euclidean"``, the distance of the default
            similarity. Default: ``"cosine"``.
        kernel_width (float): width of the default similarity's exponential kernel.
            Default: ``1.0``.
        similarity_func (Callable | None): ``(inputs [*B], perturbed [*B, k], samples
            [*B, k, F]) -> weights [*B, k]``, TensorDicts of the attributed keys; replaces
            the default similarity. Default: ``None``.
        per_target (bool): one map per target along a new leading dim ``T``, from the same
            forwards. Default: ``False`` (the targets' sum).
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
        >>> lime(f, p, x, target=1, n_samples=50, generator=g)["input"].shape
        torch.Size([3, 4])
        >>> groups = torch.tensor([0, 0, 1, 1])  # two features of two elements each
        >>> attr = lime(f, p, x["input"], target=1, feature_mask=groups, interpretable_model="linear")
        >>> bool((attr[:, 0] == attr[:, 1]).all())
        True
    """
    surrogate = prepare(_CALLER, f, params, inputs, baselines, target, feature_mask, input_keys, chunk_size)
    fit = _fit_fn(interpretable_model, alpha)
    weigh = similarity_func if similarity_func is not None else _exp_kernel(distance_mode, kernel_width)
    n_features = surrogate.n_features
    samples = interpretable_samples(_CALLER, surrogate, samples, n_samples,
                                    lambda batch, n: _bernoulli_samples(batch, n, n_features, generator))
    values, weights = evaluate(_CALLER, f, params, surrogate, samples, target, per_target, chunk_size, weigh)
    assert weights is not None
    check_weights(_CALLER, weights)
    coefs = fit(samples.to(values.dtype), values, weights.to(values.dtype))
    expected = (*values.shape[:-2], values.shape[-1], n_features)
    if not isinstance(coefs, torch.Tensor) or coefs.shape != expected:
        got = list(coefs.shape) if isinstance(coefs, torch.Tensor) else type(coefs).__name__
        raise ValueError(f"{_CALLER}: interpretable_model must return coefficients of shape {list(expected)} "
                         f"([*B, T, F]), got {got}")
    return maps(surrogate, coefs, per_target)


def _bernoulli_samples(batch: torch.Size, n: int, n_features: int, generator: torch.Generator | None) -> torch.Tensor:
    """Each feature kept with probability 1/2, drawn in captum's order: sample by sample, row by row."""
    return torch.bernoulli(torch.full((*batch, n, n_features), 0.5), generator=generator).bool()


def _fit_fn(model: Any, alpha: float | None) -> FitFn:
    if callable(model):
        return cast(FitFn, model)
    if model not in _MODELS:
        raise ValueError(f"{_CALLER}: interpretable_model must be one of {list(_MODELS)} or a callable "
                         f"(X, y, weights) -> coefficients, got {model!r}")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha < 0):
        raise ValueError(f"{_CALLER}: alpha must be a number >= 0, got {alpha!r}")
    if model == "linear":
        if alpha is not None:
            raise ValueError(f"{_CALLER}: alpha is the penalty of 'lasso' and 'ridge'; the 'linear' model has none")
        return least_squares
    if model == "ridge":
        penalty = 1.0 if alpha is None else float(alpha)
        return lambda x, y, w: ridge(x, y, w, penalty)
    penalty = 0.01 if alpha is None else float(alpha)
    return lambda x, y, w: lasso(x, y, w, penalty)


def _exp_kernel(distance_mode: str, kernel_width: float) -> SimilarityFn:
    """captum's default similarity: ``exp(-d^2 / (2 width^2))`` of the distance of the flattened inputs."""
    if distance_mode not in ("cosine", "euclidean"):
        raise ValueError(f"{_CALLER}: distance_mode must be 'cosine' or 'euclidean', got {distance_mode!r}")
    if isinstance(kernel_width, bool) or not isinstance(kernel_width, (int, float)) or not kernel_width > 0:
        raise ValueError(f"{_CALLER}: kernel_width must be a number > 0, got {kernel_width!r}")

    def similarity(inputs: TensorDictBase, perturbed: TensorDictBase, samples: torch.Tensor) -> torch.Tensor:
        x = _flat(inputs, inputs.batch_dims).unsqueeze(-2)
        moved = _flat(perturbed, perturbed.batch_dims)
        if distance_mode == "cosine":
            distance = 1 - torch.nn.functional.cosine_similarity(x, moved, dim=-1)
        else:
            distance = torch.linalg.vector_norm(x - moved, dim=-1)
        return torch.exp(-(distance ** 2) / (2 * kernel_width ** 2))

    return similarity


def _flat(td: TensorDictBase, dims: int) -> torch.Tensor:
    """The entries of ``td`` flattened per sample and joined, as floating point (token ids too, as captum)."""
    parts: list[torch.Tensor] = []
    for value in td.values(True, True):
        assert isinstance(value, torch.Tensor)
        value = value if value.is_floating_point() else value.to(torch.get_default_dtype())
        parts.append(value.reshape(*value.shape[:dims], -1))
    dtype = functools.reduce(torch.promote_types, (p.dtype for p in parts))
    return torch.cat([p.to(dtype) for p in parts], -1)

