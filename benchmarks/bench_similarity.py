"""All-pairs representation similarity across layers: CKA and information imbalance.

Activations of ``L`` layers (6 and 12), ``N`` samples (512 and 1,297) of width 256,
random; every pair of layers, both orders:

- ``tdhook_fn.latent.similarity.cka(acts[:, None], acts[None, :])`` against tdhook
  0.1.3's ``CkaEstimator`` on the ``L x L`` batch (it loops over the pairs) and against
  the hand-written floor: centre, one batched Gram per layer, one matrix product of the
  flattened Grams, divided by their norms.
- ``information_imbalance`` likewise against ``InformationImbalanceEstimator`` and the
  floor: distances and an ``argmin`` per layer, then for every pair the rank of the
  chosen neighbour by counting closer points.

One intra-op thread; medians of interleaved rounds (``SIMILARITY_ROUNDS``, 5). tdhook's
loop costs the same per pair, so it is timed on its first ``TDHOOK_PAIRS`` (12) pairs and
reported for all of them. Every variant is first checked to give the same numbers.
"""

from __future__ import annotations

import os
import time
import warnings

import torch
from _timing import interleaved_medians, print_table
from tensordict import TensorDict

from tdhook_fn.latent.similarity import cka, information_imbalance

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
WIDTH = 256
ROUNDS = int(os.environ.get("SIMILARITY_ROUNDS", 5))
TDHOOK_PAIRS = int(os.environ.get("TDHOOK_PAIRS", 12))


def floor_cka(acts: torch.Tensor) -> torch.Tensor:
    """Linear CKA of every pair of layers, by hand: one Gram per layer, one product of Grams."""
    centred = acts - acts.mean(-2, keepdim=True)
    grams = torch.bmm(centred, centred.mT).flatten(1)
    norms = torch.linalg.vector_norm(grams, dim=1)
    return grams @ grams.T / norms[:, None] / norms[None, :]


def floor_imbalance(acts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Information imbalance of every ordered pair of layers, by hand: argmin and counts."""
    n = acts.shape[-2]
    dist = torch.cdist(acts, acts)
    dist.diagonal(dim1=-2, dim2=-1).fill_(torch.inf)
    neighbour = dist.argmin(-1)  # (L, N)
    layers = acts.shape[0]
    chosen = dist[None].expand(layers, -1, -1, -1).gather(-1, neighbour[:, None, :, None].expand(-1, layers, -1, -1))
    rank = 1 + (dist[None] < chosen).sum(-1, dtype=torch.int32)
    a_to_b = rank.to(acts.dtype).mean(-1) * (2.0 / n)
    return a_to_b, a_to_b.T


def tdhook_pairs(estimator: torch.nn.Module, acts: torch.Tensor, pairs: int) -> TensorDict:
    """tdhook's estimator on the first ``pairs`` (a, b) pairs, row by row, as one batched call."""
    layers = acts.shape[0]
    a = acts[:, None].expand(layers, layers, *acts.shape[1:]).flatten(0, 1)[:pairs]
    b = acts[None].expand(layers, layers, *acts.shape[1:]).flatten(0, 1)[:pairs]
    return estimator(TensorDict(data_a=a, data_b=b, batch_size=[pairs]))


def bench(layers: int, n: int) -> None:
    from tdhook.latent.representation_similarity import CkaEstimator, InformationImbalanceEstimator

    acts = torch.randn(layers, n, WIDTH, generator=torch.Generator().manual_seed(0))
    acts = acts + 0.5 * acts.cumsum(0)  # layers of a residual stream: neighbours alike
    pairs = min(TDHOOK_PAIRS, layers * layers)
    scale = layers * layers / pairs

    ours_cka = cka(acts[:, None], acts[None, :])
    torch.testing.assert_close(ours_cka, floor_cka(acts), rtol=1e-4, atol=1e-5)
    theirs = tdhook_pairs(CkaEstimator(), acts, pairs)["cka"]
    torch.testing.assert_close(ours_cka.flatten()[:pairs], theirs, rtol=1e-4, atol=1e-5)
    times = interleaved_medians({
        "floor: Grams, one product": lambda: floor_cka(acts),
        "tdhook_fn cka, all pairs": lambda: cka(acts[:, None], acts[None, :]),
    }, rounds=ROUNDS)
    start = time.perf_counter()
    tdhook_pairs(CkaEstimator(), acts, pairs)
    times["tdhook CkaEstimator (L x L batch)"] = (time.perf_counter() - start) * scale
    print_table(f"linear CKA, all {layers}x{layers} pairs of layers, N={n}, D={WIDTH}", list(times.items()),
                {"floor": times["floor: Grams, one product"]})

    ours = information_imbalance(acts[:, None], acts[None, :])
    floor = floor_imbalance(acts)
    torch.testing.assert_close(ours, floor, rtol=1e-6, atol=1e-6)
    out = tdhook_pairs(InformationImbalanceEstimator(), acts, pairs)
    # near-ties: cdist batched and alone may round apart, moving a rank by one (2 / N^2 each)
    torch.testing.assert_close(ours[0].flatten()[:pairs], out["information_imbalance_a_to_b"], rtol=0, atol=8 / n**2)
    times = interleaved_medians({
        "floor: argmin and counts": lambda: floor_imbalance(acts),
        "tdhook_fn information_imbalance": lambda: information_imbalance(acts[:, None], acts[None, :]),
    }, rounds=ROUNDS)
    start = time.perf_counter()
    tdhook_pairs(InformationImbalanceEstimator(), acts, pairs)
    times["tdhook InformationImbalanceEstimator"] = (time.perf_counter() - start) * scale
    print_table(f"information imbalance, all {layers}x{layers} pairs, N={n}, D={WIDTH}", list(times.items()),
                {"floor": times["floor: argmin and counts"]})


def main() -> None:
    for layers in (6, 12):
        for n in (512, 1297):
            bench(layers, n)


if __name__ == "__main__":
    main()
