"""Intrinsic dimension estimators with the API of ``tdhook.latent.dimension_estimation`` (tdhook 0.1.3).

Each is a `TensorDictModuleBase` reading ``td[in_key]`` ``(..., N, D)`` and writing
``td[out_key]``; every number comes from `tdhook_fn.latent.dimension`, all clouds of a
batch in one op. The differences from tdhook 0.1.3 are listed in each module.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> td = TensorDict({"data": torch.randn(200, 3) @ torch.randn(3, 16)}, batch_size=[])
    >>> out = LocalPcaDimensionEstimator(k=10)(td)
    >>> out["dimension"].median().item()
    3.0
"""

from .ca_pca import CaPcaDimensionEstimator
from .local_knn import LocalKnnDimensionEstimator
from .local_pca import LocalPcaDimensionEstimator
from .twonn import TwoNnDimensionEstimator

__all__ = [
    "CaPcaDimensionEstimator",
    "LocalKnnDimensionEstimator",
    "LocalPcaDimensionEstimator",
    "TwoNnDimensionEstimator",
]
