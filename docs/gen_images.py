"""Draw the pictures of the method pages into docs/img/.

Run from the repository root: ``python docs/gen_images.py`` (about half a minute on a laptop
CPU). A small CNN is trained for a few seconds on scikit-learn's bundled digits
(``load_digits``: 1797 real 8x8 images, no download) with fixed seeds, and every picture
is computed with tdhook_fn's pure methods on it. The latent page's pictures come from the
2-layer induction transformer of ``examples/08_induction_patching.py`` (about 20 s more).
``python docs/gen_images.py dimension`` draws only the intrinsic-dimension picture,
``python docs/gen_images.py conductance`` only the conductance picture,
``python docs/gen_images.py smoothgrad`` only the noise methods' one,
``python docs/gen_images.py surrogate`` only the KernelSHAP and LIME one (on scikit-learn's
bundled diabetes data),
``python docs/gen_images.py perturbation`` only the occlusion and Shapley one,
``python docs/gen_images.py deeplift`` only DeepLift's.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import sys
from pathlib import Path

import matplotlib
import matplotlib.image

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import torch
from sklearn.datasets import load_digits
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import (
    AlphaBeta,
    DimsConfig,
    EpsilonPlus,
    feature_ablation,
    grad_cam,
    guided_backprop,
    integrated_gradients,
    lrp,
    occlusion,
    saliency,
    shapley_value_sampling,
)
from tdhook_fn.attribution.metrics import infidelity, normal_perturbation, sensitivity_max, uniform_perturbation
from tdhook_fn.attribution.surrogate import kernel_shap, lime
from tdhook_fn.weights import (
    Adapter,
    adapter_params,
    apply_masks,
    best_alpha,
    global_unstructured_masks,
    ln_structured_mask,
    pruning_scores,
    sweep_alphas,
    task_vector,
    with_adapters,
)

OUT = Path(__file__).resolve().parent / "img"
LAST_CONV = "[3]"  # the ReLU after the second conv: Grad-CAM's layer
HIDDEN = "[6]"  # the ReLU after the 64-unit linear layer: where the adapter goes
DPI = 100


# -- data, model, training -------------------------------------------------------------------


def load() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train and test digits ``[N, 1, 8, 8]`` in ``[0, 1]`` and their labels (fixed split)."""
    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:450], order[450:]
    return x[train], y[train], x[test], y[test]


def make_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(),
        nn.Linear(64, 10),
    )


def make_gap_cnn() -> nn.Sequential:
    """The CNN for Grad-CAM: global average pooling before the classifier, so Grad-CAM is CAM."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float = 3e-3) -> nn.Module:
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(1)
    model.train()
    for _ in range(epochs):
        for batch in torch.randperm(len(y), generator=generator).split(64):
            loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.eval()


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return (logits.argmax(-1) == labels).float().mean()


# -- drawing helpers ----------------------------------------------------------------------------


def show(ax: plt.Axes, image: torch.Tensor, cmap: str = "gray_r", symmetric: bool = False,
         bound: float | None = None) -> matplotlib.image.AxesImage:
    """``image`` without ticks; ``symmetric`` centres the colour map on 0 (at ``bound`` or the max),
    else it runs from 0 (or the minimum, if negative) to ``bound`` (or the max)."""
    image = image.detach().squeeze()
    if symmetric:
        bound = bound or float(image.abs().max()) or 1.0
        shown = ax.imshow(image, cmap=cmap, vmin=-bound, vmax=bound)
    else:
        shown = ax.imshow(image, cmap=cmap, vmin=min(0.0, float(image.min())), vmax=bound)
    ax.set_xticks([])
    ax.set_yticks([])
    return shown


def colourbar(fig: plt.Figure, shown: matplotlib.image.AxesImage, axes: list[plt.Axes]) -> None:
    """One colour bar for ``axes``, which share ``shown``'s scale."""
    fig.colorbar(shown, ax=axes, fraction=0.025, pad=0.02, aspect=12)


def save(fig: plt.Figure, name: str) -> None:
    path = OUT / name
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    print(f"{path.relative_to(OUT.parent.parent)}: {path.stat().st_size // 1024} KB")


def image_grid(rows: list[tuple[str, torch.Tensor, str, bool]], titles: list[str], suptitle: str,
               name: str) -> None:
    """One row per ``(label, images [n, 8, 8], cmap, symmetric)``, one column per sample."""
    n = len(titles)
    fig, axes = plt.subplots(len(rows), n, figsize=(1.45 * n + 0.6, 1.5 * len(rows) + 0.5), squeeze=False,
                             layout="constrained")
    for r, (row_label, images, cmap, symmetric) in enumerate(rows):
        bound = float(images.abs().max()) or 1.0  # one scale per row, so the samples compare
        for c in range(n):
            shown = show(axes[r, c], images[c], cmap, symmetric, bound=None if cmap == "gray_r" else bound)
            if r == 0:
                axes[r, c].set_title(titles[c], fontsize=10)
        axes[r, 0].set_ylabel(row_label, fontsize=10)
        if cmap != "gray_r":
            colourbar(fig, shown, list(axes[r]))
    fig.suptitle(suptitle, fontsize=12)
    save(fig, name)


# -- one picture per method -------------------------------------------------------------------


