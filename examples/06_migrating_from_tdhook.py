"""Migrating from tdhook: the same script runs on tdhook 0.1.3 and on tdhook_fn.compat.

Only the import changes: ``import tdhook.attribution as attribution`` becomes
``import tdhook_fn.compat.attribution as attribution``. Below, the tdhook script is the
function ``explain``; it runs once with each module and the maps are compared.
Writes ``06_migrating_from_tdhook.png``.
"""

from __future__ import annotations

import argparse
import time
from types import ModuleType

import matplotlib.pyplot as plt
import torch
from _digits import load, setup_example, trained_cnn
from _plots import save, show_digit, show_signed
from tensordict import TensorDict
from torch import nn

import tdhook_fn.compat.attribution as compat_attribution

try:
    import tdhook.attribution as tdhook_attribution
except ImportError:  # tdhook is only needed for the comparison
    tdhook_attribution = None


def labelled_class(outputs: TensorDict, extra: TensorDict) -> TensorDict:
    """tdhook's ``init_attr_targets``: the logit of each digit's label.

    The labels ``[B]`` are broadcast over integrated gradients' trailing path-point dim
    (outputs ``[B, n_steps]``). tdhook 0.1.3's ``init_attr_targets_with_labels`` cannot be
    used here: it fails with ``compute_convergence_delta=True``.
    """
    logits, labels = outputs["output"], extra["label"]
    labels = labels.reshape(*labels.shape, *[1] * (logits.dim() - 1 - labels.dim())).expand(logits.shape[:-1])
    return TensorDict(output=logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1), batch_size=outputs.batch_size)


def explain(attribution: ModuleType, model: nn.Module, td: TensorDict) -> TensorDict:
    """tdhook code, unchanged: integrated gradients of each digit's labelled class."""
    context = attribution.IntegratedGradients(init_attr_targets=labelled_class, additional_init_keys=["label"],
                                              multiply_by_inputs=True, compute_convergence_delta=True, n_steps=50)
    with context.prepare(model) as hooked:
        return hooked(td.clone())


def main() -> None:
    args = setup_example(__doc__.splitlines()[0])
    data = load()
    model, test_accuracy = trained_cnn(args, data)
    print(f"test accuracy: {test_accuracy:.1%}")
    x = data.test_x[:4]
    td = TensorDict(input=x, baseline=TensorDict(input=torch.zeros_like(x)), label=data.test_y[:4], batch_size=[4])

    results = {}
    libraries = {"tdhook_fn.compat": compat_attribution}
    if tdhook_attribution is None:
        print("tdhook is not installed (pip install tdhook==0.1.3): running the tdhook_fn.compat half only")
    else:
        libraries = {"tdhook 0.1.3": tdhook_attribution, **libraries}
    for name, attribution in libraries.items():
        explain(attribution, model, td)  # warm-up, so the timing below is fair to both
        start = time.perf_counter()
        results[name] = explain(attribution, model, td)
        print(f"{name:>17}: {(time.perf_counter() - start) * 1000:6.1f} ms, convergence delta "
              + " ".join(f"{d:+.1e}" for d in results[name]["convergence_delta"].tolist()))
    difference = None
    if len(results) == 2:
        ours, theirs = results["tdhook_fn.compat"], results["tdhook 0.1.3"]
        difference = float((ours["attr", "input"] - theirs["attr", "input"]).abs().max())
        delta_gap = float((ours["convergence_delta"] - theirs["convergence_delta"]).abs().max())
        print(f"max |difference| of the maps: {difference:.1e}; of the convergence deltas: {delta_gap:.1e}")
    plot(x, data.test_y[:4].tolist(), {k: v["attr", "input"] for k, v in results.items()}, difference, args)


def plot(images: torch.Tensor, labels: list[int], maps: dict[str, torch.Tensor], difference: float | None,
         args: argparse.Namespace) -> None:
    fig, axes = plt.subplots(len(images), 1 + len(maps), figsize=(3.2 * (1 + len(maps)), 2.6 * len(images)),
                             squeeze=False)
    for row, (image, label) in enumerate(zip(images, labels, strict=True)):
        show_digit(axes[row, 0], image, f"digit {label}")
        for col, (name, values) in enumerate(maps.items(), start=1):
            show_signed(fig, axes[row, col], values[row], f"{name}\nintegrated gradients")
    verdict = "tdhook not installed" if difference is None else f"max |difference| = {difference:.1e}"
    fig.suptitle(f"The same tdhook script, two libraries ({verdict})")
    fig.tight_layout()
    print("picture:", save(fig, args.out, "06_migrating_from_tdhook.png"))


if __name__ == "__main__":
    main()
