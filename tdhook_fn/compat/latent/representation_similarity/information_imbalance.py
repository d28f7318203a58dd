"""``InformationImbalanceEstimator`` (``tdhook.latent.representation_similarity``, tdhook 0.1.3).

Both directed information imbalances of two keys, one value per batch entry, computed by
`tdhook_fn.latent.similarity.information_imbalance` in one batched call. Differences
from tdhook 0.1.3:

- Ties: the nearest neighbour is the lowest index among the closest points and its rank
  is one more than the number of points strictly closer (tdhook orders ties by an
  unstable sort). Without ties the values are tdhook's.
- float64 inputs give float64 (tdhook returns float32); NaN or inf raise ``ValueError``.
"""

from __future__ import annotations

import torch

from tdhook_fn.latent.similarity import information_imbalance

from ._pair import PairEstimator

__all__ = ["InformationImbalanceEstimator"]


class InformationImbalanceEstimator(PairEstimator):
    """Information imbalance between the representations at two keys, both directions.

    Each is ``(N, D)`` or ``(..., N, D)`` with the same batch shape and ``N``; the
    outputs are one value per batch entry for A -> B and for B -> A.

    Args:
        in_key_a (str): key of the first representation. Default: ``"data_a"``.
        in_key_b (str): key of the second representation. Default: ``"data_b"``.
        out_key_a_to_b (str): key written with Delta(A -> B).
            Default: ``"information_imbalance_a_to_b"``.
        out_key_b_to_a (str): key written with Delta(B -> A).
            Default: ``"information_imbalance_b_to_a"``.
        p (float): the Minkowski exponent of the distances. Default: ``2.0``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tdhook_fn.compat.latent.representation_similarity import InformationImbalanceEstimator
        >>> x = torch.randn(64, 8)
        >>> out = InformationImbalanceEstimator()(TensorDict(data_a=x, data_b=x.clone()))
        >>> round(out["information_imbalance_a_to_b"].item(), 4)   # 2 / N
        0.0312
    """

    _what = "Information Imbalance"

    def __init__(self, in_key_a: str = "data_a", in_key_b: str = "data_b",
                 out_key_a_to_b: str = "information_imbalance_a_to_b",
                 out_key_b_to_a: str = "information_imbalance_b_to_a", p: float = 2.0) -> None:
        super().__init__(in_key_a, in_key_b, [out_key_a_to_b, out_key_b_to_a])
        self.out_key_a_to_b, self.out_key_b_to_a = out_key_a_to_b, out_key_b_to_a
        self.p = p

    def _targets(self) -> list[str]:
        return [self.out_key_a_to_b, self.out_key_b_to_a]

    def _estimate(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        return list(information_imbalance(x, y, p=self.p))

    def _options(self) -> str:
        return f",\np={self.p}"
