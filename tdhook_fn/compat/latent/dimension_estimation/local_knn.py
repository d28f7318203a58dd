"""``LocalKnnDimensionEstimator`` (``tdhook.latent.dimension_estimation.local_knn``, tdhook 0.1.3).

Computes with `tdhook_fn.latent.dimension.local_knn`, all clouds of a batch in one op.

Differences from tdhook 0.1.3: the dimensions keep the input's dtype (tdhook casts to
float32).
"""

from __future__ import annotations

import torch

from tdhook_fn.latent.dimension import local_knn

from ._base import KEstimator

__all__ = ["LocalKnnDimensionEstimator"]


class LocalKnnDimensionEstimator(KEstimator):
    """A dimension per point of ``td[in_key]`` ``(..., N, D)``: ``ln 2 / ln(R_2k / R_k)``, ``(..., N)``.

    Args:
        k (int | "auto"): the neighbour count, ``> 1``; ``"auto"``: ``sqrt(N)``. Default: ``"auto"``.
        in_key (str): the points. Default: ``"data"``.
        out_key (str): where the dimensions go. Default: ``"dimension"``.
        eps (float): points closer than this are duplicates. Default: ``1e-5``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> td = TensorDict({"data": torch.randn(50, 4)}, batch_size=[])
        >>> LocalKnnDimensionEstimator(k=3)(td)["dimension"].shape
        torch.Size([50])
    """

    _method = "local KNN"
    _least_k = 2
    _least_k_message = "k must be greater than 1"
    _per_k = 2
    _extra = 1

    def _estimate(self, data: torch.Tensor, k: int) -> torch.Tensor:
        return local_knn(data, k, eps=self.eps)