def pick(model: nn.Module, x: torch.Tensor, y: torch.Tensor, classes: tuple[int, ...],
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first test image of each class in ``classes`` that ``model`` classifies correctly."""
    right = model(x).argmax(-1) == y
    index = torch.stack([torch.nonzero((y == c) & right)[0, 0] for c in classes])
    return x[index], y[index]


def draw_saliency(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    inputs = TensorDict(input=x, label=y, batch_size=[len(y)])
    target = tdhook_fn.label("label")
    sal = saliency(f, p, inputs, target=target, abs=True)["input"]
    ixg = saliency(f, p, inputs, target=target, multiply_by_inputs=True)["input"]
    image_grid(
        [("input", x, "gray_r", False), ("|gradient|", sal, "magma", False),
         ("input x gradient", ixg, "RdBu_r", True)],
        [f"digit {int(c)}" for c in y],
        "Saliency and input x gradient of the true class's logit (red +, blue -)",
        "saliency.png",
    )


def draw_perturbation(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """Occlusion (2x2 windows), ablation and Shapley sampling of 2x2 blocks, baseline 0 (blank paper)."""
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    inputs = TensorDict(input=x, label=y, batch_size=[len(y)])
    target = tdhook_fn.label("label")
    blocks = (torch.arange(8)[:, None] // 2 * 4 + torch.arange(8)[None, :] // 2).reshape(1, 1, 8, 8)
    occluded = occlusion(f, p, inputs, 0.0, target=target, sliding_window_shapes=(1, 2, 2))["input"]
    ablated = feature_ablation(f, p, inputs, 0.0, target=target, feature_mask=blocks)["input"]
    shapley = shapley_value_sampling(f, p, inputs, 0.0, target=target, feature_mask=blocks, n_samples=25,
                                     generator=torch.Generator().manual_seed(0))["input"]
    image_grid(
        [("input", x, "gray_r", False), ("occlusion 2x2", occluded, "RdBu_r", True),
         ("ablation, 2x2 blocks", ablated, "RdBu_r", True), ("Shapley, 2x2 blocks", shapley, "RdBu_r", True)],
        [f"digit {int(c)}" for c in y],
        "Perturbation maps of the true class's logit (red: blanking lowers it)",
        "perturbation.png",
    )


def draw_integrated_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                              test_x: torch.Tensor, test_y: torch.Tensor) -> None:
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    one = TensorDict(input=x[:1], batch_size=[1])
    classes = (int(y[0]), 5, 8)
    attrs = integrated_gradients(f, p, one, 0.0, target=classes, per_target=True, n_steps=32)["input"]

    fig = plt.figure(figsize=(7.5, 6.8))
    grid = fig.add_gridspec(2, 4, height_ratios=[1, 2.4], hspace=0.25, top=0.86)
    ax = fig.add_subplot(grid[0, 0])
    show(ax, x[0])
    ax.set_title("input", fontsize=10)
    target_axes = []
    for t, c in enumerate(classes):
        ax = fig.add_subplot(grid[0, t + 1])
        shown = show(ax, attrs[t, 0], "RdBu_r", symmetric=True, bound=float(attrs.abs().max()))
        ax.set_title(f"target {c}", fontsize=10)
        target_axes.append(ax)
    colourbar(fig, shown, target_axes)

    batch = TensorDict(input=test_x[:64], label=test_y[:64], batch_size=[64])
    steps = [2, 4, 8, 16, 32, 64]
    ax = fig.add_subplot(grid[1, :])
    for method in ("riemann_left", "riemann_right", "riemann_middle", "riemann_trapezoid", "gausslegendre"):
        deltas = [float(integrated_gradients(f, p, batch, 0.0, target=tdhook_fn.label("label"), n_steps=n,
                                             method=method, return_convergence_delta=True)[1].abs().mean())
                  for n in steps]
        ax.plot(steps, deltas, marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(steps, [str(n) for n in steps])
    ax.minorticks_off()
    ax.set_xlabel("n_steps")
    ax.set_ylabel("mean |convergence delta| (logit units)")
    ax.set_title("Completeness error by quadrature, true class, 64 test digits", fontsize=10)
    ax.legend(fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.suptitle("Integrated gradients: one map per target, one colour scale\n(per_target=True, red +, blue -)",
                 fontsize=11)
    save(fig, "integrated_gradients.png")


def draw_grad_cam(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    logits = tdhook_fn.call(model, p, x)
    top2 = logits.topk(2, dim=-1).indices
    inputs = TensorDict(input=x, first=top2[:, 0], second=top2[:, 1], batch_size=[len(y)])
    dims = {LAST_CONV: DimsConfig(weight_pooling_dims=(1, 2), feature_sum_dims=(0,))}
    first = grad_cam(f, p, inputs, target=tdhook_fn.label("first", "output"), layers=dims)[LAST_CONV]
    second = grad_cam(f, p, inputs, target=tdhook_fn.label("second", "output"), layers=dims)[LAST_CONV]

    n = len(y)
    fig, axes = plt.subplots(3, n, figsize=(1.45 * n + 1.2, 5.6), layout="constrained")
    bound = max(float(first.abs().max()), float(second.abs().max()))  # one scale for every map
    for c in range(n):
        show(axes[0, c], x[c])
        axes[0, c].set_title(f"digit {int(y[c])}", fontsize=10)
        for r, (cams, cls) in enumerate(((first, top2[:, 0]), (second, top2[:, 1])), start=1):
            ax = axes[r, c]
            shown = show(ax, cams[c], "RdBu_r", symmetric=True, bound=bound)
            ax.contour(x[c, 0], levels=[0.5], colors="black", linewidths=0.7)
            ax.set_title(f"class {int(cls[c])}", fontsize=9)
    colourbar(fig, shown, list(axes[1:].flatten()))
    axes[0, 0].set_ylabel("input", fontsize=10)
    axes[1, 0].set_ylabel("predicted\nclass", fontsize=10)
    axes[2, 0].set_ylabel("runner-up\nclass", fontsize=10)
    fig.suptitle(f"Grad-CAM at the last conv layer ({LAST_CONV}, 8x8) of a CNN with global average pooling,\n"
                 "no ReLU (red +, blue -; black line: the digit's outline)", fontsize=11)
    save(fig, "grad_cam.png")


def draw_guided_backprop(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    inputs = TensorDict(input=x, label=y, batch_size=[len(y)])
    target = tdhook_fn.label("label")
    grad = saliency(f, p, inputs, target=target)["input"]
    everywhere = guided_backprop(f, p, inputs, target=target)["input"]
    relu_only = guided_backprop(f, p, inputs, target=target,
                                classes_to_skip=(nn.Conv2d, nn.Linear, nn.Flatten))["input"]
    image_grid(
        [("input", x, "gray_r", False), ("gradient", grad, "RdBu_r", True),
         ("guided,\nevery module", everywhere, "RdBu_r", True), ("guided,\nReLUs only", relu_only, "RdBu_r", True)],
        [f"digit {int(c)}" for c in y],
        "Guided backpropagation of the true class's logit (red +, blue -)",
        "guided_backprop.png",
    )


def draw_smoothgrad(model: nn.Module, x: torch.Tensor, y: torch.Tensor, train_x: torch.Tensor) -> None:
    from tdhook_fn.attribution import deconvolution, gradient_shap, guided_grad_cam, smoothgrad

    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    inputs = TensorDict(input=x, label=y, batch_size=[len(y)])
    target = tdhook_fn.label("label")
    grad = saliency(f, p, inputs, target=target)["input"]
    smooth = smoothgrad(f, p, inputs, target=target, nt_samples=50, stdevs=0.15,
                        generator=torch.Generator().manual_seed(0))["input"]
    refs = TensorDict(input=train_x[:50], batch_size=[50])  # the baseline distribution: training digits
    shap = gradient_shap(f, p, inputs, refs, target=target, n_samples=50, stdevs=0.05,
                         generator=torch.Generator().manual_seed(0))["input"]
    deconv = deconvolution(f, p, inputs, target=target)["input"]
    guided_cam = guided_grad_cam(f, p, inputs, target=target, layer=LAST_CONV)["input"]
    image_grid(
        [("input", x, "gray_r", False), ("gradient", grad, "RdBu_r", True),
         ("SmoothGrad\n50 x N(0, 0.15)", smooth, "RdBu_r", True),
         ("GradientSHAP\n50 draws", shap, "RdBu_r", True), ("deconvolution", deconv, "RdBu_r", True),
         ("guided\nGrad-CAM", guided_cam, "RdBu_r", True)],
        [f"digit {int(c)}" for c in y],
        "Noise and modified-gradient maps of the true class's logit (red +, blue -)",
        "smoothgrad.png",
    )


def draw_lrp(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """One digit explained for every class: input x gradient, LRP EpsilonPlus, LRP alpha2-beta1."""
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    one = TensorDict(input=x[:1], batch_size=[1])
    classes = tuple(range(10))
    logits = tdhook_fn.call(model, p, x[:1])[0].view(-1, 1, 1, 1, 1)  # textbook LRP puts in f_c(x), lrp puts in 1
    alpha_beta = EpsilonPlus(rule_mapper=lambda name, m: AlphaBeta(2.0, 1.0) if isinstance(m, nn.Conv2d) else None)
    rows = {
        "input x gradient": saliency(f, p, one, target=classes, per_target=True, multiply_by_inputs=True)["input"],
        "LRP EpsilonPlus": logits * lrp(f, p, one, target=classes, per_target=True, rules=EpsilonPlus())["input"],
        "LRP alpha2-beta1\n(convolutions)": logits * lrp(f, p, one, target=classes, per_target=True,
                                                         rules=alpha_beta)["input"],
    }
    fig, axes = plt.subplots(len(rows), len(classes) + 1, figsize=(1.3 * (len(classes) + 1) + 0.4, 5.2),
                             layout="constrained")
    for r, (label, maps) in enumerate(rows.items()):
        show(axes[r, 0], x[0])
        axes[r, 0].set_ylabel(label, fontsize=9)
        bound = float(maps.abs().max())
        for c in classes:
            ax = axes[r, c + 1]
            shown = show(ax, maps[c], "RdBu_r", symmetric=True, bound=bound)
            ax.set_xlabel(f"sum {float(maps[c].sum()):+.1f}", fontsize=8)
            if r == 0:
                ax.set_title(f"class {c}\nlogit {float(logits[c]):+.1f}", fontsize=9)
        colourbar(fig, shown, list(axes[r, 1:]))
    axes[0, 0].set_title(f"digit {int(y[0])}", fontsize=9)
    fig.suptitle("LRP and input x gradient of one digit for every class, in logit units (one colour scale per "
                 "row;\nred for the class, blue against it; LRP relevance scaled by the logit, as in the textbook)",
                 fontsize=10)
    save(fig, "lrp.png")


def draw_deeplift(model: nn.Module, x: torch.Tensor, y: torch.Tensor, train_x: torch.Tensor) -> None:
    """DeepLift of the true class against three references, and DeepLiftShap over 32 training digits."""
    from tdhook_fn.attribution import deeplift, deeplift_shap

    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    inputs = TensorDict(input=x, label=y, batch_size=[len(y)])
    target = tdhook_fn.label("label")
    mean_digit = train_x.mean(0, keepdim=True)
    refs = train_x[torch.randperm(len(train_x), generator=torch.Generator().manual_seed(2))[:32]]
    rows = [("input", x, "gray_r", False),
            ("DeepLift,\nblank reference", deeplift(f, p, inputs, 0.0, target=target)["input"], "RdBu_r", True),
            ("DeepLift,\nmean digit", deeplift(f, p, inputs, mean_digit, target=target)["input"], "RdBu_r", True),
            ("DeepLiftShap,\n32 digits", deeplift_shap(f, p, inputs, TensorDict(input=refs, batch_size=[32]),
                                                       target=target)["input"], "RdBu_r", True)]
    image_grid(rows, [f"digit {int(c)}" for c in y],
               "DeepLift (rescale rule) of the true class's logit against three references (red +, blue -);\n"
               "each map sums to the logit's change from its reference", "deeplift.png")


def draw_metrics(model: nn.Module, test_x: torch.Tensor, test_y: torch.Tensor) -> None:
    """Normalized infidelity and max-sensitivity of four explanations, 64 test digits each."""
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    inputs = TensorDict(input=test_x[:64], batch_size=[64])
    target = test_y[:64]
    explainers = {
        "saliency": functools.partial(saliency, f, p),
        "input x gradient": functools.partial(saliency, f, p, multiply_by_inputs=True),
        "integrated gradients": functools.partial(integrated_gradients, f, p, baselines=0.0, n_steps=16),
        "guided backprop": functools.partial(guided_backprop, f, p),
    }
    infid, sens = {}, {}
    for name, explain in explainers.items():
        attr = explain(inputs, target=target)
        noise = functools.partial(normal_perturbation, std=0.1, generator=torch.Generator().manual_seed(0))
        infid[name] = infidelity(f, p, noise, inputs, attr, target=target, n_perturb_samples=32, normalize=True)
        radius = functools.partial(uniform_perturbation, generator=torch.Generator().manual_seed(0))
        sens[name] = sensitivity_max(explain, inputs, perturb_func=radius, perturb_radius=0.05,
                                     n_perturb_samples=16, target=target)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, scores, title in ((axes[0], infid, "infidelity (normalize=True)"),
                              (axes[1], sens, "max-sensitivity (radius 0.05)")):
        ax.boxplot([scores[n].detach().numpy() for n in scores], vert=False, showfliers=False)
        ax.set_yticks(range(1, len(scores) + 1), list(scores), fontsize=9)
        ax.set_xscale("log")
        ax.set_title(f"{title}; lower is better", fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
    axes[1].set_yticklabels([])
    fig.suptitle("Explanation metrics of four methods, 64 test digits (true class)", fontsize=11)
    fig.tight_layout()
    save(fig, "metrics.png")


def draw_task_vectors(model: nn.Module, train_x: torch.Tensor, train_y: torch.Tensor,
                      test_x: torch.Tensor, test_y: torch.Tensor) -> None:
    """Task: mirrored digits. Control: the ordinary digits the base model was trained on."""
    base = tdhook_fn.params(model)
    tuned_model = make_cnn()
    tuned_model.load_state_dict(model.state_dict())
    train(tuned_model, train_x.flip(-1), train_y, epochs=4, lr=1e-3)
    vector = task_vector(base, tdhook_fn.params(tuned_model))

    mirrored = test_x.flip(-1)

    def scores(p: TensorDict) -> torch.Tensor:
        return torch.stack([accuracy(tdhook_fn.call(model, p, mirrored), test_y),
                            accuracy(tdhook_fn.call(model, p, test_x), test_y)])

    alphas = [i / 10 for i in range(-10, 21)]
    task, control = sweep_alphas(scores, base, vector, alphas).T
    threshold = 0.9 * float(control[alphas.index(0.0)])
    chosen = best_alpha(alphas, task, control >= threshold)

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ax.plot(alphas, task, marker="o", ms=3, label="task: mirrored digits")
    ax.plot(alphas, control, marker="o", ms=3, label="control: ordinary digits")
    ax.axhline(threshold, color="gray", ls="--", lw=1, label="adequacy: 90% of base control")
    ax.axvline(chosen, color="black", ls=":", lw=1.5, label=f"best_alpha = {chosen:.1f}")
    ax.axvspan(-1.0, 0.0, color="0.92", zorder=0)
    ax.text(-0.95, 0.03, "alpha < 0: forget vector", fontsize=8.5)
    ax.set_xlabel("alpha   (params = base + alpha * task vector)")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1.02)
    ax.set_title("Task vector sweep: 31 alphas in one sweep_alphas call", fontsize=11)
    ax.legend(fontsize=8, loc="center right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save(fig, "task_vectors.png")


def draw_pruning(model: nn.Module, test_x: torch.Tensor, test_y: torch.Tensor) -> None:
    p = tdhook_fn.params(model)
    weights = lambda module_key, parameter_name, parameter: parameter if parameter_name == "weight" else None
    scores = pruning_scores(model, p, weights)
    noise = scores.apply(lambda s: torch.rand(s.shape, generator=torch.Generator().manual_seed(0)))
    hidden = scores.select(("0", "weight"), ("2", "weight"), ("5", "weight"))  # the last layer is kept whole
    amounts = np.linspace(0.0, 0.95, 20)
    curves: dict[str, list[float]] = {"global magnitude (L1 unstructured)": [], "random unstructured": [],
                                      "L2 structured (output channels, per layer)": []}
    for amount in amounts:
        masks = [global_unstructured_masks(scores, float(amount)), global_unstructured_masks(noise, float(amount)),
                 ln_structured_mask(hidden, float(amount), dim=0, n=2)]
        for name, mask in zip(curves, masks, strict=True):
            curves[name].append(float(accuracy(tdhook_fn.call(model, apply_masks(p, mask), test_x), test_y)))

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name, values in curves.items():
        ax.plot(amounts, values, marker="o", ms=3, label=name)
    ax.set_xlabel("fraction of weights (or channels) pruned")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1.02)
    ax.set_title("Pruning masks applied as params * mask (model untouched)", fontsize=11)
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save(fig, "pruning.png")


def draw_adapters(model: nn.Module, train_x: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor) -> None:
    """A sparse autoencoder at the hidden layer, trained end to end by torch.func.grad."""
    torch.manual_seed(0)
    sae = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    spec = {"sae": Adapter(sae, HIDDEN, HIDDEN)}
    f = tdhook_fn.functional(model)
    adapted = with_adapters(f, spec)
    frozen = tdhook_fn.params(model)
    tapped = f.with_taps(tdhook_fn.capture(HIDDEN, key="hidden"))
    teacher = f(frozen, TensorDict(input=train_x, batch_size=[len(train_x)]))["output"].argmax(-1)
    hidden = tapped(frozen, TensorDict(input=train_x, batch_size=[len(train_x)]))["hidden"]

    def loss(weights: TensorDict, x: torch.Tensor, labels: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        p = frozen.clone(False).update(weights)
        logits = adapted(p, TensorDict(input=x, batch_size=[len(x)]))["output"]
        latents = torch.relu(tdhook_fn.call(sae[0], weights["adapters", "sae", "0"], h))
        return nn.functional.cross_entropy(logits, labels) + 3e-3 * latents.abs().sum(-1).mean()

    weights = adapter_params(spec)
    optimizer_state = weights.apply(torch.zeros_like)
    steps, accuracies, active = [], [], []
    generator = torch.Generator().manual_seed(2)
    test = TensorDict(input=test_x, batch_size=[len(test_x)])
    test_hidden = tapped(frozen, test)["hidden"]
    for step in range(301):
        if step % 20 == 0:
            p = frozen.clone(False).update(weights)
            steps.append(step)
            accuracies.append(float(accuracy(adapted(p, test)["output"], test_y)))
            latents = torch.relu(tdhook_fn.call(sae[0], weights["adapters", "sae", "0"], test_hidden))
            active.append(float((latents > 0).float().sum(-1).mean()))
        batch = torch.randint(len(train_x), (128,), generator=generator)
        grads = torch.func.grad(loss)(weights, train_x[batch], teacher[batch], hidden[batch])
        optimizer_state = optimizer_state * 0.9 + grads  # SGD with momentum, in TensorDict arithmetic
        weights = weights - 0.05 * optimizer_state

    original = float(accuracy(tdhook_fn.call(model, frozen, test_x), test_y))
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(steps, accuracies, marker="o", ms=3, label="model with the SAE spliced in")
    left.axhline(original, color="gray", ls="--", lw=1, label="original model")
    left.set_xlabel("training step")
    left.set_ylabel("test accuracy")
    left.set_ylim(0, 1.02)
    left.set_title("Accuracy through the adapter", fontsize=10)
    left.legend(fontsize=8, loc="lower right")
    left.grid(alpha=0.3)
    right.plot(steps, active, marker="o", ms=3, color="tab:orange")
    right.set_xlabel("training step")
    right.set_ylabel("active latents per digit (of 256)")
    right.set_title("Sparsity of the SAE's latents", fontsize=10)
    right.grid(alpha=0.3)
    fig.suptitle(f"Sparse autoencoder (64 -> 256 -> 64) at {HIDDEN}, trained by torch.func.grad", fontsize=11)
    fig.tight_layout()
    save(fig, "adapters.png")


def draw_latent() -> None:
    """The latent page's pictures, from the induction model of examples/08_induction_patching.py."""
    examples = OUT.parent.parent / "examples"
    sys.path.insert(0, str(examples))  # the example imports its helpers (_digits, _plots)
    spec = importlib.util.spec_from_file_location("induction", examples / "08_induction_patching.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model, seconds, accuracy = example.train(800, progress=False)
    print(f"induction model: {seconds:.0f} s of training, second-half accuracy {accuracy:.3f}")
    result = example.analyse(model, 32)
    limit = max(float(result["patched"].abs().max()), float(result["estimated"].abs().max()))
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 3.6))
    example.draw_heatmap(fig, left, result["patched"], "Activation patching (patching_sweep)", limit)
    example.draw_heatmap(fig, right, result["estimated"],
                         f"Attribution patching (correlation {result['correlation']:.3f})", limit)
    fig.tight_layout()
    save(fig, "latent_patching.png")
    fig, ax = plt.subplots(figsize=(7, 3.8))
    example.draw_heads(ax, result["head_patched"], result["head_estimated"])
    fig.tight_layout()
    save(fig, "latent_heads.png")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    example.draw_steering(ax, result)
    fig.tight_layout()
    save(fig, "latent_steering.png")


