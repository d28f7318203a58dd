"""``CaPcaDimensionEstimator`` (``tdhook.latent.dimension_estimation.ca_pca``, tdhook 0.1.3).

Computes with `tdhook_fn.latent.dimension.ca_pca`: every neighbourhood's spectrum from one
batched ``eigvalsh`` and every score from prefix sums, no scikit-learn, no Python loop
over points or dimensions. Its numbers are tdhook's.

Differences from tdhook 0.1.3: scikit-learn is not needed (no ``ImportError`` without it).
"""

from __future__ import annotations

import torch

from tdhook_fn.latent.dimension import ca_pca

from ._base import KEstimator

__all__ = ["CaPcaDimensionEstimator"]


class CaPcaDimensionEstimator(KEstimator):
    """A curvature-adjusted local PCA dimension per point of ``td[in_key]`` ``(..., N, D)``, ``(..., N)``.

    Args:
        k (int | "auto"): ``k + 1`` neighbours per neighbourhood, ``>= 1``; ``"auto"``:
            ``sqrt(N)``. Default: ``"auto"``.
        in_key (str): the points. Default: ``"data"``.
        out_key (str): where the dimensions go. Default: ``"dimension"``.
        eps (float): points closer than this are duplicates. Default: ``1e-5``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> td = TensorDict({"data": torch.randn(50, 4)}, batch_size=[])
        >>> CaPcaDimensionEstimator(k=5)(td)["dimension"].shape
        torch.Size([50])
    """

    _method = "CA-PCA"
    _extra = 2

    def _estimate(self, data: torch.Tensor, k: int) -> torch.Tensor:
        return ca_pca(data, k, eps=self.eps)
