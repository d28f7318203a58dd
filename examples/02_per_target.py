"""Per-target maps: integrated gradients for all ten classes in one call, against a loop.

``per_target=True`` runs the path points through the model once and pulls back ten
one-hot cotangents with one vmapped VJP; the loop runs forward and backward ten times.
Writes ``02_per_target.png``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import matplotlib.pyplot as plt
import torch
from _digits import CLASSES, load, setup_example, trained_cnn
from _plots import SIGNED, save, show_digit
from tensordict import TensorDict

import tdhook_fn
from tdhook_fn.attribution import integrated_gradients


def best_time(run: Callable[[], torch.Tensor], repeats: int) -> tuple[float, torch.Tensor]:
    """Fastest of ``repeats`` runs after one warm-up run, and the result."""
    result = run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return min(times), result


def main() -> None:
    args = setup_example(__doc__.splitlines()[0])
    data = load()
    model, test_accuracy = trained_cnn(args, data)
    print(f"test accuracy: {test_accuracy:.1%}")
    f, params = tdhook_fn.functional(model), tdhook_fn.params(model)
    n_digits = 16 if args.quick else 64
    inputs = TensorDict(input=data.test_x[:n_digits], batch_size=[n_digits])

    def all_classes_at_once() -> torch.Tensor:
        return integrated_gradients(f, params, inputs, 0.0, target=CLASSES, per_target=True)["input"]

    def one_class_at_a_time() -> torch.Tensor:
        return torch.stack([integrated_gradients(f, params, inputs, 0.0, target=c)["input"] for c in CLASSES])

    repeats = 1 if args.quick else 5
    at_once, maps = best_time(all_classes_at_once, repeats)
    looped, maps_looped = best_time(one_class_at_a_time, repeats)
    print(f"integrated gradients, 50 steps, {n_digits} digits x 10 classes:")
    print(f"  one call, per_target=True: {at_once * 1000:7.1f} ms")
    print(f"  loop over the 10 targets:  {looped * 1000:7.1f} ms")
    print(f"  speed-up: {looped / at_once:.2f}x; max |difference| of the maps: {(maps - maps_looped).abs().max():.1e}")
    plot(inputs["input"][:2], data.test_y[:2].tolist(), maps[:, :2], (at_once, looped), n_digits, args)


def plot(images: torch.Tensor, labels: list[int], maps: torch.Tensor, timings: tuple[float, float], n_digits: int,
         args: argparse.Namespace) -> None:
    fig = plt.figure(figsize=(16, 5.4))
    grid = fig.add_gridspec(3, 12, height_ratios=[1, 1, 0.8], width_ratios=[1] * 11 + [0.08], hspace=0.5)
    for row, (image, label) in enumerate(zip(images, labels, strict=True)):
        show_digit(fig.add_subplot(grid[row, 0]), image, f"input: digit {label}")
        limit = float(maps[:, row].abs().max())  # one scale per digit, so classes compare
        for c in CLASSES:
            ax = fig.add_subplot(grid[row, 1 + c])
            shown = ax.imshow(maps[c, row].squeeze().numpy(), cmap=SIGNED, vmin=-limit, vmax=limit)
            ax.set_title(f"class {c}", fontsize=9, fontweight="bold" if c == label else "normal")
            ax.set_xticks([])
            ax.set_yticks([])
        fig.colorbar(shown, cax=fig.add_subplot(grid[row, 11]))
    bars = fig.add_subplot(grid[2, 2:9])
    names = ["one call, per_target=True", "loop over 10 targets"]
    bars.barh(names, [t * 1000 for t in timings], color=["tab:green", "tab:gray"])
    for y, t in enumerate(timings):
        bars.text(t * 1000, y, f" {t * 1000:.0f} ms", va="center")
    bars.set_xlim(0, max(timings) * 1000 * 1.2)
    bars.set_xlabel(f"time for {n_digits} digits x 10 classes (ms, best of runs)")
    bars.set_title(f"loop time / one-call time = {timings[1] / timings[0]:.2f} (same maps)", fontsize=10)
    fig.suptitle("Integrated gradients of every class logit (red raises the class, blue lowers it; "
                 "true class in bold)")
    print("picture:", save(fig, args.out, "02_per_target.png"))


if __name__ == "__main__":
    main()
