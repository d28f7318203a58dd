"""Intrinsic dimension estimators on 2,000 points x 256 features (one layer's activations), one thread.

Each of ours (`tdhook_fn.latent.dimension`) against tdhook 0.1.3's estimator and a
hand-written floor: the fewest plain torch ops a capable engineer would write for the
same numbers, without our checks (duplicates, validation):

- TwoNN: ``cdist``, the diagonal set to ``inf``, ``topk(2)``, the sort of the ratios and
  the fit through the origin (tdhook's fit over all ratios: ``discard_fraction=0``).
- local kNN (``k = 10``): ``cdist``, diagonal, ``topk(2k)``, ``ln 2 / ln(R_2k / R_k)``.
- local PCA (``k = 20``) and CA-PCA: ``cdist``, diagonal, ``topk``, a gather of the
  neighbourhoods, their centred ``(k + 1) x (k + 1)`` Gram matrices and one batched
  ``eigvalsh`` (in float32, where ours computes the spectra in float64 as tdhook does),
  the criterion's ``argmax``. tdhook fits scikit-learn's PCA point by point; it is timed
  on a quarter of the points and reported per 2,000.

Goals (issue 23): TwoNN and local kNN within 1.2x of their floors, local PCA at least
5x faster than tdhook. Every variant is first checked to give the same numbers. numpy
and scikit-learn (inside tdhook) run with one OpenBLAS thread (``OPENBLAS_NUM_THREADS``,
set with ``OPENBLAS_THREAD_TIMEOUT`` before numpy is imported: idle OpenBLAS threads
otherwise spin against torch's).
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from _timing import interleaved_medians, print_table
from tensordict import TensorDict

from tdhook_fn.latent.dimension import ca_pca, local_knn, local_pca, two_nn

N, D, RANK, K_KNN, K_PCA = 2000, 256, 12, 10, 20


def activations() -> torch.Tensor:
    """A rank-12 cloud with a little noise in every direction."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, RANK, generator=g) @ torch.randn(RANK, D, generator=g) + 0.05 * torch.randn(N, D, generator=g)


def _distances(x: torch.Tensor) -> torch.Tensor:
    d = torch.cdist(x, x)
    d.diagonal().fill_(math.inf)
    return d


def floor_two_nn(x: torch.Tensor) -> torch.Tensor:
    r = _distances(x).topk(2, largest=False).values
    log_mu = (r[:, 1] / r[:, 0]).sort().values.log()[:-1]
    log_y = -torch.log1p(-torch.arange(1, N, dtype=x.dtype) / N)
    return (log_mu * log_y).sum() / (log_mu * log_mu).sum()


def floor_local_knn(x: torch.Tensor) -> torch.Tensor:
    r = _distances(x).topk(2 * K_KNN, largest=False).values
    return math.log(2) / (r[:, 2 * K_KNN - 1] / r[:, K_KNN - 1]).log()


def _floor_spectra(x: torch.Tensor, k: int, with_self: bool) -> tuple[torch.Tensor, torch.Tensor]:
    r, idx = _distances(x).topk(k + 1, largest=False)
    points = x[idx[:, : k + 1 - with_self]]
    if with_self:
        points = torch.cat([x[:, None], points], 1)
    centred = points - points.mean(1, keepdim=True)
    return torch.linalg.eigvalsh(centred @ centred.mT / k).flip(-1).clamp(min=0), r


def floor_local_pca(x: torch.Tensor) -> torch.Tensor:
    use = _floor_spectra(x, K_PCA, True)[0][:, :K_PCA]  # the first k eigenvalues: the last is zero
    floor = torch.maximum(1.5e-8 * use[:, :1], 0.1 * use.median(-1, keepdim=True).values)
    return (use[:, :-1] / torch.maximum(use[:, 1:], floor)).argmax(-1) + 1.0


