"""What each layer of the digits CNN knows, and how faithful its attributions are.

One cached forward gives every layer's activations on the real digits; then pure
statistics of them, each layer (or pair of layers) at once:

- linear probes for the digit at every layer (``tdhook_fn.latent.probing.fit_probes``:
  scikit-learn's ``RidgeClassifier``, all layers of one width in one batched solve),
  trained and at initialisation;
- the intrinsic dimension of each layer's activations (``tdhook_fn.latent.dimension``:
  TwoNN and the median of local kNN estimates);
- linear CKA between every pair of layers (``tdhook_fn.latent.similarity.cka``);
- the infidelity and sensitivity of three attribution methods
  (``tdhook_fn.attribution.metrics``, captum's definitions), the perturbations of a call
  in one batched forward.

Writes ``12_latent_geometry.png``.
"""

from __future__ import annotations

import functools

import matplotlib.pyplot as plt
import torch
from _digits import load, make_cnn, setup_example, trained_cnn
from _plots import save
from tensordict import TensorDict

import tdhook_fn
from tdhook_fn.attribution import integrated_gradients, saliency
from tdhook_fn.attribution.metrics import infidelity, normal_perturbation, sensitivity_max
from tdhook_fn.latent import cache
from tdhook_fn.latent.dimension import local_knn, two_nn
from tdhook_fn.latent.probing import fit_probes, score_probes
from tdhook_fn.latent.similarity import cka

LAYERS = {"conv 1": "[1]", "conv 2": "[3]", "dense": "[6]", "logits": "[7]"}  # the ReLUs and the logits


def activations(model: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every layer's activations on ``x``, flattened to ``(N, D)``, the input first, from one forward."""
    f, params = tdhook_fn.functional(model), tdhook_fn.params(model)
    with torch.no_grad():
        acts = cache(f, params, TensorDict(input=x, batch_size=[len(x)]), list(LAYERS.values()))
    return {"input": x.flatten(1), **{name: acts[site.strip("[]")].flatten(1) for name, site in LAYERS.items()}}


def probe_accuracy(train: dict[str, torch.Tensor], test: dict[str, torch.Tensor], train_y: torch.Tensor,
                   test_y: torch.Tensor) -> list[float]:
    """Test accuracy of a ridge probe per layer: all layers fitted in one call."""
    probes = fit_probes(TensorDict(train), train_y, kind="ridge", alpha=1.0)
    scores = score_probes(probes, TensorDict(test), test_y)
    return [float(scores[name]) for name in train]


def attribution_quality(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, samples: int
                        ) -> dict[str, tuple[float, float]]:
    """Mean infidelity and sensitivity (lower is better) of three methods on ``x``, the true class as target."""
    f, params = tdhook_fn.functional(model), tdhook_fn.params(model)
    td = TensorDict(input=x, label=y, batch_size=[len(x)])
    target = tdhook_fn.label("label")
    methods = {
        "saliency": functools.partial(saliency, f, params, target=target, abs=False),
        "input x gradient": functools.partial(saliency, f, params, target=target, abs=False,
                                              multiply_by_inputs=True),
        "integrated gradients": functools.partial(integrated_gradients, f, params, target=target, baselines=0.0,
                                                  n_steps=16),
    }
    noise = functools.partial(normal_perturbation, std=0.1, keys=["input"],
                              generator=torch.Generator().manual_seed(0))
    out = {}
    for name, explain in methods.items():
        attributions = explain(td).select("input")
        unfaithful = infidelity(f, params, noise, td, attributions, target=target, n_perturb_samples=samples,
                                normalize=True)
        unstable = sensitivity_max(explain, td, n_perturb_samples=samples, perturb_radius=0.05)
        out[name] = (float(unfaithful.mean()), float(unstable.mean()))
    return out


def main() -> None:
    args = setup_example(__doc__.splitlines()[0])
    data = load()
    model, test_accuracy = trained_cnn(args, data)
    print(f"test accuracy of the CNN: {test_accuracy:.1%}")
    fresh = make_cnn(seed=1).eval()

    trained_train, trained_test = activations(model, data.train_x), activations(model, data.test_x)
    fresh_train, fresh_test = activations(fresh, data.train_x), activations(fresh, data.test_x)
    names = list(trained_train)
    accuracy = {"trained": probe_accuracy(trained_train, trained_test, data.train_y, data.test_y),
                "at initialisation": probe_accuracy(fresh_train, fresh_test, data.train_y, data.test_y)}
    for label, values in accuracy.items():
        print(f"probe accuracy ({label}): " + ", ".join(f"{n} {v:.1%}" for n, v in zip(names, values, strict=True)))

    clouds = {name: trained_test[name].double() for name in names}  # widths differ: one estimate per layer
    dimension = {"TwoNN": [float(two_nn(c)) for c in clouds.values()],
                 "local kNN, median (k = 10)": [float(local_knn(c, 10).nanmedian()) for c in clouds.values()]}
    similarity = torch.tensor([[float(cka(clouds[a], clouds[b])) for b in names] for a in names])

    x, y = (data.test_x[:64], data.test_y[:64]) if args.quick else (data.test_x[:256], data.test_y[:256])
    quality = attribution_quality(model, x, y, samples=4 if args.quick else 16)
    for name, (unfaithful, unstable) in quality.items():
        print(f"{name}: infidelity {unfaithful:.4f}, sensitivity {unstable:.3f}")

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    for label, values in accuracy.items():
        axes[0].plot(names, values, "-o" if label == "trained" else "--s", label=label)
    axes[0].set_title("ridge probe for the digit, test accuracy")
    axes[0].set_ylim(0, 1.02)
    axes[0].legend()
    for label, values in dimension.items():
        axes[1].plot(names, values, "-o", label=label)
    axes[1].set_title("intrinsic dimension of each layer (test digits)")
    axes[1].legend()
    shown = axes[2].imshow(similarity.numpy(), vmin=0, vmax=1, cmap="viridis")
    axes[2].set_xticks(range(len(names)), names, rotation=30)
    axes[2].set_yticks(range(len(names)), names)
    axes[2].set_title("linear CKA between layers")
    fig.colorbar(shown, ax=axes[2], fraction=0.046)
    methods = list(quality)
    positions = torch.arange(len(methods)).float()
    axes[3].bar(positions - 0.2, [quality[m][0] for m in methods], 0.4, label="infidelity (normalised)")
    twin = axes[3].twinx()
    twin.bar(positions + 0.2, [quality[m][1] for m in methods], 0.4, color="tab:orange", label="sensitivity (max)")
    axes[3].set_xticks(positions.tolist(), methods, rotation=15)
    axes[3].set_title("attribution quality (lower is better)")
    axes[3].set_ylabel("infidelity")
    twin.set_ylabel("sensitivity")
    axes[3].legend(loc="upper left", fontsize=8)
    twin.legend(loc="upper right", fontsize=8)
    fig.suptitle(f"Digits CNN ({test_accuracy:.0%} test accuracy): what each layer knows, and how faithful "
                 "its attributions are")
    fig.tight_layout()
    print("picture:", save(fig, args.out, "12_latent_geometry.png"))


if __name__ == "__main__":
    main()
