"""``LocalPcaDimensionEstimator`` (``tdhook.latent.dimension_estimation.local_pca``, tdhook 0.1.3).

Computes with `tdhook_fn.latent.dimension.local_pca`: every neighbourhood's spectrum
from one batched ``eigvalsh``, no scikit-learn.

Differences from tdhook 0.1.3 are listed in ``docs/compat.md``.
"""

from __future__ import annotations

import math
from typing import Any, Literal, cast

import numpy as np
import torch

from tdhook_fn.latent.dimension import local_pca, spectrum_dimension

from ._base import K, KEstimator

Criterion = Literal["gap", "maxgap", "ratio"]  # checked against _CRITERIA before the call

__all__ = ["LocalPcaDimensionEstimator"]

_CRITERIA = ("gap", "maxgap", "ratio")


class LocalPcaDimensionEstimator(KEstimator):
    """A dimension per point of ``td[in_key]`` ``(..., N, D)`` from its neighbourhood's PCA spectrum.

    Args:
        k (int | "auto"): neighbours per neighbourhood, ``>= 1``; ``"auto"``: ``sqrt(N)``.
            Default: ``"auto"``.
        criterion (str): ``"gap"``, ``"maxgap"`` (tdhook's default) or ``"ratio"``; see
            `tdhook_fn.latent.dimension.local_pca`. Default: ``"gap"``.
        alpha (float): the ``"ratio"`` threshold. Default: ``0.05``.
        in_key (str): the points. Default: ``"data"``.
        out_key (str): where the dimensions go. Default: ``"dimension"``.
        eps (float): points closer than this are duplicates. Default: ``1e-5``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> td = TensorDict({"data": torch.randn(3, 50, 4)}, batch_size=[3])
        >>> LocalPcaDimensionEstimator(k=5)(td)["dimension"].shape
        torch.Size([3, 50])
    """

    _method = "local PCA"
    _extra = 1

    def __init__(self, k: K = "auto", criterion: str = "gap", alpha: float = 0.05, in_key: str = "data",
                 out_key: str = "dimension", eps: float = 1e-5) -> None:
        super().__init__(k, in_key, out_key, eps)
        self.criterion = criterion
        self.alpha = alpha

    def _estimate(self, data: torch.Tensor, k: int) -> torch.Tensor:
        if self.criterion not in _CRITERIA:
            raise ValueError(f"Unknown criterion: {self.criterion!r} (one of {_CRITERIA})")
        return local_pca(data, k, criterion=cast(Criterion, self.criterion), alpha=self.alpha, eps=self.eps)

    def _options(self) -> str:
        return f"{super()._options()},\ncriterion={self.criterion!r},\nalpha={self.alpha}"


def _dim_from_eigenvalues_maxgap(lambda_: np.ndarray) -> int:
    """tdhook's ``maxgap`` on one decreasing spectrum (1 for fewer than two values)."""
    return int(spectrum_dimension(torch.as_tensor(np.asarray(lambda_, dtype=np.float64)), criterion="maxgap"))


def _dim_from_eigenvalues_ratio(lambda_: np.ndarray, alpha: float) -> int:
    """tdhook's ``ratio``: the count of eigenvalues above ``alpha`` times the largest, at least 1."""
    return int(spectrum_dimension(torch.as_tensor(np.asarray(lambda_, dtype=np.float64)), criterion="ratio",
                                  alpha=alpha))


def _local_pca(data: torch.Tensor, k: int, eps: float, criterion: str, alpha: float,
               pca_cls: Any = None) -> torch.Tensor:
    """tdhook's private per-cloud helper: ``(N, D)`` to ``(N,)``; ``k < 1`` gives ``nan`` (tdhook's)."""
    if pca_cls is not None and (getattr(pca_cls, "__name__", None), getattr(pca_cls, "__module__", "")[:7]) \
            != ("PCA", "sklearn"):
        raise NotImplementedError(f"_local_pca: the spectra come from torch.linalg.eigvalsh; pca_cls={pca_cls!r} "
                                  "is not supported (only scikit-learn's PCA, whose numbers they equal)")
    if k < 1:
        return torch.full(data.shape[:-1], math.nan, dtype=torch.float32, device=data.device)
    return local_pca(data, k, criterion=cast(Criterion, criterion), alpha=alpha, eps=eps).float()
