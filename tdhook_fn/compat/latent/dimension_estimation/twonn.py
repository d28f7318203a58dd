"""``TwoNnDimensionEstimator`` (``tdhook.latent.dimension_estimation.twonn``, tdhook 0.1.3).

Computes with `tdhook_fn.latent.dimension.two_nn` with ``discard_fraction=0`` (tdhook fits
every ratio but the largest), all clouds of a batch in one op.

Differences from tdhook 0.1.3: the dimension keeps the input's dtype (tdhook casts to
float32).
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from tdhook_fn.latent.dimension import two_nn

from ._base import Estimator

__all__ = ["TwoNnDimensionEstimator"]


class TwoNnDimensionEstimator(Estimator):
    """One intrinsic dimension per cloud of ``td[in_key]`` ``(..., N, D)``: ``td[out_key]`` is ``(...)``.

    Args:
        in_key (str): the points. Default: ``"data"``.
        out_key (str): where the dimension goes. Default: ``"dimension"``.
        return_xy (bool): also write the fitted ``log(mu)`` and ``-log(1 - F)`` under
            ``out_key + "_x"`` and ``out_key + "_y"``, ``(..., N - 1)``, ``nan``-padded.
            Default: ``False``.
        eps (float): points closer than this are duplicates. Default: ``1e-5``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> td = TensorDict({"data": torch.randn(2, 100, 4)}, batch_size=[2])
        >>> TwoNnDimensionEstimator()(td)["dimension"].shape
        torch.Size([2])
    """

    def __init__(self, in_key: str = "data", out_key: str = "dimension", return_xy: bool = False,
                 eps: float = 1e-5) -> None:
        keys = [out_key, f"{out_key}_x", f"{out_key}_y"] if return_xy else [out_key]
        super().__init__(in_key, out_key, eps, keys)
        self.return_xy = return_xy

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        data = self.points(td)
        if data.shape[-2] < 3:
            raise ValueError("At least 3 points required for Two NN dimension estimation")
        dimension, log_mu, log_y = two_nn(data, discard_fraction=0, eps=self.eps, return_xy=True)
        if torch.isnan(dimension).any():
            ratios = log_mu[torch.isnan(dimension)]  # (log r2/r1 of the fitted points; nan past them)
            if bool(((ratios == 0) | ratios.isnan()).all()) and bool(ratios.isfinite().sum(-1).ge(2).all()):
                raise ValueError("Two NN dimension estimation: every point's two nearest neighbours are equally far "
                                 "(all ratios r2/r1 are 1, as on a regular grid), which leaves no slope to fit; add a "
                                 "little noise to the points or use another estimator")
            raise ValueError("At least 3 valid points required for Two NN dimension estimation "
                             f"(points farther than eps={self.eps} from each other)")
        td[self.out_key] = dimension
        if self.return_xy:
            td[f"{self.out_key}_x"] = log_mu
            td[f"{self.out_key}_y"] = log_y
        return td