def floor_ca_pca(x: torch.Tensor) -> torch.Tensor:
    lam, r = _floor_spectra(x, K_PCA, False)
    lam = torch.nn.functional.pad(lam / ((r[:, K_PCA - 1] + r[:, K_PCA]) / 2)[:, None] ** 2, (0, D - K_PCA - 1))
    d = torch.arange(1, D + 1, dtype=x.dtype)
    head, tail = lam.cumsum(-1), lam.sum(-1, keepdim=True) - lam.cumsum(-1)
    shift = (3 * d + 4) / (d * (d + 4)) * tail - 1 / (d + 2)
    score = ((lam * lam).cumsum(-1) + 2 * shift * head + d * shift * shift).clamp(min=0).sqrt() + 2 * tail
    spread = lam >= 0.01 * lam[:, :1]  # a dimension needs that much spread (ca_pca's default support)
    spread[:, 0] = True
    return score.masked_fill(~spread, math.inf).argmin(-1) + 1.0


def main() -> None:
    torch.set_num_threads(1)
    from tdhook.latent.dimension_estimation import (
        CaPcaDimensionEstimator,
        LocalKnnDimensionEstimator,
        LocalPcaDimensionEstimator,
        TwoNnDimensionEstimator,
    )

    x = activations()
    part = x[: N // 4]

    def td(points: torch.Tensor) -> TensorDict:
        return TensorDict({"data": points}, batch_size=[])

    # the same numbers first
    torch.testing.assert_close(two_nn(x, discard_fraction=0), TwoNnDimensionEstimator()(td(x))["dimension"])
    torch.testing.assert_close(two_nn(x, discard_fraction=0), floor_two_nn(x), rtol=1e-5, atol=0)
    torch.testing.assert_close(local_knn(x, K_KNN), LocalKnnDimensionEstimator(k=K_KNN)(td(x))["dimension"])
    torch.testing.assert_close(local_knn(x, K_KNN), floor_local_knn(x))
    torch.testing.assert_close(local_pca(part, K_PCA, criterion="maxgap"),
                               LocalPcaDimensionEstimator(k=K_PCA)(td(part))["dimension"])
    torch.testing.assert_close(local_pca(x, K_PCA), floor_local_pca(x))
    torch.testing.assert_close(ca_pca(part, K_PCA, support=0.0),  # support=0: tdhook's rule
                               CaPcaDimensionEstimator(k=K_PCA)(td(part))["dimension"])
    torch.testing.assert_close(ca_pca(x, K_PCA), floor_ca_pca(x))

    cases = [
        ("TwoNN", lambda: two_nn(x, discard_fraction=0), lambda: floor_two_nn(x),
         lambda: TwoNnDimensionEstimator()(td(x)), 1),
        (f"local kNN, k={K_KNN}", lambda: local_knn(x, K_KNN), lambda: floor_local_knn(x),
         lambda: LocalKnnDimensionEstimator(k=K_KNN)(td(x)), 1),
        (f"local PCA, k={K_PCA}", lambda: local_pca(x, K_PCA), lambda: floor_local_pca(x),
         lambda: LocalPcaDimensionEstimator(k=K_PCA)(td(part)), 4),
        (f"CA-PCA, k={K_PCA}", lambda: ca_pca(x, K_PCA), lambda: floor_ca_pca(x),
         lambda: CaPcaDimensionEstimator(k=K_PCA)(td(part)), 4),
    ]
    for name, ours, floor, tdhook, scale in cases:
        fast = interleaved_medians({"floor": floor, "ours": ours}, rounds=9)
        slow = interleaved_medians({"tdhook": tdhook}, rounds=3 if scale > 1 else 9)["tdhook"] * scale
        rows = [("hand-written floor", fast["floor"]), ("tdhook_fn.latent.dimension", fast["ours"]),
                ("tdhook 0.1.3" + (" (x4 of N/4)" if scale > 1 else ""), slow)]
        print_table(f"{name}: {N} x {D} float32, one thread", rows, {"floor": fast["floor"], "ours": fast["ours"]})


if __name__ == "__main__":
    main()