def draw_dimension(model: nn.Module | None = None) -> None:
    """Intrinsic dimension per layer of the digits CNN, trained and at initialisation, on all 1797 digits."""
    from tdhook_fn.latent import cache
    from tdhook_fn.latent.dimension import local_knn, two_nn

    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    if model is None:
        train_x, train_y, _, _ = load()
        model = train(make_cnn(), train_x, train_y, epochs=8)
    layers = {"input": None, "conv 1": "[1]", "conv 2": "[3]", "dense": "[6]", "logits": "[7]"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharex=True)
    for label, net, style in [("trained", model, "-o"), ("at initialisation", make_cnn().eval(), "--s")]:
        f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
        with torch.no_grad():
            acts = cache(f, p, TensorDict(input=x, batch_size=[len(x)]), [s for s in layers.values() if s])
        clouds = [x.flatten(1) if site is None else acts[site.strip("[]")].flatten(1) for site in layers.values()]
        curves = {  # one cloud per layer; widths differ (64 to 2048), so a loop over five layers
            "TwoNN (Facco et al.)": [float(two_nn(c.double())) for c in clouds],
            "local kNN, median (k = 10)": [float(local_knn(c.double(), 10).nanmedian()) for c in clouds],
        }
        for ax, (title, values) in zip(axes, curves.items(), strict=True):
            ax.plot(list(layers), values, style, label=label)
            ax.set_title(title)
    for ax in axes:
        ax.set_ylabel("intrinsic dimension")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("Digits CNN: intrinsic dimension of each layer's activations (1797 real digits)")
    fig.tight_layout()
    save(fig, "dimension.png")


