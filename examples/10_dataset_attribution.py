"""Attributions for the whole digits set on disk, then class means and a deletion curve.

``tdhook_fn.data.attribute`` runs saliency, integrated gradients and Grad-CAM over all
1,797 digits a batch at a time into memory-mapped TensorDicts (one row per digit), which
a re-run returns at once and a killed run resumes. The faithfulness picture: remove the
most-attributed pixels first and watch the accuracy fall; the faster it falls, the
better the map points at what the model uses. Writes ``10_dataset_attribution.png``.

Run it on several processes with ``torchrun --nproc_per_node=2 examples/10_dataset_attribution.py``:
the ranks share the batches and every rank gets the whole result.
"""

from __future__ import annotations

import time

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from _digits import CLASSES, LAST_CONV, load, setup_example, trained_cnn
from _plots import SIGNED, save
from sklearn.datasets import load_digits
from tensordict import TensorDict

import tdhook_fn
import tdhook_fn.data
from tdhook_fn.attribution import DimsConfig, grad_cam, integrated_gradients, saliency


def all_digits(limit: int | None) -> TensorDict:
    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    data = TensorDict(input=x, label=torch.tensor(bunch.target), batch_size=[len(x)])
    return data[:limit] if limit else data


def deletion_curve(model: torch.nn.Module, data: TensorDict, scores: torch.Tensor, steps: int) -> torch.Tensor:
    """Accuracy with the ``k`` highest-scored pixels of each digit set to 0, for ``k`` in ``steps`` stops."""
    x, y = data["input"].flatten(1), data["label"]
    order = scores.flatten(1).argsort(dim=1, descending=True)
    accuracies = []
    with torch.no_grad():
        for k in torch.linspace(0, x.shape[1], steps).round().long().tolist():
            removed = x.scatter(1, order[:, :k], 0.0)
            accuracies.append((model(removed.view_as(data["input"])).argmax(-1) == y).float().mean())
    return torch.stack(accuracies)


def main() -> None:
    args = setup_example(__doc__.splitlines()[0])
    model, test_accuracy = trained_cnn(args, load())
    f, params = tdhook_fn.functional(model), tdhook_fn.params(model)
    data = all_digits(300 if args.quick else None)
    true_class = tdhook_fn.label("label")
    runs = {
        "saliency |∂y/∂x|": (saliency, dict(target=true_class, abs=True)),
        "integrated gradients": (integrated_gradients, dict(target=true_class, baselines=0.0,
                                                            n_steps=8 if args.quick else 32)),
        "Grad-CAM (last conv)": (grad_cam, dict(target=true_class, layers={LAST_CONV: DimsConfig((1, 2), (0,))})),
    }
    maps = {}
    for name, (method, kwargs) in runs.items():
        out_dir = args.out / "10_dataset_runs" / method.__name__
        start = time.perf_counter()
        # overwrite=True: each run of the example starts afresh (its model may differ)
        result = tdhook_fn.data.attribute(method, f, params, data, out_dir, batch_size=64, overwrite=True,
                                          progress=args.progress, **kwargs)
        first = time.perf_counter() - start
        start = time.perf_counter()
        result = tdhook_fn.data.attribute(method, f, params, data, out_dir, batch_size=64,
                                          progress=args.progress, **kwargs)  # finished: nothing recomputed
        print(f"{name}: {len(data)} digits in {first:.2f} s; the re-run returned in "
              f"{1e3 * (time.perf_counter() - start):.0f} ms")
        maps[name] = (result[LAST_CONV] if method is grad_cam else result["input"]).reshape(len(data), 8, 8)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    print(f"test accuracy of the CNN: {test_accuracy:.1%}")

    fig = plt.figure(figsize=(17, 5.5))
    grid = fig.add_gridspec(len(maps), len(CLASSES) + 5, width_ratios=[1] * len(CLASSES) + [0.15, 0.5] + [1.4] * 3)
    for row, (name, values) in enumerate(maps.items()):
        means = [values[data["label"] == c].mean(0) for c in CLASSES]
        limit = max(float(m.abs().max()) for m in means) or 1.0  # one symmetric scale per method
        for c, mean in zip(CLASSES, means, strict=True):
            ax = fig.add_subplot(grid[row, c])
            image = ax.imshow(mean.numpy(), cmap=SIGNED, vmin=-limit, vmax=limit)
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"class {c}", fontsize=8)
            if c == 0:
                ax.set_ylabel(name, fontsize=8)
        fig.colorbar(image, cax=fig.add_subplot(grid[row, len(CLASSES)]))
    curve_ax = fig.add_subplot(grid[:, len(CLASSES) + 2:])
    steps = 17
    fraction = torch.linspace(0, 1, steps)
    for name, values in maps.items():
        curve_ax.plot(fraction, deletion_curve(model, data, values, steps), marker="o", label=name)
    random = torch.rand(len(data), 8, 8, generator=torch.Generator().manual_seed(0))
    curve_ax.plot(fraction, deletion_curve(model, data, random, steps), "k--", label="random order")
    curve_ax.set_xlabel("fraction of pixels removed (most attributed first)")
    curve_ax.set_ylabel("accuracy")
    curve_ax.set_title("deletion curves (lower is more faithful)")
    curve_ax.legend(fontsize=8)
    fig.suptitle("Class-mean attribution maps over the digits set, and how fast removing what they point at "
                 "breaks the model")
    fig.tight_layout()
    print("picture:", save(fig, args.out, "10_dataset_attribution.png"))


if __name__ == "__main__":
    main()
