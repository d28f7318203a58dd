"""``CkaEstimator`` (``tdhook.latent.representation_similarity.cka``, tdhook 0.1.3).

Linear CKA of two keys, one value per batch entry, computed by
`tdhook_fn.latent.similarity.cka` in one batched call. Differences from tdhook 0.1.3:

- A representation constant across the samples raises ``ValueError`` naming it
  (tdhook returns NaN); ``eps`` is kept for the repr but unused, so small-scale inputs
  whose product of norms falls under ``eps`` get their CKA (tdhook returns NaN).
- float64 inputs give float64 (tdhook returns float32).
"""

from __future__ import annotations

import torch

from tdhook_fn.latent.similarity import cka

from ._pair import PairEstimator

__all__ = ["CkaEstimator"]


class CkaEstimator(PairEstimator):
    """Centered kernel alignment between the representations at two keys.

    Each is ``(N, D)`` or ``(..., N, D)`` with the same batch shape and ``N``; the output
    is one value per batch entry.

    Args:
        in_key_a (str): key of the first representation. Default: ``"data_a"``.
        in_key_b (str): key of the second representation. Default: ``"data_b"``.
        out_key (str): key written with the CKA values. Default: ``"cka"``.
        kernel (str): only ``"linear"`` (as in tdhook 0.1.3). Default: ``"linear"``.
        eps (float): kept for tdhook's signature and repr; unused. Default: ``1e-12``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tdhook_fn.compat.latent.representation_similarity import CkaEstimator
        >>> x = torch.randn(3, 64, 8)
        >>> CkaEstimator()(TensorDict(data_a=x, data_b=2 * x, batch_size=[3]))["cka"].shape
        torch.Size([3])
    """

    _what = "CKA"

    def __init__(self, in_key_a: str = "data_a", in_key_b: str = "data_b", out_key: str = "cka",
                 kernel: str = "linear", eps: float = 1e-12) -> None:
        super().__init__(in_key_a, in_key_b, [out_key])
        if kernel != "linear":
            raise NotImplementedError(f"Unsupported kernel {kernel!r}. Only 'linear' is implemented in tdhook's "
                                      f"CkaEstimator; for an RBF kernel call "
                                      f"tdhook_fn.latent.similarity.cka(x, y, kernel='rbf')")
        self.out_key = out_key
        self.kernel, self.eps = kernel, eps

    def _targets(self) -> list[str]:
        return [self.out_key]

    def _estimate(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        return [cka(x, y)]

    def _options(self) -> str:
        return f",\nkernel='{self.kernel}',\neps={self.eps}"
