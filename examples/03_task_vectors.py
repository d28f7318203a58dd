"""Task vectors on digits: fine-tune on classes 0-4, then add or subtract what fine-tuning changed.

``task_vector(base, finetuned)`` is ``finetuned - base``, a TensorDict of the same keys;
``forget_vector`` is its negation. ``sweep_alphas`` scores ``base + alpha * vector`` for
many alphas (in one ``vmap`` when that is faster). Writes ``03_task_vectors.png``.
"""

from __future__ import annotations

import argparse
import copy

import matplotlib.pyplot as plt
import torch
from _digits import accuracy, load, setup_example, train, trained_cnn
from _plots import save
from tensordict import TensorDictBase

import tdhook_fn
from tdhook_fn.weights import best_alpha, forget_vector, sweep_alphas, task_vector

TASK = (0, 1, 2, 3, 4)  # the classes fine-tuned on, then forgotten
OTHERS = (5, 6, 7, 8, 9)


def main() -> None:
    args = setup_example(__doc__.splitlines()[0])
    data = load()
    model, test_accuracy = trained_cnn(args, data)
    print(f"base model: test accuracy {test_accuracy:.1%}")
    finetuned, _ = train(copy.deepcopy(model), data.only(TASK), epochs=2 if args.quick else 4, lr=1e-3,
                         progress=args.progress)
    base, tuned = tdhook_fn.params(model), tdhook_fn.params(finetuned)

    task_x, task_y = data.only(TASK).test_x, data.only(TASK).test_y
    other_x, other_y = data.only(OTHERS).test_x, data.only(OTHERS).test_y

    def accuracies(p: TensorDictBase) -> torch.Tensor:
        """Test accuracy on the task classes and on the others, as a tensor (vmappable)."""
        return torch.stack([accuracy(tdhook_fn.call(model, p, task_x), task_y),
                            accuracy(tdhook_fn.call(model, p, other_x), other_y)])

    alphas = torch.linspace(0, 3, 7 if args.quick else 25)
    adding = sweep_alphas(accuracies, base, task_vector(base, tuned), alphas)
    forgetting = sweep_alphas(accuracies, base, forget_vector(base, tuned), alphas)
    print("alpha   task vector (0-4 / 5-9)   forget vector (0-4 / 5-9)")
    for a, add, forget in zip(alphas.tolist(), adding.tolist(), forgetting.tolist(), strict=True):
        print(f"{a:5.2f}   {add[0]:6.1%} / {add[1]:6.1%}          {forget[0]:6.1%} / {forget[1]:6.1%}")

    # forget the most while keeping 95% of the base accuracy on the other classes
    kept_enough = forgetting[:, 1] >= 0.95 * forgetting[0, 1]
    chosen = best_alpha(alphas.tolist(), -forgetting[:, 0], kept_enough)
    print(f"best forgetting alpha: {chosen:.2f}")
    plot(alphas, adding, forgetting, chosen, args)


def plot(alphas: torch.Tensor, adding: torch.Tensor, forgetting: torch.Tensor, chosen: float,
         args: argparse.Namespace) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, scores, vector in ((left, adding, "task vector (finetuned - base)"),
                               (right, forgetting, "forget vector (base - finetuned)")):
        ax.plot(alphas, scores[:, 0] * 100, "o-", color="tab:red", label="classes 0-4 (fine-tuned on)")
        ax.plot(alphas, scores[:, 1] * 100, "s-", color="tab:blue", label="classes 5-9 (not seen in fine-tuning)")
        ax.set_title(f"base + alpha x {vector}", fontsize=10)
        ax.set_xlabel("alpha (0: base model, 1: fine-tuned / its mirror image)")
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
    right.axvline(chosen, color="gray", linestyle="--", label=f"best_alpha = {chosen:.2f} (5-9 keep 95% of base)")
    left.set_ylabel("test accuracy (%)")
    left.legend(loc="lower left", fontsize=8)
    right.legend(loc="lower left", fontsize=8)
    fig.suptitle("Task arithmetic on digits: adding the vector specialises the model, subtracting it forgets 0-4")
    fig.tight_layout()
    print("picture:", save(fig, args.out, "03_task_vectors.png"))


if __name__ == "__main__":
    main()
