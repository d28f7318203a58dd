"""The demo: a small CNN learns real handwritten digits, then tdhook_fn explains its predictions.

Run with ``make demo`` (or ``python examples/demo.py [--quick] [--no-progress] [--out DIR]``).
Every attribution is a pure function of ``(f, params, inputs)``: nothing is hooked onto
the model. Writes ``demo_methods.png`` and ``demo_per_target.png``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from _digits import CLASSES, LAST_CONV, load, setup_example, trained_cnn
from _plots import SIGNED, save, show_digit, show_positive, show_signed
from tensordict import TensorDict

import tdhook_fn
from tdhook_fn.attribution import DimsConfig, grad_cam, integrated_gradients, saliency

N_DIGITS = 6


@contextmanager
def timed(name: str, timings: dict[str, float]) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start


def pick_digits(labels: torch.Tensor, predictions: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the first mistake (the most interesting to explain), then one digit per class."""
    mistakes = (labels != predictions).nonzero().flatten()[:1].tolist()
    firsts = [int((labels == c).nonzero()[0]) for c in CLASSES if c not in labels[mistakes].tolist()]
    return torch.tensor((mistakes + firsts)[:n])


def main() -> None:
    args = setup_example(__doc__.splitlines()[0])
    data = load()
    model, test_accuracy = trained_cnn(args, data)
    print(f"CNN trained on {len(data.train_y)} digits: test accuracy {test_accuracy:.1%} on {len(data.test_y)}")

    f, params = tdhook_fn.functional(model), tdhook_fn.params(model)
    with torch.no_grad():
        predictions = model(data.test_x).argmax(-1)
    chosen = pick_digits(data.test_y, predictions, N_DIGITS)
    # the predicted class travels with the inputs: label("pred") makes it each sample's target
    inputs = TensorDict(input=data.test_x[chosen], pred=predictions[chosen], batch_size=[len(chosen)])
    explain = tdhook_fn.label("pred")

    timings: dict[str, float] = {}
    with timed("saliency", timings):
        saliency_maps = saliency(f, params, inputs, target=explain, abs=True)["input"]
    with timed("integrated gradients", timings):
        ig, delta = integrated_gradients(f, params, inputs, 0.0, target=explain, return_convergence_delta=True)
    print("integrated gradients convergence delta (sum of attributions - change of the logit), per digit:")
    print("  " + " ".join(f"{d:+.1e}" for d in delta.tolist()))
    with timed("Grad-CAM", timings):
        cams = grad_cam(f, params, inputs, target=explain, layers={LAST_CONV: DimsConfig((1, 2), (0,))})
    with timed("integrated gradients, 10 classes in one call", timings):
        per_class = integrated_gradients(f, params, inputs[:1], 0.0, target=CLASSES, per_target=True)["input"]

    labels = data.test_y[chosen].tolist()
    methods_png = plot_methods(inputs["input"], labels, inputs["pred"].tolist(), saliency_maps, ig["input"],
                               cams[LAST_CONV].relu(), args)
    with torch.no_grad():
        logits = model(inputs["input"][:1])[0]
    per_target_png = plot_per_target(inputs["input"][0], labels[0], int(inputs["pred"][0]), per_class[:, 0], logits,
                                     args)
    print(f"pictures: {methods_png}\n          {per_target_png}")
    print("time per method (6 digits; the last one: 10 maps of one digit):")
    for name, seconds in timings.items():
        print(f"  {name:<46} {seconds * 1000:7.1f} ms")


def plot_methods(images: torch.Tensor, labels: list[int], predictions: list[int], saliency_maps: torch.Tensor,
                 ig: torch.Tensor, cams: torch.Tensor, args: argparse.Namespace) -> Path:
    columns = ["input", "saliency |∂y/∂x|", "integrated gradients", "Grad-CAM (last conv)"]
    fig, axes = plt.subplots(len(images), 4, figsize=(11, 2.3 * len(images) + 0.6), layout="constrained")
    # one scale per map, its 99th percentile of |value|: a shared or max scale lets one extreme pixel
    # (integrated gradients has them) flatten the other maps to blank; brighter pixels saturate
    for row, (image, label, predicted) in enumerate(zip(images, labels, predictions, strict=True)):
        verdict = "right" if label == predicted else "WRONG"
        show_digit(axes[row, 0], image, f"true {label}, predicted {predicted} ({verdict})")
        show_positive(fig, axes[row, 1], saliency_maps[row], columns[1], label="|gradient|")
        show_signed(fig, axes[row, 2], ig[row], columns[2], label="attribution")
        show_positive(fig, axes[row, 3], cams[row], columns[3], label="ReLU(Grad-CAM)")
    fig.suptitle("Why the CNN predicts its class: three attributions of the predicted logit\n"
                 "(each map on its own scale, to its 99th percentile; red raises the logit, blue lowers it)")
    return save(fig, args.out, "demo_methods.png")


def plot_per_target(image: torch.Tensor, label: int, predicted: int, maps: torch.Tensor, logits: torch.Tensor,
                    args: argparse.Namespace) -> Path:
    """The digit, then one integrated-gradients map per class on one shared scale."""
    fig = plt.figure(figsize=(13, 5))
    grid = fig.add_gridspec(2, 6, width_ratios=[1.3, 1, 1, 1, 1, 1])
    show_digit(fig.add_subplot(grid[:, 0]), image, f"input: true {label}, predicted {predicted}")
    limit = float(maps.abs().max())
    class_axes = [fig.add_subplot(grid[c // 5, 1 + c % 5]) for c in CLASSES]
    for c, ax in zip(CLASSES, class_axes, strict=True):
        shown = ax.imshow(maps[c].squeeze().numpy(), cmap=SIGNED, vmin=-limit, vmax=limit)
        ax.set_title(f"class {c}: logit {logits[c]:.1f}\nΣ attr = {maps[c].sum():+.1f}", fontsize=9,
                     fontweight="bold" if c == predicted else "normal")
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(shown, ax=class_axes, fraction=0.02, pad=0.02, label="attribution (red: raises the class)")
    fig.suptitle("Integrated gradients for all ten classes from one call (per_target=True); "
                 "Σ attr = logit(digit) - logit(blank), predicted class in bold")
    return save(fig, args.out, "demo_per_target.png")


if __name__ == "__main__":
    main()