def draw_similarity() -> None:
    """The similarity page's picture: every pair of blocks of a random-init 12-layer GPT-2."""
    import transformers

    from tdhook_fn.latent import cache, sites
    from tdhook_fn.latent.similarity import cka, information_imbalance

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=12, n_embd=256, n_head=8, vocab_size=1000, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    f = tdhook_fn.functional(model, in_keys=["input_ids"], out_keys=["logits"])
    ids = torch.randint(0, config.vocab_size, (16, 32))
    blocks = sites(model, r"transformer\.h\.\d+")
    acts = cache(f, tdhook_fn.params(model), TensorDict(input_ids=ids, batch_size=[16]), blocks)
    layers = torch.stack([acts[s.key].flatten(0, 1) for s in blocks])  # (12, 512 tokens, 256)
    panels = [("linear CKA", cka(layers[:, None], layers[None, :])),
              ("RBF CKA (sigma = median distance)", cka(layers[:, None], layers[None, :], kernel="rbf")),
              ("information imbalance, row -> column", information_imbalance(layers[:, None], layers[None, :])[0])]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), layout="constrained")
    for ax, (title, table) in zip(axes, panels, strict=True):
        imbalance = title.startswith("information")
        shown = ax.imshow(table.numpy(), cmap="magma_r" if imbalance else "viridis", vmin=0.0,
                          vmax=float(table.max()) if imbalance else 1.0)
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("block")
        ax.set_ylabel("block")
        ax.set_xticks(range(0, 12, 2))
        ax.set_yticks(range(0, 12, 2))
        if imbalance:
            fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.02,
                         label=f"2/N = {2 / layers.shape[1]:.4f} is the minimum")
        elif ax is axes[1]:
            fig.colorbar(shown, ax=list(axes[:2]), fraction=0.023, pad=0.02)
    fig.suptitle("Random-init GPT-2 (12 blocks, d=256), 16 x 32 random tokens: all pairs of blocks, one call each",
                 fontsize=12)
    save(fig, "similarity_gpt2.png")


