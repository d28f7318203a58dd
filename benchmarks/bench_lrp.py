"""LRP (EpsilonPlus): tdhook_fn.attribution.lrp against tdhook 0.1.3's LRP, in one process.

Per-target maps: ours from one forward and one pullback per target; tdhook's by one call
per target (it has no per-target mode). ``/ gradient`` is one plain forward and backward
of the target with respect to the input (autograd, no LRP). Run:
``python benchmarks/bench_lrp.py``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import torch
from _timing import interleaved_medians, print_table
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import EpsilonPlus, lrp

warnings.filterwarnings("ignore")
TARGETS = list(range(10))


def mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    widths = [128, 256, 256, 10]
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1]).eval(), torch.randn(64, 128)


def cnn() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1),
                          nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 10))
    return model.eval(), torch.randn(64, 1, 8, 8)


def tdhook_lrp(model: nn.Module, x: torch.Tensor, target: int) -> torch.Tensor:
    from tdhook.attribution import LRP
    from tdhook.attribution.lrp_helpers.rules import EpsilonPlus as RefEpsilonPlus

    factory = LRP(rule_mapper=RefEpsilonPlus(), warn_on_missing_rule=False,
                  init_attr_targets=lambda t, e: TensorDict(o=t["output"][..., target], batch_size=t.batch_size))
    with factory.prepare(model, in_keys=["input"], out_keys=["output"]) as hooked:
        return hooked(TensorDict(input=x, batch_size=x.shape[:1]))["attr", "input"]  # type: ignore[no-any-return]


def _compare(title: str, model: nn.Module, x: torch.Tensor) -> None:
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    td = TensorDict(input=x, batch_size=x.shape[:1])
    theirs_model = copy.deepcopy(model)

    def gradient() -> torch.Tensor:
        inputs = x.clone().requires_grad_()
        model(inputs)[..., TARGETS[0]].sum().backward()
        return inputs.grad  # type: ignore[return-value]

    ours = lrp(f, p, td, target=TARGETS[0], rules=EpsilonPlus(), warn_on_missing_rule=False)["input"]
    torch.testing.assert_close(ours, tdhook_lrp(theirs_model, x, TARGETS[0]), rtol=1e-4, atol=1e-6)
    impls: dict[str, Callable[[], object]] = {
        "plain gradient (forward + backward)": gradient,
        "ours, one target": lambda: lrp(f, p, td, target=TARGETS[0], rules=EpsilonPlus(), warn_on_missing_rule=False),
        "tdhook, one target": lambda: tdhook_lrp(theirs_model, x, TARGETS[0]),
        f"ours, per_target x{len(TARGETS)}": lambda: lrp(f, p, td, target=tuple(TARGETS), rules=EpsilonPlus(),
                                                         per_target=True, warn_on_missing_rule=False),
        f"tdhook, loop x{len(TARGETS)}": lambda: [tdhook_lrp(theirs_model, x, t) for t in TARGETS],
    }
    times = interleaved_medians(impls)
    rows = list(times.items())
    print_table(f"LRP EpsilonPlus, {title}, batch {len(x)}", rows,
                {"gradient": times["plain gradient (forward + backward)"], "tdhook": times["tdhook, one target"]})


def main() -> None:
    torch.set_num_threads(1)
    _compare("MLP 128-256x2-10", *mlp())
    _compare("CNN 2 conv 8x8", *cnn())


if __name__ == "__main__":
    main()
