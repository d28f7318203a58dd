"""Perturbation attribution: occlusion, feature ablation, Shapley sampling against captum 0.9.0 and a floor.

Two digits CNNs (``[N, 1, 8, 8] -> 10`` classes) on the first ``N = 32`` of scikit-learn's
digits, each sample's predicted class as target: the docs pages' CNN (two 3x3 convs of 16
and 32 channels, a 64-unit hidden layer), and a small one (one conv of 8 channels, a
pool, a linear head; ``bench_metrics.py``'s) whose forward is so cheap that the fixed
cost of a call (argument checks, the pure call's set-up, about half a millisecond) shows. Our default
chunks are sized by the model's widest activation (NOTE [default chunk rows]): every
perturbation in one forward on the small CNN, forwards of 1024 samples on the docs CNN
(rows "ours, chunk_size=... (all)" show one forward).

- occlusion with 2x2 windows, stride 1 (49 windows);
- feature ablation of every pixel (64 features), baseline 0;
- Shapley value sampling of 2x2 blocks (16 features), captum's 25 orders.

captum runs at its default ``perturbations_per_eval=1`` (one forward per perturbation)
and at settings that batch: 16 per forward, half of them per forward (two equal
forwards) and every perturbation in one forward (for Shapley sampling, all 16 features
of an order: captum evaluates one order at a time); "captum best" is the fastest of
these. The floor is the plain torch a capable engineer writes for the same numbers:
every perturbed copy of the batch built once by broadcasting, forwards of the module
itself (the small CNN's max pooling on a channels-last copy, as ours runs it:
NOTE [shadow max pooling]), the differences spread back by one gather or product. It runs all perturbations
in one forward and in equal forwards of at most 32 (1024 samples: small forwards keep a
wider model's activations in cache), and the faster of the two is the floor; it builds its masks in the
timed region as every other variant does. Every variant is first checked to give the
same numbers (the random orders drawn from the same seed). Times are CPU seconds of this
one-thread process, medians of interleaved rounds. Last, the peak memory a Shapley call adds (401 rows of 32 digits
through the docs CNN) by default, in one forward and with ``chunk_size=1``: bounded by
the chunks, not by the number of rows.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from _digits import cnn, digits, fastest_pooling
from _timing import cpu_medians, peak_rss_growth_mib, print_table
from captum.attr import FeatureAblation, Occlusion, ShapleyValueSampling
from torch import nn

import tdhook_fn
from tdhook_fn.attribution._feature_ablation import feature_ablation
from tdhook_fn.attribution._occlusion import occlusion
from tdhook_fn.attribution._shapley_value_sampling import shapley_value_sampling

warnings.filterwarnings("ignore")
N, SEED, ORDERS = 32, 0, 25


def docs_cnn() -> nn.Sequential:
    """The CNN of the docs pages (``docs/gen_images.py``), untrained: the same cost."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 10)).eval()


def report(title: str, impls: dict[str, Callable[[], torch.Tensor]]) -> None:
    reference = impls["floor, one forward"]()
    for name, fn in impls.items():
        torch.testing.assert_close(fn(), reference, rtol=1e-4, atol=1e-5, msg=f"{name} differs")
    measured = cpu_medians(_fair_order(impls), shuffle=False)  # (the order matters here: see _fair_order)
    times = {name: measured[name] for name in impls}
    best = min(v for k, v in times.items() if k.startswith("captum") and "default" not in k)
    floor = min(v for k, v in times.items() if k.startswith("floor"))
    print_table(title, list(times.items()), {"floor": floor, "captum default": times["captum 0.9.0 (default)"],
                                             "captum best": best})


def _fair_order(impls: dict[str, Callable[[], torch.Tensor]]) -> dict[str, Callable[[], torch.Tensor]]:
    """The variants in the order they are timed: the chunked floor and ours first, each after a chunked variant.

    A variant timed right after one forward of every perturbation (hundreds of MiB freed
    to the system) pays for fresh pages (measured: the chunked floor 20% slower there);
    so the chunked floor follows the last variant of the round before (captum at 16 per
    forward), and ours follows the chunked floor.
    """
    chunked = next(name for name in impls if name.startswith("floor, ") and name != "floor, one forward")
    last = [name for name in impls if name.startswith("captum 0.9.0 (ppe=16")]
    order = [chunked, "ours", *(n for n in impls if n not in (chunked, "ours", *last)), *last]
    return {name: impls[name] for name in order}