def draw_probing(model: nn.Module, train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor,
                 test_y: torch.Tensor) -> None:
    """Ridge and logistic probes on every layer of the digits CNN, trained and at initialisation: test accuracy."""
    from tdhook_fn.latent import cache
    from tdhook_fn.latent.probing import fit_probes, score_probes

    layers = {"pixels": None, "conv 1": "[1]", "conv 2": "[3]", "dense": "[6]", "logits": "[7]"}

    def acts(net: nn.Module, x: torch.Tensor) -> TensorDict:
        f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
        with torch.no_grad():
            read = cache(f, p, TensorDict(input=x, batch_size=[len(x)]), [s for s in layers.values() if s])
        out = TensorDict({"pixels": x.flatten(1)}, batch_size=[len(x)])
        for name, site in layers.items():
            if site:
                out[name] = read[site.strip("[]")].flatten(1)
        return out.apply(lambda t: t.double())

    scores: dict[str, list[float]] = {}
    for label, net in (("trained, ridge", model), ("trained, logistic", model), ("random init, ridge", make_cnn())):
        kind = "logistic" if "logistic" in label else "ridge"
        probes = fit_probes(acts(net, train_x), train_y, kind=kind, alpha=10.0, C=0.05)
        test = score_probes(probes, acts(net, test_x), test_y)
        scores[label] = [float(test[name]) for name in layers]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    width = 0.27
    for i, (label, values) in enumerate(scores.items()):
        ax.bar(np.arange(len(layers)) + (i - 1) * width, values, width, label=label)
    ax.set_xticks(np.arange(len(layers)), list(layers))
    ax.set_ylim(0.0, 1.0)
    ax.set_ylabel("probe test accuracy")
    ax.set_title("Linear probes on every layer of the digits CNN (one batched solve per width)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, fontsize=9)
    fig.tight_layout()
    save(fig, "probing.png")


def draw_conductance(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor,
                     test_y: torch.Tensor) -> None:
    """Layer conductance of the 32 hidden units of a digits MLP, and neuron conductance of the top units."""
    from tdhook_fn.attribution import layer_conductance, neuron_conductance

    torch.manual_seed(0)
    mlp = train(nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)),
                train_x, train_y, epochs=30)
    print(f"test accuracy, digits MLP: {float(accuracy(mlp(test_x), test_y)):.3f}")
    f, p = tdhook_fn.pure(mlp)
    inputs = TensorDict(input=test_x, label=test_y, batch_size=[len(test_y)])
    attr, delta = layer_conductance(f, p, inputs, 0.0, target=tdhook_fn.label("label"), layers=["[2]"],
                                    n_steps=64, method="riemann_trapezoid", return_convergence_delta=True)
    units = attr["[2]"]  # [450, 32]: each test digit's logit change split over the hidden units
    by_class = torch.stack([units[test_y == c].mean(0) for c in range(10)])  # [10, 32]
    order = by_class.abs().sum(0).argsort(descending=True)

    fig = plt.figure(figsize=(9, 5.6))
    grid = fig.add_gridspec(2, 4, height_ratios=[1.25, 1], hspace=0.45, wspace=0.25)
    ax = fig.add_subplot(grid[0, :])
    bound = float(by_class.abs().max())
    shown = ax.imshow(by_class[:, order], cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto")
    ax.set_yticks(range(10), [str(c) for c in range(10)])
    ax.set_xticks(range(32), [str(int(u)) for u in order], fontsize=7)
    ax.set_xlabel("hidden unit (sorted by total |conductance|)")
    ax.set_ylabel("true class")
    ax.set_title(f"Mean layer conductance per hidden unit, true-class logit, {len(test_y)} test digits "
                 f"(max |delta| {float(delta.abs().max()):.1e})", fontsize=10)
    fig.colorbar(shown, ax=ax, fraction=0.025, pad=0.01)

    digit = int(torch.nonzero(test_y == 3)[0, 0])
    one = TensorDict(input=test_x[digit : digit + 1], batch_size=[1])
    top = units[digit].abs().argsort(descending=True)[:3]
    ax = fig.add_subplot(grid[1, 0])
    show(ax, test_x[digit])
    ax.set_title("a test 3", fontsize=10)
    maps = torch.cat([neuron_conductance(f, p, one, 0.0, target=3, layer="[2]", neuron_selector=int(u),
                                         n_steps=64)["input"] for u in top])
    bound = float(maps.abs().max())
    for i, u in enumerate(top):
        ax = fig.add_subplot(grid[1, i + 1])
        show(ax, maps[i], "RdBu_r", symmetric=True, bound=bound)
        ax.set_title(f"through unit {int(u)} ({float(units[digit, u]):+.2f})", fontsize=9)
    fig.suptitle("Conductance: how the logit's change flows through a hidden layer (red +, blue -)", fontsize=11)
    save(fig, "conductance.png")
def exact_shapley(model: nn.Module, x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Shapley values of every feature of ``x`` ``[N, F]`` (absent: ``base``), by enumerating all 2^F coalitions."""
    n_features = x.shape[-1]
    codes = torch.arange(2 ** n_features)
    members = (codes[:, None] >> torch.arange(n_features)) & 1 == 1  # [2^F, F]
    with torch.no_grad():
        values = model(torch.where(members[None], x[:, None], base)).squeeze(-1)  # [N, 2^F]
    sizes = members.sum(-1)
    phi = torch.zeros_like(x)
    for i in range(n_features):
        without = ~members[:, i]
        s = sizes[without].double()
        weight = torch.exp(torch.lgamma(s + 1) + torch.lgamma(n_features - s) - math.lgamma(n_features + 1))
        gain = values[:, codes[without] | (1 << i)] - values[:, codes[without]]
        phi[:, i] = (gain * weight.to(x.dtype)).sum(-1)
    return phi


def draw_surrogate() -> None:
    """A tabular SHAP summary on scikit-learn's diabetes data, and KernelSHAP and LIME against exact Shapley values."""
    from sklearn.datasets import load_diabetes

    data = load_diabetes()
    x = torch.tensor(data.data, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0)
    y = torch.tensor(data.target, dtype=torch.float32)
    y = (y - y.mean()) / y.std()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-3)
    for _ in range(300):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[:342]).squeeze(-1), y[:342]).backward()
        optimizer.step()
    model.eval()
    f, p = tdhook_fn.pure(model)
    test = x[342:]
    base = x[:342].mean(0)  # an absent feature takes the training mean
    phi = kernel_shap(f, p, test, base, target=0, n_samples=200, generator=torch.Generator().manual_seed(0)).detach()
    local = lime(f, p, test, base, target=0, n_samples=200, interpretable_model="linear",
                 generator=torch.Generator().manual_seed(0)).detach()
    exact = exact_shapley(model, test, base)
    names = list(data.feature_names)
    order = phi.abs().mean(0).argsort()

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [1.3, 1]})
    ax = axes[0]
    jitter = torch.randn(phi.shape, generator=torch.Generator().manual_seed(1)) * 0.08
    for row, i in enumerate(order.tolist()):
        dots = ax.scatter(phi[:, i], row + jitter[:, i], c=test[:, i].clamp(-2.5, 2.5), cmap="coolwarm", s=9,
                          vmin=-2.5, vmax=2.5)
    ax.axvline(0, color="gray", lw=0.8)
    ax.set_yticks(range(len(order)), [names[i] for i in order.tolist()], fontsize=9)
    ax.set_xlabel("KernelSHAP value (effect on the standardised prediction)")
    ax.set_title("KernelSHAP, 100 held-out patients, 200 samples each", fontsize=10)
    fig.colorbar(dots, ax=ax, fraction=0.04, pad=0.02).set_label("feature value (standardised)", fontsize=8)
    ax = axes[1]
    ax.scatter(exact.flatten(), local.flatten(), s=6, alpha=0.5, color="tab:orange",
               label="LIME (linear, cosine kernel)")
    ax.scatter(exact.flatten(), phi.flatten(), s=6, alpha=0.7, color="tab:blue", label="KernelSHAP")
    lims = [float(exact.min()) - 0.05, float(exact.max()) + 0.05]
    ax.plot(lims, lims, color="black", lw=0.8)
    ax.set_xlabel("exact Shapley value (all 1024 coalitions)")
    ax.set_ylabel("estimate")
    ax.set_title("Estimates against exact Shapley values", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    gap = (phi - exact).abs().max()
    ax.text(0.98, 0.03, f"KernelSHAP max error {float(gap):.3f}", transform=ax.transAxes, ha="right", fontsize=8)
    fig.tight_layout()
    save(fig, "surrogate.png")


def main() -> None:
    torch.manual_seed(0)
    OUT.mkdir(exist_ok=True)
    train_x, train_y, test_x, test_y = load()
    model = train(make_cnn(), train_x, train_y, epochs=8)
    print(f"test accuracy: {float(accuracy(model(test_x), test_y)):.3f}")
    classes = (0, 2, 3, 4, 7, 9)
    x, y = pick(model, test_x, test_y, classes)
    draw_saliency(model, x, y)
    draw_perturbation(model, x, y)
    draw_integrated_gradients(model, x[2:], y[2:], test_x, test_y)
    gap_model = train(make_gap_cnn(), train_x, train_y, epochs=40, lr=5e-3)
    print(f"test accuracy, global-average-pooling CNN: {float(accuracy(gap_model(test_x), test_y)):.3f}")
    draw_grad_cam(gap_model, *pick(gap_model, test_x, test_y, classes))
    draw_guided_backprop(model, x, y)
    draw_smoothgrad(model, x, y, train_x)
    draw_lrp(model, x[2:], y[2:])
    draw_deeplift(model, x, y, train_x)
    draw_metrics(model, test_x, test_y)
    draw_task_vectors(model, train_x, train_y, test_x, test_y)
    draw_pruning(model, test_x, test_y)
    draw_adapters(model, train_x, test_x, test_y)
    draw_dimension(model)
    draw_probing(model, train_x, train_y, test_x, test_y)
    draw_latent()
    draw_similarity()
    draw_conductance(train_x, train_y, test_x, test_y)
    draw_surrogate()


def main_perturbation() -> None:
    """Only the perturbation page's picture (``python docs/gen_images.py perturbation``)."""
    OUT.mkdir(exist_ok=True)
    train_x, train_y, test_x, test_y = load()
    model = train(make_cnn(), train_x, train_y, epochs=8)
    draw_perturbation(model, *pick(model, test_x, test_y, (0, 2, 3, 4, 7, 9)))


def main_probing() -> None:
    """Only the probing page's picture (``python docs/gen_images.py probing``)."""
    OUT.mkdir(exist_ok=True)
    train_x, train_y, test_x, test_y = load()
    draw_probing(train(make_cnn(), train_x, train_y, epochs=8), train_x, train_y, test_x, test_y)


def main_smoothgrad() -> None:
    """Only the noise methods' picture (``python docs/gen_images.py smoothgrad``)."""
    OUT.mkdir(exist_ok=True)
    train_x, train_y, test_x, test_y = load()
    model = train(make_cnn(), train_x, train_y, epochs=8)
    draw_smoothgrad(model, *pick(model, test_x, test_y, (0, 2, 3, 4, 7, 9)), train_x)


if __name__ == "__main__":
    if sys.argv[1:] == ["dimension"]:
        OUT.mkdir(exist_ok=True)
        draw_dimension()
    elif sys.argv[1:] == ["probing"]:
        main_probing()
    elif sys.argv[1:] == ["deeplift"]:
        OUT.mkdir(exist_ok=True)
        digits_x, digits_y, held_x, held_y = load()
        trained = train(make_cnn(), digits_x, digits_y, epochs=8)
        draw_deeplift(trained, *pick(trained, held_x, held_y, (0, 2, 3, 4, 7, 9)), digits_x)
    elif sys.argv[1:] == ["perturbation"]:
        main_perturbation()
    elif sys.argv[1:] == ["conductance"]:
        OUT.mkdir(exist_ok=True)
        draw_conductance(*load())
    elif sys.argv[1:] == ["smoothgrad"]:
        main_smoothgrad()
    elif sys.argv[1:] == ["surrogate"]:
        OUT.mkdir(exist_ok=True)
        draw_surrogate()
    else:
        main()
