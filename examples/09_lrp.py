"""Layer-wise relevance propagation on digits: EpsilonPlus, alpha-beta and input x gradient.

``lrp(f, params, inputs, *, target, rules)`` runs each module's rule as its VJP on one
pure forward: a map per target with ``per_target=True``, the same per sample under
``vmap``. With LRP-0 on a bias-free ReLU network the relevance is conserved: it sums to
the 1 put in at the target. tdhook's ``LRP`` class (``tdhook_fn.compat``) gives the same
numbers. Writes ``09_lrp.png``.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import torch
from _digits import load, setup_example, trained_cnn
from _plots import save, show_digit, show_signed
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import AlphaBeta, Epsilon, EpsilonPlus, Pass, lrp, saliency
from tdhook_fn.compat.attribution import LRP
from tdhook_fn.compat.attribution.lrp_helpers import rules as tdhook_rules

CLASSES = (3, 5, 8, 9)  # a 3, explained as itself and as the digits that look most like it


def main() -> None:
    args = setup_example(__doc__.splitlines()[0])
    data = load()
    model, test_accuracy = trained_cnn(args, data)
    print(f"test accuracy: {test_accuracy:.1%}")
    f, params = tdhook_fn.functional(model), tdhook_fn.params(model)
    right = tdhook_fn.call(model, params, data.test_x).argmax(-1) == data.test_y
    first = int(torch.nonzero((data.test_y == CLASSES[0]) & right)[0, 0])  # a 3 the model gets right
    digit = TensorDict(input=data.test_x[first : first + 1], batch_size=[1])
    print(f"a test digit {CLASSES[0]} (index {first}), explained for classes {CLASSES}")

    # z+ on the convolutions and epsilon on the dense layers; alpha=2, beta=1 on the convolutions instead
    alpha_beta = EpsilonPlus(rule_mapper=lambda name, m: AlphaBeta(2.0, 1.0) if isinstance(m, nn.Conv2d) else None)
    # lrp puts relevance 1 in at each target (as tdhook); textbook LRP puts in the logit f_c(x): scale by it
    logits = tdhook_fn.call(model, params, digit["input"])[0, list(CLASSES)].view(-1, 1, 1, 1, 1)
    maps = {
        "input x gradient": saliency(f, params, digit, target=CLASSES, per_target=True,
                                     multiply_by_inputs=True)["input"],
        "LRP EpsilonPlus": logits * lrp(f, params, digit, target=CLASSES, per_target=True,
                                        rules=EpsilonPlus())["input"],
        "LRP alpha2-beta1": logits * lrp(f, params, digit, target=CLASSES, per_target=True, rules=alpha_beta)["input"],
    }
    print(f"{'logits':>17}: {[round(float(v), 2) for v in logits.flatten()]}")
    for name, values in maps.items():
        print(f"{name:>17}: relevance sums per class {[round(float(s), 2) for s in values.flatten(1).sum(-1)]}")

    per_sample = torch.func.vmap(lambda td: lrp(f, params, td, target=CLASSES, per_target=True,
                                                rules=EpsilonPlus()))(digit)["input"].transpose(0, 1)
    print(f"vmap over the digit vs the batched call: max |difference| = "
          f"{(logits * per_sample - maps['LRP EpsilonPlus']).abs().max():.1e}")

    # conservation: LRP-0 (epsilon -> 0) on a bias-free copy of the model holds exactly 1 per class
    bias_free = params.clone()
    for key in [k for k in bias_free.keys(True, True) if k[-1] == "bias"]:
        bias_free[key] = torch.zeros_like(bias_free[key])
    lrp0 = {nn.Conv2d: Epsilon(1e-9), nn.Linear: Epsilon(1e-9), nn.ReLU: Pass()}
    kept = lrp(f, bias_free, digit, target=CLASSES, per_target=True, rules=lrp0,
               warn_on_missing_rule=False, check_conservation=True)["input"]
    print(f"LRP-0 without biases: relevance sums per class {[round(float(s), 4) for s in kept.flatten(1).sum(-1)]}")

    # tdhook's API (tdhook_fn.compat): the same numbers, the rule mapper sees tdhook's names ("module.0")
    own_class = lambda targets, _: TensorDict(o=targets["output"][..., CLASSES[0]], batch_size=targets.batch_size)
    factory = LRP(rule_mapper=tdhook_rules.EpsilonPlus(), skip_modules=LRP.default_skip, init_attr_targets=own_class)
    with factory.prepare(model) as hooked:
        relevance = hooked(digit.clone())["attr", "input"]
    print(f"compat LRP vs lrp, class {CLASSES[0]}: max |difference| = "
          f"{(logits[0] * relevance - maps['LRP EpsilonPlus'][0]).abs().max():.1e}")

    fig, axes = plt.subplots(len(maps), len(CLASSES) + 1, figsize=(2.6 * (len(CLASSES) + 1), 2.5 * len(maps)))
    for row, (name, values) in enumerate(maps.items()):
        show_digit(axes[row, 0], digit["input"][0], f"digit {CLASSES[0]}")
        for col, c in enumerate(CLASSES, start=1):
            show_signed(fig, axes[row, col], values[col - 1, 0], f"{name}\nclass {c}")
    fig.suptitle("Relevance of each pixel for four classes, in logit units (red for the class, blue against it)")
    fig.tight_layout()
    print("picture:", save(fig, args.out, "09_lrp.png"))


if __name__ == "__main__":
    main()
