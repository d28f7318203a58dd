"""Attributions on digits: gradient, input x gradient, integrated gradients and Grad-CAM.

Each method is a pure function ``method(f, params, inputs, *, target)``: it works on a
batch, and per sample under ``vmap`` with the same result (up to a few ulps of rounding).
Writes ``01_attributions.png``.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import torch
from _digits import LAST_CONV, load, setup_example, trained_cnn
from _plots import save, show_digit, show_positive, show_signed
from tensordict import TensorDict

import tdhook_fn
from tdhook_fn.attribution import DimsConfig, grad_cam, integrated_gradients, saliency


def main() -> None:
    args = setup_example(__doc__.splitlines()[0])
    data = load()
    model, test_accuracy = trained_cnn(args, data)
    print(f"test accuracy: {test_accuracy:.1%}")
    f, params = tdhook_fn.functional(model), tdhook_fn.params(model)
    inputs = TensorDict(input=data.test_x[:4], y=data.test_y[:4], batch_size=[4])
    true_class = tdhook_fn.label("y")  # explain each digit's true class

    maps = {
        "gradient ∂y/∂x": saliency(f, params, inputs, target=true_class)["input"],
        "input x gradient": saliency(f, params, inputs, target=true_class, multiply_by_inputs=True)["input"],
        "integrated gradients": integrated_gradients(f, params, inputs, 0.0, target=true_class)["input"],
    }
    cams = grad_cam(f, params, inputs, target=true_class, layers={LAST_CONV: DimsConfig((1, 2), (0,))})

    # one sample at a time under vmap gives the batched maps
    per_sample = torch.func.vmap(lambda td: saliency(f, params, td, target=true_class))(inputs)["input"]
    gap = (per_sample - maps["gradient ∂y/∂x"]).abs().max()
    print(f"vmap over single digits vs one batched call: max |difference| = {gap:.1e}")

    fig, axes = plt.subplots(4, 5, figsize=(13, 9))
    for row in range(4):
        show_digit(axes[row, 0], inputs["input"][row], f"digit {int(inputs['y'][row])}")
        for col, (name, values) in enumerate(maps.items(), start=1):
            show_signed(fig, axes[row, col], values[row], name)
        show_positive(fig, axes[row, 4], cams[LAST_CONV][row].relu(), "Grad-CAM, ReLU (last conv)")
    fig.suptitle("Attributions of the true class's logit (red raises it, blue lowers it)")
    fig.tight_layout()
    print("picture:", save(fig, args.out, "01_attributions.png"))


if __name__ == "__main__":
    main()
