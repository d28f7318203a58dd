"""SmoothGrad and GradientSHAP: tdhook_fn against captum 0.9 and a hand-written batched floor, in one process.

50 noisy copies (draws) of each of the first 32 of scikit-learn's digits (flat for the MLP,
``[1, 8, 8]`` for the CNN); the baselines of GradientSHAP are 20 other digits. The floor is
what a capable engineer writes by hand: every copy built once, by broadcasting (the noise
drawn ``[N, k, ...]`` and each sample added to its copies in one pass, in place where the
noise's memory has the input's order; for GradientSHAP the random baselines, and ``x - b``
once, for the path points ``b + a (x - b)`` and as the multiplier), one forward and one
input gradient of the target, a mean over the copies, on a copy of the model whose weights
do not require grad (made before the timing, as ours take the params as constants: a
forward that records the weights for their gradients is a few percent slower), its max
pooling of planes in the default layout on a channels-last copy, differentiated by the
plain kernel's backward (`_digits.fastest_pooling`, as ours runs it: the NCHW kernel takes
a third of the call). captum:
``NoiseTunnel(Saliency)`` with ``abs=False`` (the same maps) and ``GradientShap``, each
with every copy in one batch (their defaults).

The CNN runs twice, in the same rounds: as built (NCHW) and channels_last (the model
``.to(memory_format=torch.channels_last)`` and the inputs and baselines too), which is how
a conv net is run on the CPU: there torch's NCHW max pooling and convolution backward take
2x-5x their channels_last time (profiled on the floor: 8.9 and 17.6 ms a call, against 1.8
and 7.9 ms), so in NCHW every method, captum's included, sits on the same slow kernels.
Each layout has its own floor, captum and ours; the channels_last table also gives each
row over captum's NCHW time. With one input channel, channels_last memory is NCHW memory
(the same bytes; only the strides of the size-1 channel dim differ), so the floor's
in-place add writes its copies channels_last already; what changes is the weights'
layout, which makes every convolution and pooling run channels_last.

All run in interleaved rounds on one thread; times are CPU seconds of this one-thread
process (steadier on a shared machine, as in ``bench_metrics.py``). After the timing, the
maps are checked equal to captum's for the same draws, and the floors' to ours (they draw
the same numbers), in each layout. Run: ``python benchmarks/bench_noise.py`` (from a
worktree, with ``PYTHONPATH=<worktree>``: else the installed checkout's ``tdhook_fn`` is
timed).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import captum.attr as ca
import numpy as np
import torch
from _digits import fastest_pooling
from _timing import print_table
from _walk_floor import plain_walked, walked_gradient
from bench_metrics import cpu_medians
from sklearn.datasets import load_digits
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution._gradient_shap import gradient_shap
from tdhook_fn.attribution._smoothgrad import smoothgrad

warnings.filterwarnings("ignore")
SAMPLES, STDEV, TARGET = 50, 0.2, 3
FLOOR = "floor (hand-written batched)"
FLOOR_WALK = "floor (hand-written walk)"  # the MLP's: no autograd, as ours there (NOTE [plain gradients on a chain])
NCHW, CL = "", " cl"  # the row labels' suffix: " cl" for the channels_last model and inputs


def digits() -> torch.Tensor:
    return torch.tensor(load_digits().images[:52], dtype=torch.float32).unsqueeze(1) / 16  # [52, 1, 8, 8]


def mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    return model.eval(), digits().flatten(1)


def cnn() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1),
                          nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 10))
    return model.eval(), digits()


def floor_smoothgrad(model: nn.Module, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    model = fastest_pooling(copy.deepcopy(model).requires_grad_(False))  # NOTE [shadow max pooling]

    def run() -> torch.Tensor:
        # the noise drawn [N, k, ...] and the sample added, broadcast: no repeated copies. In the noise's memory
        # where it has the input's order (NCHW; or channels_last with one channel: the same bytes), else in one
        # pass into a new tensor in the input's order (channels_last), which the convolutions then read as it is
        noise = torch.randn(len(x), SAMPLES, *x.shape[1:]).mul_(STDEV)
        noisy = noise.add_(x.unsqueeze(1)) if x.is_contiguous() else x.unsqueeze(1) + noise
        noisy = noisy.view(-1, *x.shape[1:]).requires_grad_()
        (grad,) = torch.autograd.grad(model(noisy)[:, TARGET].sum(), noisy)
        return grad.view(len(x), SAMPLES, *x.shape[1:]).mean(1)

    return run


def floor_gradient_shap(model: nn.Module, x: torch.Tensor, refs: torch.Tensor) -> Callable[[], torch.Tensor]:
    model = fastest_pooling(copy.deepcopy(model).requires_grad_(False))  # NOTE [shadow max pooling]

    def run() -> torch.Tensor:
        n = len(x) * SAMPLES
        b = refs[torch.randint(len(refs), (n,))].view(len(x), SAMPLES, *x.shape[1:])  # (in the refs' order)
        a = torch.rand(len(x), SAMPLES, *[1] * (x.dim() - 1))
        diff = x.unsqueeze(1) - b  # x - b, broadcast over the draws: the path's direction and the multiplier
        points = torch.addcmul(b, a, diff).view(n, *x.shape[1:]).requires_grad_()  # b + a (x - b)
        (grad,) = torch.autograd.grad(model(points)[:, TARGET].sum(), points)
        return (diff.view(n, *x.shape[1:]) * grad).view(len(x), SAMPLES, *x.shape[1:]).mean(1)

    return run


def floor_smoothgrad_walk(model: nn.Sequential, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """`floor_smoothgrad`'s copies, their gradient by the hand-written walk (`_walk_floor`): no autograd."""
    model = copy.deepcopy(model).requires_grad_(False)

    def run() -> torch.Tensor:
        with torch.no_grad():
            noise = torch.randn(len(x), SAMPLES, *x.shape[1:]).mul_(STDEV)
            noisy = noise.add_(x.unsqueeze(1)) if x.is_contiguous() else x.unsqueeze(1) + noise
            grad = walked_gradient(model, noisy.view(-1, *x.shape[1:]), TARGET)
            return grad.view(len(x), SAMPLES, *x.shape[1:]).mean(1)

    return run