def picked(net: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The target class's output of each sample of ``x`` ``[R * N, ...]``: ``[R, N]``."""
    out = net(x).view(-1, N, 10)
    return out.gather(2, target.view(1, N, 1).expand(out.shape[0], N, 1)).squeeze(2)


def row_values(net: nn.Module, masks: torch.Tensor, on: torch.Tensor | float, off: torch.Tensor | float,
               target: torch.Tensor, rows: int) -> torch.Tensor:
    """The target on every row of ``masks`` ``[R, 64]`` (``on`` where True, ``off`` elsewhere), ``rows`` rows per
    forward, each chunk built once by broadcasting: ``[R, N]``."""
    parts = []
    for i in range(0, len(masks), rows):
        chosen = masks[i:i + rows].reshape(-1, 1, 1, 8, 8)
        parts.append(picked(net, torch.where(chosen, on, off).reshape(-1, 1, 8, 8), target))
    return torch.cat(parts)


def floors(floor: Callable[[int], torch.Tensor], total: int) -> dict[str, Callable[[], torch.Tensor]]:
    """The floor in one forward, and in equal forwards of at most 32 rows (1024 samples: faster for the docs CNN;
    equal, so that no small forward is left over: 50 rows as 25 + 25, not 32 + 18)."""
    equal = -(-total // -(-total // 32))
    return {"floor, one forward": lambda: floor(total), f"floor, {equal} per forward": lambda: floor(equal)}


def bench_occlusion(net: nn.Sequential, x: torch.Tensor, target: torch.Tensor, model: str) -> None:
    f, p = tdhook_fn.pure(net)
    fast = fastest_pooling(net)  # (the floor's forward: NOTE [shadow max pooling])
    windows = 49

    def floor(rows: int) -> torch.Tensor:
        with torch.no_grad():
            starts = torch.arange(7)
            cover = (torch.arange(8) >= starts[:, None]) & (torch.arange(8) < starts[:, None] + 2)  # [7, 8]
            masks = (cover[:, None, :, None] & cover[None, :, None, :]).reshape(windows, 64)
            values = row_values(fast, torch.cat([torch.zeros(1, 64, dtype=torch.bool), masks]), 0.0, x, target, rows)
            change = (values[:1] - values[1:]).T.reshape(N, 7, 7)
            c = cover.float()
            return (torch.einsum("nab,ai,bj->nij", change, c, c) / torch.outer(c.sum(0), c.sum(0)))[:, None]

    def ours(chunk_size: int | None = None) -> torch.Tensor:
        return occlusion(f, p, x, 0.0, target=target, sliding_window_shapes=(1, 2, 2), chunk_size=chunk_size)

    def captum(per_eval: int) -> Callable[[], torch.Tensor]:
        return lambda: Occlusion(net).attribute(x, sliding_window_shapes=(1, 2, 2), target=target,
                                                perturbations_per_eval=per_eval)

    report(f"occlusion, 2x2 windows (49), {model}, batch {N}",
           {"ours": ours, "ours, chunk_size=50 (all)": lambda: ours(windows + 1), "captum 0.9.0 (default)": captum(1),
            "captum 0.9.0 (ppe=16)": captum(16), "captum 0.9.0 (ppe=25, half)": captum(25),
            "captum 0.9.0 (ppe=49, all)": captum(windows),
            **floors(floor, windows + 1)})


def bench_ablation(net: nn.Sequential, x: torch.Tensor, target: torch.Tensor, model: str) -> None:
    f, p = tdhook_fn.pure(net)
    fast = fastest_pooling(net)  # (the floor's forward: NOTE [shadow max pooling])

    def floor(rows: int) -> torch.Tensor:
        with torch.no_grad():
            masks = torch.cat([torch.zeros(1, 64, dtype=torch.bool), torch.eye(64, dtype=torch.bool)])
            values = row_values(fast, masks, 0.0, x, target, rows)
            return (values[:1] - values[1:]).T.reshape(N, 1, 8, 8)

    def ours(chunk_size: int | None = None) -> torch.Tensor:
        return feature_ablation(f, p, x, 0.0, target=target, chunk_size=chunk_size)

    def captum(per_eval: int) -> Callable[[], torch.Tensor]:
        return lambda: FeatureAblation(net).attribute(x, target=target, perturbations_per_eval=per_eval)

    report(f"feature ablation, every pixel (64), {model}, batch {N}",
           {"ours": ours, "ours, chunk_size=65 (all)": lambda: ours(65), "captum 0.9.0 (default)": captum(1),
            "captum 0.9.0 (ppe=16)": captum(16), "captum 0.9.0 (ppe=32, half)": captum(32),
            "captum 0.9.0 (ppe=64, all)": captum(64), **floors(floor, 65)})


def bench_shapley(net: nn.Sequential, x: torch.Tensor, target: torch.Tensor, model: str) -> None:
    f, p = tdhook_fn.pure(net)
    fast = fastest_pooling(net)  # (the floor's forward: NOTE [shadow max pooling])
    blocks = (torch.arange(8)[:, None] // 2 * 4 + torch.arange(8)[None, :] // 2).reshape(1, 1, 8, 8)
    features = 16

    def floor(rows: int) -> torch.Tensor:
        torch.manual_seed(SEED)
        orders = torch.stack([torch.randperm(features) for _ in range(ORDERS)])
        with torch.no_grad():
            ranks = orders.argsort(1)  # [S, P]
            steps = torch.arange(features)
            switched = ranks[:, None, blocks.view(-1)] <= steps[None, :, None]  # [S, P, 64]
            masks = torch.cat([torch.zeros(1, 64, dtype=torch.bool), switched.reshape(-1, 64)])  # baselines first
            values = row_values(fast, masks, x, 0.0, target, rows)
            walk = values[1:].view(ORDERS, features, N)
            before = torch.cat([values[:1].expand(ORDERS, 1, N), walk[:, :-1]], 1)
            shares = (walk - before).gather(1, ranks[:, :, None].expand(-1, -1, N)).mean(0)  # [P, N]
            return shares[blocks.view(-1)].T.reshape(N, 1, 8, 8)

    def ours() -> torch.Tensor:
        torch.manual_seed(SEED)
        return shapley_value_sampling(f, p, x, 0.0, target=target, n_samples=ORDERS, feature_mask=blocks)

    def captum(per_eval: int) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            torch.manual_seed(SEED)
            return ShapleyValueSampling(net).attribute(x, target=target, n_samples=ORDERS, feature_mask=blocks,
                                                       perturbations_per_eval=per_eval)
        return run

    report(f"Shapley value sampling, 2x2 blocks (16), {ORDERS} orders, {model}, batch {N}",
           {"ours": ours, "captum 0.9.0 (default)": captum(1), "captum 0.9.0 (ppe=16, all)": captum(features),
            **floors(floor, 1 + ORDERS * features)})


def shapley_memory(net: nn.Module, x: torch.Tensor, target: torch.Tensor) -> None:
    """Peak resident memory a Shapley call adds, by ``chunk_size`` (each run once after a warm-up)."""
    f, p = tdhook_fn.pure(net)
    blocks = (torch.arange(8)[:, None] // 2 * 4 + torch.arange(8)[None, :] // 2).reshape(1, 1, 8, 8)
    print(f"\nShapley value sampling, docs CNN, batch {N}: peak memory added (401 rows of {N} digits)")
    for label, chunk_size in (("ours (default)", None), ("ours, chunk_size=401 (all)", 401),
                              ("ours, chunk_size=1", 1)):
        def run(chunk_size: int | None = chunk_size) -> torch.Tensor:
            return shapley_value_sampling(f, p, x, 0.0, target=target, n_samples=ORDERS, feature_mask=blocks,
                                          chunk_size=chunk_size)
        run()
        print(f"  {label:<34}{peak_rss_growth_mib(run):>10.1f} MiB")


def main() -> None:
    x = digits(N)
    for net, model in ((docs_cnn(), "docs CNN"), (cnn(), "small CNN")):
        with torch.no_grad():
            target = net(x).argmax(-1)
        bench_occlusion(net, x, target, model)
        bench_ablation(net, x, target, model)
        bench_shapley(net, x, target, model)
    net = docs_cnn()
    with torch.no_grad():
        shapley_memory(net, x, net(x).argmax(-1))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
