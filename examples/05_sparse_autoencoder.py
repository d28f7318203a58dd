"""A sparse autoencoder on the CNN's 64-unit hidden layer, trained through the adapted pure function.

``with_adapters`` splices the autoencoder into the model's forward: its reconstruction
replaces the hidden activation, and its weights live in the params under ``"adapters"``.
``torch.func.grad`` of a loss of that pure function trains them (reconstruction + L1 on
the features); the model is never changed. Writes ``05_sparse_autoencoder.png``.
"""

from __future__ import annotations

import argparse

import matplotlib.pyplot as plt
import torch
from _digits import HIDDEN, accuracy, load, setup_example, trained_cnn
from _plots import save
from tensordict import TensorDict, TensorDictBase
from torch import nn
from tqdm import tqdm

import tdhook_fn
from tdhook_fn.weights import Adapter, adapter_params, with_adapters

N_FEATURES = 256  # 4x the hidden width: an overcomplete dictionary
L1_WEIGHT = 0.3


class SparseAutoencoder(nn.Module):
    def __init__(self, width: int, n_features: int) -> None:
        super().__init__()
        self.encoder = nn.Linear(width, n_features)
        self.decoder = nn.Linear(n_features, width)

    def forward(self, activation: torch.Tensor) -> torch.Tensor:
        return self.decoder(torch.relu(self.encoder(activation)))


def adam_step(weights: TensorDictBase, grads: TensorDictBase, state: dict[str, TensorDictBase], step: int,
              lr: float = 2e-3, betas: tuple[float, float] = (0.9, 0.999)) -> TensorDictBase:
    """Adam as TensorDict arithmetic: the weights stay a plain TensorDict, not module parameters."""
    state["m"] = state["m"] * betas[0] + grads * (1 - betas[0])
    state["v"] = state["v"] * betas[1] + grads * grads * (1 - betas[1])
    m_hat, v_hat = state["m"] / (1 - betas[0] ** step), state["v"] / (1 - betas[1] ** step)
    return weights - m_hat * lr / (v_hat.sqrt() + 1e-8)


def main() -> None:
    args = setup_example(__doc__.splitlines()[0])
    data = load()
    model, test_accuracy = trained_cnn(args, data)
    print(f"CNN test accuracy: {test_accuracy:.1%}")
    torch.manual_seed(0)
    sae = SparseAutoencoder(64, N_FEATURES)
    spliced = {"sae": Adapter(sae, HIDDEN, HIDDEN)}
    # a tap of the base function runs before the adapter (it sees the model's activation),
    # one added to the adapted function runs after it (it sees the reconstruction)
    base = tdhook_fn.functional(model).with_taps(tdhook_fn.capture(HIDDEN, key="activation"))
    adapted = with_adapters(base, spliced).with_taps(tdhook_fn.capture(HIDDEN, key="reconstruction"))
    model_params = tdhook_fn.params(model)

    def run(sae_weights: TensorDictBase, x: torch.Tensor) -> TensorDict:
        params = model_params.clone(False).update(TensorDict(adapters=TensorDict(sae=sae_weights)))
        return adapted(params, TensorDict(input=x, batch_size=[len(x)]))

    def loss(sae_weights: TensorDictBase, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = run(sae_weights, x)
        reconstruction_loss = (out["reconstruction"] - out["activation"]).pow(2).sum(-1).mean()
        # the features, for the L1 term: the encoder half of the adapter on the same activation
        features = torch.relu(tdhook_fn.call(sae.encoder, sae_weights["encoder"], out["activation"]))
        sparsity = features.abs().sum(-1).mean()
        return reconstruction_loss + L1_WEIGHT * sparsity, torch.stack(
            [reconstruction_loss, (features > 0).float().mean()])

    gradient = torch.func.grad(loss, has_aux=True)
    weights = adapter_params(spliced)["adapters", "sae"]
    state = {"m": weights.apply(torch.zeros_like), "v": weights.apply(torch.zeros_like)}
    n_steps, batch_size = (150, 128) if args.quick else (1500, 128)
    generator = torch.Generator().manual_seed(0)
    history = []
    for step in tqdm(range(1, n_steps + 1), desc="training the SAE", disable=not args.progress):
        batch = torch.randint(len(data.train_y), (batch_size,), generator=generator)
        grads, (reconstruction_loss, active) = gradient(weights, data.train_x[batch])
        weights = adam_step(weights, grads, state, step)
        history.append((reconstruction_loss.item(), active.item()))

    with torch.no_grad():
        test = run(weights, data.test_x)
        variance = (test["activation"] - test["activation"].mean(0)).pow(2).sum(-1).mean()
        explained = 1 - (test["reconstruction"] - test["activation"]).pow(2).sum(-1).mean() / variance
        spliced_accuracy = float(accuracy(test["output"], data.test_y))
    print(f"after {n_steps} steps: reconstruction loss {history[-1][0]:.3f}, "
          f"active features {history[-1][1]:.1%} of {N_FEATURES}")
    print(f"test set: variance explained {explained:.1%}; accuracy with the SAE spliced in "
          f"{spliced_accuracy:.1%} (model alone {test_accuracy:.1%})")
    plot(history, spliced_accuracy, test_accuracy, args)


def plot(history: list[tuple[float, float]], spliced_accuracy: float, test_accuracy: float,
         args: argparse.Namespace) -> None:
    steps = range(1, len(history) + 1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(steps, [h[0] for h in history], color="tab:blue")
    left.set_yscale("log")
    left.set_xlabel("training step")
    left.set_ylabel("reconstruction loss (squared error, per sample)")
    left.set_title("reconstruction of the 64 hidden activations")
    right.plot(steps, [h[1] * 100 for h in history], color="tab:orange")
    right.set_xlabel("training step")
    right.set_ylabel(f"active features (% of {N_FEATURES}, batch mean)")
    right.set_title(f"feature sparsity (L1 weight {L1_WEIGHT:g})")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(f"Sparse autoencoder spliced into the CNN at {HIDDEN!r}: test accuracy with it "
                 f"{spliced_accuracy:.1%} (model alone {test_accuracy:.1%})")
    fig.tight_layout()
    print("picture:", save(fig, args.out, "05_sparse_autoencoder.png"))


if __name__ == "__main__":
    main()