def floor_gradient_shap_walk(model: nn.Sequential, x: torch.Tensor, refs: torch.Tensor) -> Callable[[], torch.Tensor]:
    """`floor_gradient_shap`'s path points, their gradient by the hand-written walk (`_walk_floor`): no autograd."""
    model = copy.deepcopy(model).requires_grad_(False)

    def run() -> torch.Tensor:
        with torch.no_grad():
            n = len(x) * SAMPLES
            b = refs[torch.randint(len(refs), (n,))].view(len(x), SAMPLES, *x.shape[1:])
            a = torch.rand(len(x), SAMPLES, *[1] * (x.dim() - 1))
            diff = x.unsqueeze(1) - b
            grad = walked_gradient(model, torch.addcmul(b, a, diff).view(n, *x.shape[1:]), TARGET)
            return (diff.view(n, *x.shape[1:]) * grad).view(len(x), SAMPLES, *x.shape[1:]).mean(1)

    return run


def _check(model: nn.Module, x: torch.Tensor, refs: torch.Tensor) -> None:
    """Ours equal captum's for the same draws (seeded torch for SmoothGrad; captum's numpy draws replayed)."""
    f, p = tdhook_fn.pure(model)
    torch.manual_seed(1)
    ours = smoothgrad(f, p, x, target=TARGET, nt_samples=SAMPLES, stdevs=STDEV)
    torch.manual_seed(1)
    theirs = ca.NoiseTunnel(ca.Saliency(model)).attribute(x.clone(), nt_samples=SAMPLES, stdevs=STDEV, target=TARGET,
                                                          abs=False)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    torch.manual_seed(1)
    torch.testing.assert_close(floor_smoothgrad(model, x)(), ours, rtol=1e-5, atol=1e-7)
    if plain_walked(model):
        torch.manual_seed(1)
        torch.testing.assert_close(floor_smoothgrad_walk(model, x)(), ours, rtol=1e-5, atol=1e-7)
    torch.manual_seed(1)
    ours = gradient_shap(f, p, x, refs, target=TARGET, n_samples=SAMPLES)
    torch.manual_seed(1)
    torch.testing.assert_close(floor_gradient_shap(model, x, refs)(), ours, rtol=1e-5, atol=1e-6)
    if plain_walked(model):
        torch.manual_seed(1)
        torch.testing.assert_close(floor_gradient_shap_walk(model, x, refs)(), ours, rtol=1e-5, atol=1e-6)
    n = len(x)
    np.random.seed(2)
    torch.manual_seed(2)
    index = torch.tensor(np.random.choice(len(refs), SAMPLES * n)).view(n, SAMPLES)
    torch.randn(n * SAMPLES, *x.shape[1:])  # captum's (zero) noise
    alpha = torch.tensor(np.random.uniform(0.0, 1.0, n * SAMPLES)).view(n, SAMPLES)
    draws = TensorDict(index=index, alpha=alpha, batch_size=[n, SAMPLES])
    ours = gradient_shap(f, p, x, refs, target=TARGET, n_samples=SAMPLES, draws=draws)
    np.random.seed(2)
    torch.manual_seed(2)
    theirs = ca.GradientShap(model).attribute(x.clone(), refs, n_samples=SAMPLES, target=TARGET)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def channels_last(model: nn.Module, x: torch.Tensor,
                  refs: torch.Tensor) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A channels_last copy of the model, and the inputs and baselines as channels_last tensors."""
    cl = torch.channels_last
    return copy.deepcopy(model).to(memory_format=cl), x.to(memory_format=cl), refs.to(memory_format=cl)


def _walk_floors(rows: dict[str, Callable[[], object]], walk: Callable[[], object] | None,
                 ) -> dict[str, Callable[[], object]]:
    return rows if walk is None else {FLOOR_WALK: walk, **rows}


def _floor(times: dict[str, float], layout: str = NCHW) -> float:
    """The faster floor: autograd's, or the walk's where ours walks."""
    return min(times[FLOOR + layout], times.get(FLOOR_WALK + layout, float("inf")))


def _smoothgrad_rows(model: nn.Module, x: torch.Tensor, layout: str) -> dict[str, Callable[[], object]]:
    f, p = tdhook_fn.pure(model)
    return _walk_floors({
        f"{FLOOR}{layout}": floor_smoothgrad(model, x),
        f"captum NoiseTunnel(Saliency){layout}": lambda: ca.NoiseTunnel(ca.Saliency(model)).attribute(
            x, nt_samples=SAMPLES, stdevs=STDEV, target=TARGET, abs=False),
        f"ours smoothgrad{layout}": lambda: smoothgrad(f, p, x, target=TARGET, nt_samples=SAMPLES, stdevs=STDEV),
    }, floor_smoothgrad_walk(model, x) if plain_walked(model) else None)


def _gradient_shap_rows(model: nn.Module, x: torch.Tensor, refs: torch.Tensor,
                        layout: str) -> dict[str, Callable[[], object]]:
    f, p = tdhook_fn.pure(model)
    return _walk_floors({
        f"{FLOOR}{layout}": floor_gradient_shap(model, x, refs),
        f"captum GradientShap{layout}": lambda: ca.GradientShap(model).attribute(x, refs, n_samples=SAMPLES,
                                                                                  target=TARGET),
        f"ours gradient_shap{layout}": lambda: gradient_shap(f, p, x, refs, target=TARGET, n_samples=SAMPLES),
    }, floor_gradient_shap_walk(model, x, refs) if plain_walked(model) else None)


def _print_layouts(method: str, title: str, times: dict[str, float], captum: str, ours: str) -> None:
    """The NCHW table, the channels_last one (also over captum's NCHW time), and the ratios asked of ours."""
    nchw = [(name, t) for name, t in times.items() if not name.endswith(CL)]
    print_table(f"{method}, {title}, batch 32 x {SAMPLES} samples", nchw,
                {"floor": times[FLOOR], "captum": times[captum]})
    print_table(f"{method}, {title}, channels_last model and inputs, batch 32 x {SAMPLES} samples",
                [(n, t) for n, t in times.items() if n.endswith(CL)],
                {"cl floor": times[FLOOR + CL], "captum cl": times[captum + CL], "captum NCHW": times[captum]})
    better = "channels_last" if times[captum + CL] < times[captum] else "NCHW"
    mine = times[ours + CL]
    print(f"  ours cl / cl floor {mine / times[FLOOR + CL]:.2f}x; captum cl / ours cl "
          f"{times[captum + CL] / mine:.2f}x; captum NCHW / ours cl {times[captum] / mine:.2f}x "
          f"(captum's faster layout: {better})")


def main() -> None:
    torch.set_num_threads(1)
    model, data = mlp()
    x, refs = data[:32], data[32:]
    sg = cpu_medians(_smoothgrad_rows(model, x, NCHW), rounds=15, number=3)
    print_table(f"SmoothGrad, MLP 64-128x2-10, batch {len(x)} x {SAMPLES} samples", list(sg.items()),
                {"floor": _floor(sg), "captum": sg["captum NoiseTunnel(Saliency)"]})
    gs = cpu_medians(_gradient_shap_rows(model, x, refs, NCHW), rounds=15, number=3)
    print_table(f"GradientSHAP, MLP 64-128x2-10, batch {len(x)} x {SAMPLES} samples", list(gs.items()),
                {"floor": _floor(gs), "captum": gs["captum GradientShap"]})
    _check(model, x, refs)

    model, data = cnn()  # both layouts in the same rounds
    x, refs = data[:32], data[32:]
    cl_model, cl_x, cl_refs = channels_last(model, x, refs)
    sg = cpu_medians({**_smoothgrad_rows(model, x, NCHW), **_smoothgrad_rows(cl_model, cl_x, CL)}, rounds=15,
                     number=3)
    _print_layouts("SmoothGrad", "CNN 2 conv 8x8", sg, "captum NoiseTunnel(Saliency)", "ours smoothgrad")
    gs = cpu_medians({**_gradient_shap_rows(model, x, refs, NCHW), **_gradient_shap_rows(cl_model, cl_x, cl_refs, CL)},
                     rounds=15, number=3)
    _print_layouts("GradientSHAP", "CNN 2 conv 8x8", gs, "captum GradientShap", "ours gradient_shap")
    _check(model, x, refs)
    _check(cl_model, cl_x, cl_refs)


if __name__ == "__main__":
    main()
