"""Feature permutation: the change of the target when a feature group is shuffled across the batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from .._targets import Target
from .._types import NestedKey, PureFn
from ._engine import flat_inputs
from ._feature_masks import FeatureMask, features, selected
from ._inputs import accepts_tensors
from ._perturbation import checked_keys, evaluate, per_sample_views

__all__ = ["feature_permutation"]

_CALLER = "feature_permutation"


def _permutations(n: int, count: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One permutation of the ``n`` samples per feature, ``[count, n]``, none the identity.

    Drawn feature after feature with ``torch.randperm``, an identity drawn again: from
    the same random state, the permutations captum's ``FeaturePermutation`` draws.
    """
    identity = torch.arange(n)
    out = []
    for _ in range(count):
        perm = torch.randperm(n, generator=generator)
        while torch.equal(perm, identity):
            perm = torch.randperm(n, generator=generator)
        out.append(perm)
    stacked = torch.stack(out) if out else torch.empty(0, n, dtype=torch.long)
    return stacked.to(device)


@accepts_tensors
def feature_permutation(
    f: PureFn,
    params: TensorDictBase,
    inputs: TensorDictBase,
    *,
    target: Target,
    feature_mask: FeatureMask = None,
    per_target: bool = False,
    chunk_size: int | None = None,
    input_keys: NestedKey | Sequence[NestedKey] | None = None,
    generator: torch.Generator | None = None,
) -> TensorDict:
    """``F(x) - F(x with feature group g permuted across the batch)`` on every element of ``g``.

    captum's ``FeaturePermutation`` (permutation feature importance): each group of
    ``feature_mask`` takes, in every sample, its values from another sample of the batch
    (one random permutation of the samples per group, never the identity); the other
    features keep theirs. The batch ``[*B]`` is flattened and permuted as one. All
    permuted copies are built once and go through ``f`` in batched forwards of at most
    ``chunk_size`` groups. Per sample (under ``vmap``) there
    is nothing to permute across: call it on the batch.

    Args:
        f (Functional | Callable): pure ``f(params, td) -> td``.
        params (TensorDict): parameters for ``f``.
        inputs (TensorDict | Tensor): inputs with at least two samples, any batch size
            ``[*B]``; or a tensor, batch first, for an ``f`` with one in_key (the result is
            then a tensor).
        target (int | tuple[int, ...] | Tensor | Callable): see `tdhook_fn.as_target`.
        feature_mask (Tensor | TensorDict | dict | None): integer feature ids per element,
            as in `feature_ablation`; a group spanning several keys is permuted with one
            permutation. Default: every element its own feature.
        per_target (bool): one map per target on a new leading dim ``T``. Default: the
            targets' sum.
        chunk_size (int | None): at most this many permuted copies of the batch per
            forward (captum's ``perturbations_per_eval``). Default: ``None``,
            equal chunks whose widest activation stays near 8 MiB on the CPU (probed
            once per ``f``): every copy in one forward for a narrow model, forwards that
            keep a wide one's activations in cache.
        input_keys (Sequence | None): the inputs to permute. Default: ``f.in_keys``.
        generator (torch.Generator | None): the random generator the permutations are
            drawn from. Default: torch's global one (as captum).

    Returns:
        TensorDict: keyed like the permuted inputs, batch ``[*B]`` (``[T, *B]`` with
        ``per_target``), in the target values' dtype. A tensor for tensor ``inputs``.

    Raises:
        ValueError: fewer than two samples.

    Examples:
        >>> import torch, tdhook_fn
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
        >>> f, p = tdhook_fn.pure(net)
        >>> x = torch.randn(6, 4)
        >>> g = torch.Generator().manual_seed(0)
        >>> feature_permutation(f, p, x, target=0, generator=g).shape
        torch.Size([6, 4])
        >>> feature_permutation(f, p, x, target=(0, 1), per_target=True).shape
        torch.Size([2, 6, 4])
    """
    keys = checked_keys(_CALLER, f, params, inputs, target, input_keys, chunk_size)
    batch = inputs.batch_size
    n = batch.numel()
    if n < 2:
        raise ValueError(f"{_CALLER}: the inputs hold {n} sample(s) (batch_size={list(batch)}); a feature is "
                         "permuted across the samples, so give a batch of at least two")
    flat = flat_inputs(inputs)
    groups = features(_CALLER, inputs, keys, feature_mask)
    xs = per_sample_views(inputs, keys, inputs.batch_dims)
    device = xs[keys[0]].device
    perms = torch.cat([torch.arange(n, device=device)[None],
                       _permutations(n, len(groups.ids), generator, device)])  # row 0: the inputs

    def build(lo: int, hi: int) -> dict[NestedKey, torch.Tensor]:
        out = {}
        for key in keys:
            x = xs[key]
            moved = x.index_select(0, perms[lo:hi].reshape(-1)).reshape(hi - lo, *x.shape)
            out[key] = torch.where(selected(groups.positions[key], lo, hi), moved, x)
        return out

    values = evaluate(f, params, flat, target, rows=len(groups.ids) + 1, build=build, chunk_size=chunk_size,
                      per_target=per_target, caller=_CALLER)
    change = (values[:1] - values[1:]).permute(2, 1, 0)  # [T, N, P]
    return groups.maps(change, keys, batch, per_target)
