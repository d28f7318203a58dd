"""Pruning without touching the model: accuracy against sparsity, unstructured vs structured.

Masks are boolean TensorDicts (``True`` keeps a weight) that select exactly what
``torch.nn.utils.prune`` selects; ``apply_masks`` zeroes the rest of a params copy and
``tdhook_fn.call`` evaluates it. Writes ``04_pruning.png``.
"""

from __future__ import annotations

import argparse

import matplotlib.pyplot as plt
import torch
from _digits import accuracy, load, setup_example, trained_cnn
from _plots import save
from tensordict import TensorDictBase

import tdhook_fn
from tdhook_fn.weights import apply_masks, global_unstructured_masks, ln_structured_mask, pruning_scores

# both convs and the hidden linear layer; the classifier ("7") stays whole, as pruning
# its rows would delete classes
PRUNED_LAYERS = ("0", "2", "5")


def weight_magnitude(module_key: str, parameter_name: str, parameter: torch.Tensor) -> torch.Tensor | None:
    """Importance of a weight: its magnitude; ``None`` leaves a parameter unpruned."""
    return parameter.abs() if module_key in PRUNED_LAYERS and parameter_name == "weight" else None


def main() -> None:
    args = setup_example(__doc__.splitlines()[0])
    data = load()
    model, test_accuracy = trained_cnn(args, data)
    print(f"dense model: test accuracy {test_accuracy:.1%}")
    params = tdhook_fn.params(model)
    scores = pruning_scores(model, params, weight_magnitude)
    n_pruned = sum(s.numel() for s in scores.values(True, True))
    print(f"pruning {n_pruned} weights of layers {', '.join(PRUNED_LAYERS)}")

    def test_accuracy_with(masks: TensorDictBase) -> float:
        return float(accuracy(tdhook_fn.call(model, apply_masks(params, masks), data.test_x), data.test_y))

    sparsities = [0.0, 0.5, 0.8, 0.9, 0.97] if args.quick else [i / 20 for i in range(20)] + [0.97, 0.99]
    unstructured, structured = [], []
    print("sparsity   global unstructured   L1 structured (dim 0)")
    for sparsity in sparsities:
        unstructured.append(test_accuracy_with(global_unstructured_masks(scores, sparsity)))
        structured.append(test_accuracy_with(ln_structured_mask(scores, sparsity, dim=0)))
        print(f"{sparsity:8.0%}   {unstructured[-1]:19.1%}   {structured[-1]:21.1%}")
    plot(sparsities, unstructured, structured, n_pruned, args)


def plot(sparsities: list[float], unstructured: list[float], structured: list[float], n_pruned: int,
         args: argparse.Namespace) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    percent = [s * 100 for s in sparsities]
    ax.plot(percent, [a * 100 for a in unstructured], "o-", label="global unstructured (smallest |w| anywhere)")
    ax.plot(percent, [a * 100 for a in structured], "s-", label="L1 structured, dim 0 (whole filters / units)")
    ax.axhline(10, color="gray", linestyle=":", label="chance (10 classes)")
    ax.set_xlabel(f"sparsity: % of the {n_pruned} conv and hidden-linear weights set to zero")
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", fontsize=9)
    ax.set_title("Digits CNN: accuracy against sparsity, masks applied to a params copy")
    fig.tight_layout()
    print("picture:", save(fig, args.out, "04_pruning.png"))


if __name__ == "__main__":
    main()
