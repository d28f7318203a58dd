"""DeepLiftShap: DeepLift averaged over a distribution of references, every pair in one batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from .._functional import NestedKey
from .._targets import Target
from .._types import PureFn
from ._baselines import attributed_keys
from ._deeplift import deeplift
from ._inputs import accepts_tensors

__all__ = ["deeplift_shap"]



def _distribution(inputs: TensorDictBase, baselines: TensorDictBase | torch.Tensor,
                  keys: Sequence[NestedKey]) -> TensorDictBase:
    """The references as a TensorDict of batch ``[K]``, each key shaped like one sample of its input."""
    lead = inputs.batch_dims
    if isinstance(baselines, torch.Tensor):
        if len(keys) != 1:
            raise TypeError(f"deeplift_shap: a tensor of baselines fits one attributed input, but {len(keys)} are "
                            f"attributed {list(keys)}; pass a TensorDict of batch [K] holding each of them")
        baselines = TensorDict({keys[0]: baselines}, batch_size=baselines.shape[:1])
    if not isinstance(baselines, TensorDictBase) or baselines.batch_dims != 1 or baselines.batch_size[0] < 1:
        raise TypeError("deeplift_shap: baselines must be a distribution of K >= 1 references: a tensor [K, ...] "
                        "shaped like one sample of the input, or a TensorDict of batch [K]")
    for key in keys:
        if key not in baselines.keys(True, True):
            raise KeyError(f"deeplift_shap: the baselines hold no {key!r}; give one reference of each attributed input")
        want = inputs.get(key).shape[lead:]
        if baselines.get(key).shape[1:] != want:
            raise ValueError(f"deeplift_shap: baselines {key!r} has shape {list(baselines.get(key).shape)}; each of "
                             f"its K references must have one sample's shape {list(want)}, i.e. [K, *{list(want)}]")
    return baselines


@accepts_tensors
def deeplift_shap(
    f: PureFn,
    params: TensorDictBase,
    inputs: TensorDictBase,
    baselines: TensorDictBase | torch.Tensor,
    *,
    target: Target,
    multiply_by_inputs: bool = True,
    eps: float = 1e-10,
    per_target: bool = False,
    input_keys: NestedKey | Sequence[NestedKey] | None = None,
) -> TensorDict:
    """DeepLift of every input against every reference of a distribution, averaged: captum 0.9's ``DeepLiftShap``.

    The ``N`` inputs and ``K`` references make ``N K`` pairs that go through `deeplift`
    as one batch (one forward, one modified backward), and the maps are averaged over
    the references. With ``multiply_by_inputs`` the map of one sample sums to
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
    keys = attributed_keys("deeplift_shap", f, inputs, input_keys)
    distribution = _distribution(inputs, baselines, keys)
    batch, k = inputs.batch_size, distribution.batch_size[0]
    pairs = inputs.unsqueeze(-1).expand(*batch, k)
    references = distribution.select(*keys).expand(*batch, k)
    if isinstance(target, torch.Tensor) and target.dim() > 0:
        target = target.unsqueeze(-1).expand(*target.shape, k)
    maps = deeplift(f, params, pairs, references, target=target, multiply_by_inputs=multiply_by_inputs, eps=eps,
                    per_target=per_target, input_keys=list(keys))
    lead = 1 if per_target else 0
    return TensorDict({key: value.mean(lead + len(batch)) for key, value in maps.items(True, True)},
                      batch_size=maps.batch_size[: lead + len(batch)])
