"""Composition: an ensemble as one stacked params TensorDict, and gradients of attributions.

Four CNNs share one module; their parameters are stacked into a TensorDict with batch
``[4]``. ``vmap`` over it trains them together and gives every member's predictions and
saliency maps in one call; ``torch.func.grad`` of an attribution differentiates the
explanation itself with respect to the weights. Writes ``07_composition.png``.
"""

from __future__ import annotations

import argparse

import matplotlib.pyplot as plt
import torch
from _digits import Digits, accuracy, load, make_cnn, setup_example
from _plots import save, show_digit, show_positive, show_signed
from tensordict import TensorDict, TensorDictBase
from torch import nn
from tqdm import tqdm

import tdhook_fn
from tdhook_fn.attribution import saliency

SEEDS = (0, 1, 2, 3)
LAYERS = {"0": "conv 1", "2": "conv 2", "5": "hidden linear", "7": "classifier"}


def train_ensemble(model: nn.Module, data: Digits, *, epochs: int, progress: bool) -> TensorDictBase:
    """Train one parameter set per seed at once: a vmapped forward and one backward for all."""
    members = torch.stack([tdhook_fn.params(make_cnn(seed)) for seed in SEEDS])  # batch [4]
    leaves = list(members.values(True, True))
    for leaf in leaves:
        leaf.requires_grad_(True)
    optimizer = torch.optim.Adam(leaves, lr=3e-3)
    forward = torch.func.vmap(lambda p, x: tdhook_fn.call(model, p, x))  # member k sees its own batch x[k]
    generator = torch.Generator().manual_seed(0)
    for _ in tqdm(range(epochs), desc="training 4 members at once", disable=not progress):
        orders = torch.stack([torch.randperm(len(data.train_y), generator=generator) for _ in SEEDS])
        for batch in orders.split(64, dim=1):
            logits = forward(members, data.train_x[batch])  # [4, 64, 10]
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), data.train_y[batch].flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return members.detach()


def main() -> None:
    args = setup_example(__doc__.splitlines()[0])
    data = load()
    model = make_cnn().eval()  # the structure only: every call takes its tensors from params
    members = train_ensemble(model, data, epochs=3 if args.quick else 12, progress=args.progress)

    logits = torch.func.vmap(lambda p: tdhook_fn.call(model, p, data.test_x))(members)  # [4, N, 10], one call
    member_accuracy = torch.func.vmap(accuracy, (0, None))(logits, data.test_y)
    ensemble_accuracy = float(accuracy(logits.softmax(-1).mean(0), data.test_y))
    print("member test accuracies:", " ".join(f"{a:.1%}" for a in member_accuracy.tolist()),
          f"| ensemble (mean probability): {ensemble_accuracy:.1%}")

    f = tdhook_fn.functional(model)
    inputs = TensorDict(input=data.test_x[:4], y=data.test_y[:4], batch_size=[4])
    true_class = tdhook_fn.label("y")
    maps = torch.func.vmap(lambda p: saliency(f, p, inputs, target=true_class)["input"])(members)  # [4, 4, 1, 8, 8]

    def sensitivity(p: TensorDictBase) -> torch.Tensor:
        """Mean |d logit / d pixel| of the true class: an attribution, as a function of the weights."""
        return saliency(f, p, inputs, target=true_class, abs=True)["input"].mean()

    # grad of an attribution (a VJP inside), for every member at once
    grads = torch.func.vmap(torch.func.grad(sensitivity))(members)
    layer_norms = {name: torch.cat([g.flatten(1) for g in grads[key].values()], 1).norm(dim=1)  # [4] each
                   for key, name in LAYERS.items()}
    plot(inputs, maps, layer_norms, member_accuracy.tolist(), ensemble_accuracy, args)


def plot(inputs: TensorDict, maps: torch.Tensor, layer_norms: dict[str, torch.Tensor], member_accuracy: list[float],
         ensemble_accuracy: float, args: argparse.Namespace) -> None:
    fig = plt.figure(figsize=(13, 10.5))
    grid = fig.add_gridspec(4, 4, height_ratios=[1, 1, 1, 1.2], hspace=0.35)
    mean, spread = maps.mean(0), maps.std(0)
    for col in range(4):
        show_digit(fig.add_subplot(grid[0, col]), inputs["input"][col], f"digit {int(inputs['y'][col])}")
        show_signed(fig, fig.add_subplot(grid[1, col]), mean[col], "saliency, mean of 4 members")
        show_positive(fig, fig.add_subplot(grid[2, col]), spread[col], "std across members (disagreement)")
    bars = fig.add_subplot(grid[3, :])
    width = 0.8 / len(SEEDS)
    for k, seed in enumerate(SEEDS):
        positions = [i + (k - 1.5) * width for i in range(len(layer_norms))]
        bars.bar(positions, [float(n[k]) for n in layer_norms.values()], width,
                 label=f"member {seed} (accuracy {member_accuracy[k]:.1%})")
    bars.set_xticks(range(len(layer_norms)), list(layer_norms))
    bars.set_ylabel("‖∂ sensitivity / ∂ weights‖")
    bars.set_title("grad of an attribution w.r.t. params: which layer's weights shape the mean |saliency| most",
                   fontsize=10)
    bars.legend(fontsize=8)
    bars.grid(alpha=0.3, axis="y")
    fig.suptitle(f"An ensemble of 4 CNNs as one stacked params TensorDict (ensemble accuracy {ensemble_accuracy:.1%})",
                 y=0.93)
    print("picture:", save(fig, args.out, "07_composition.png"))


if __name__ == "__main__":
    main()
