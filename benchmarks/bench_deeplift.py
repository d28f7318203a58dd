"""DeepLift and DeepLiftShap: tdhook_fn.attribution against captum 0.9, in one process.

``/ gradient`` is the floor for an input map: one forward and one backward of the target
with respect to the input only, weights frozen (``requires_grad=False``,
``torch.autograd.grad`` of the input). DeepLift's maps (zero baseline) are one forward
of the inputs and the reference and one modified backward; per-target maps come from that
one forward (captum needs one call per target). DeepLiftShap: 4 inputs against 16
references. Our rows run first, then captum's, each set in rounds interleaved with the
gradient, captum's put in the units of our rounds' gradient (as in ``bench_lrp.py``).
Both give the same maps (checked after the timing, on the models where captum 0.9 is
right: a copy between adjacent nonlinearities, see the DeepLift page). Times are the CPU
time of the one thread that runs everything (``time.thread_time``, as in ``bench_lrp.py``). Run:
``python benchmarks/bench_deeplift.py``.
"""

from __future__ import annotations

import copy
import time
import warnings

import torch
from _timing import in_our_units, input_gradient, interleaved_medians, print_table
from bench_lrp import cnn, mlp
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import deeplift, deeplift_shap

warnings.filterwarnings("ignore")
TARGETS = tuple(range(10))
GRADIENT = "input gradient (weights frozen)"


class _Copy(nn.Module):
    """Between two nonlinearities in a row, so that captum 0.9 hooks them right (captum #1104)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


def _captum_safe(model: nn.Module) -> nn.Module:
    layers = list(model)
    out: list[nn.Module] = []
    for module in layers:
        if out and isinstance(out[-1], (nn.ReLU, nn.MaxPool2d)) and isinstance(module, (nn.ReLU, nn.MaxPool2d)):
            out.append(_Copy())
        out.append(module)
    return nn.Sequential(*out).eval()


def _refs(x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(16, *x.shape[1:])


def _time_ours(model: nn.Module, x: torch.Tensor) -> dict[str, float]:
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    td = TensorDict(input=x, batch_size=x.shape[:1])
    few, refs = td[:4], _refs(x)
    return interleaved_medians({
        GRADIENT: input_gradient(model, x, TARGETS[0]),
        "ours, one target": lambda: deeplift(f, p, td, target=TARGETS[0]),
        f"ours, per_target x{len(TARGETS)}": lambda: deeplift(f, p, td, target=TARGETS, per_target=True),
        "ours, DeepLiftShap 4x16": lambda: deeplift_shap(f, p, few, refs, target=TARGETS[0]),
    }, rounds=15, number=8, clock=time.thread_time)


def _time_captum(model: nn.Module, x: torch.Tensor) -> dict[str, float]:
    from captum.attr import DeepLift, DeepLiftShap

    theirs = _captum_safe(copy.deepcopy(model))
    refs = _refs(x)
    times = interleaved_medians({
        GRADIENT: input_gradient(model, x, TARGETS[0]),
        "captum, one target": lambda: DeepLift(theirs).attribute(x, target=TARGETS[0]),
        f"captum, loop x{len(TARGETS)}": lambda: [DeepLift(theirs).attribute(x, target=t) for t in TARGETS],
        "captum, DeepLiftShap 4x16": lambda: DeepLiftShap(theirs).attribute(x[:4], refs, target=TARGETS[0]),
    }, rounds=15, number=8, clock=time.thread_time)
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    for t in (TARGETS[0], TARGETS[-1]):  # the same maps
        ours = deeplift(f, p, x, target=t)
        torch.testing.assert_close(ours, DeepLift(theirs).attribute(x, target=t).detach(), rtol=1e-4, atol=1e-6)
    shap = deeplift_shap(f, p, x[:4], refs, target=0)
    torch.testing.assert_close(shap, DeepLiftShap(theirs).attribute(x[:4], refs, target=0).detach(), rtol=1e-4,
                               atol=1e-6)
    return times


def main() -> None:
    torch.set_num_threads(1)
    models = {"MLP 128-256x2-10": mlp(), "CNN 2 conv 8x8 (max pool)": cnn()}
    mine = {title: _time_ours(*args) for title, args in models.items()}  # ours first: see bench_lrp.py
    theirs = {title: _time_captum(*args) for title, args in models.items()}
    for title, (_, x) in models.items():
        times = in_our_units(mine[title], theirs[title], GRADIENT)
        print_table(f"DeepLift, {title}, batch {len(x)}", list(times.items()),
                    {"gradient": times[GRADIENT], "captum": times["captum, one target"]})


if __name__ == "__main__":
    main()
