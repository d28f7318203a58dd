"""``CaPcaDimensionEstimator`` (``tdhook.latent.dimension_estimation.ca_pca``, tdhook 0.1.3).

Computes with `tdhook_fn.latent.dimension.ca_pca`: every neighbourhood's spectrum from one
batched ``eigvalsh`` and every score from prefix sums, no scikit-learn, no Python loop
over points or dimensions. Its numbers are tdhook's.

Differences from tdhook 0.1.3: scikit-learn is not needed (no ``ImportError`` without it).
"""

from __future__ import annotations

from tensordict import TensorDictBase

from tdhook_fn.latent.dimension import ca_pca

from ._base import Estimator, K, check_k, resolve_k

__all__ = ["CaPcaDimensionEstimator"]


class CaPcaDimensionEstimator(Estimator):
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

    def __init__(self, k: K = "auto", in_key: str = "data", out_key: str = "dimension", eps: float = 1e-5) -> None:
        super().__init__(in_key, out_key, eps)
        check_k(k, 1, "k must be at least 1")
        self.k = k

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        data = self.points(td)
        n = data.shape[-2]
        k = resolve_k(self.k, n)
        if n < k + 2:
            raise ValueError(f"At least k+2 points required for CA-PCA (k={k}), got {n}")
        td[self.out_key] = ca_pca(data, k, eps=self.eps)
        return td

    def _fields(self) -> str:
        return f"{super()._fields()},\nk={self.k},\neps={self.eps}"
