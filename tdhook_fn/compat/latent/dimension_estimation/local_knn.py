"""``LocalKnnDimensionEstimator`` (``tdhook.latent.dimension_estimation.local_knn``, tdhook 0.1.3).

Computes with `tdhook_fn.latent.dimension.local_knn`, all clouds of a batch in one op.

Differences from tdhook 0.1.3: the dimensions keep the input's dtype (tdhook casts to
float32).
"""

from __future__ import annotations

from tensordict import TensorDictBase

from tdhook_fn.latent.dimension import local_knn

from ._base import Estimator, K, check_k, resolve_k

__all__ = ["LocalKnnDimensionEstimator"]


class LocalKnnDimensionEstimator(Estimator):
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

    def __init__(self, k: K = "auto", in_key: str = "data", out_key: str = "dimension", eps: float = 1e-5) -> None:
        super().__init__(in_key, out_key, eps)
        check_k(k, 2, "k must be greater than 1")
        self.k = k

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        data = self.points(td)
        n = data.shape[-2]
        k = resolve_k(self.k, n)
        if n < 2 * k + 1:
            raise ValueError(f"At least 2k+1 points required for local KNN (k={k}), got {n}")
        td[self.out_key] = local_knn(data, k, eps=self.eps)
        return td

    def _fields(self) -> str:
        return f"{super()._fields()},\nk={self.k},\neps={self.eps}"
