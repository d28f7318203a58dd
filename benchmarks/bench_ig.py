"""Integrated gradients: tdhook_fn against a hand-written VJP floor, captum 0.9 and tdhook 0.1.3.

Gauss-Legendre, 50 steps. The floor builds the path points itself and calls
``torch.func.vjp`` once (``vmap`` of the pullback for per-target maps): no TensorDicts,
no shadows, no checks. On the MLP, a chain ours walks without autograd, a second floor
does the same by hand (`_walk_floor`); ``/ floor`` divides by the faster. Peak memory
of ``n_steps=256`` with and without ``chunk_size=32`` is measured in fresh subprocesses.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from _timing import interleaved_medians, print_table
from _walk_floor import own_relu_back, plain_walked, walked_forward
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import integrated_gradients, quadrature

warnings.filterwarnings("ignore")
N_STEPS = 50
WALK_FLOOR = "hand-written walk floor"  # the MLP's (a chain ours walks): no autograd


def mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    widths = [128, 256, 256, 256, 256, 10]
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1]).eval(), torch.randn(64, 128)


def cnn() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                          nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    return model.eval(), torch.randn(64, 1, 8, 8)


def floor(model: nn.Module, weights: dict[str, torch.Tensor], x: torch.Tensor, targets: list[int],
          per_target: bool) -> torch.Tensor:
    """Hand-written IG: one batched forward of all path points, one VJP per target.

    ``weights`` are the model's detached parameters (constants, as in ours), prepared once
    outside the timing, as a hand-written loop would. Per-target maps pull each one-hot
    back in turn: on the CPU that beats ``vmap`` of the pullback (twice as fast for
    convolutions, equal for MLPs).
    """
    alphas, steps = quadrature("gausslegendre", N_STEPS)
    a = torch.tensor(alphas).reshape(-1, *[1] * x.dim())
    points = (a * x).reshape(-1, *x.shape[1:])  # zero baseline
    out, pullback = torch.func.vjp(lambda p: torch.func.functional_call(model, weights, (p,)), points)
    w = torch.tensor(steps).reshape(-1, *[1] * x.dim())
    if per_target:
        cot = torch.zeros(len(targets), *out.shape)
        for i, t in enumerate(targets):
            cot[i, :, t] = 1
        g = torch.stack([pullback(c)[0] for c in cot])
        return (g.reshape(len(targets), N_STEPS, *x.shape) * w).sum(1) * x
    cot = torch.zeros_like(out)
    cot[:, targets] = 1
    (g,) = pullback(cot)
    return (g.reshape(N_STEPS, *x.shape) * w).sum(0) * x


def floor_walk(model: nn.Sequential, x: torch.Tensor, targets: list[int], per_target: bool) -> torch.Tensor:
    """Hand-written IG without autograd (`_walk_floor`), where ours walks too (NOTE [plain gradients on a chain]):
    one forward of all path points without a graph, then each target's seed (the last weight's row; summed
    targets, the sum of their rows) pulled back by hand. Call it on a frozen model."""
    alphas, steps = quadrature("gausslegendre", N_STEPS)
    a = torch.tensor(alphas).reshape(-1, *[1] * x.dim())
    w = torch.tensor(steps).reshape(-1, *[1] * x.dim())
    with torch.no_grad():
        points = (a * x).reshape(-1, *x.shape[1:])  # zero baseline
        _, backs, _ = walked_forward(model, points, own_relu_back, 0)
        weight = model[-1].weight
        seeds = [weight[t] for t in targets] if per_target else [weight[targets].sum(0)]
        maps = []
        for seed in seeds:
            g = seed.expand(len(points), -1)
            for back in reversed(backs):
                g = back(g)
            maps.append((g.reshape(N_STEPS, *x.shape) * w).sum(0) * x)
    return torch.stack(maps) if per_target else maps[0]


def captum_loop(model: nn.Module, x: torch.Tensor, targets: list[int], per_target: bool) -> torch.Tensor:
    from captum.attr import IntegratedGradients

    if per_target:
        ig = IntegratedGradients(model)
        return torch.stack([ig.attribute(x, target=t, n_steps=N_STEPS) for t in targets])
    summed = IntegratedGradients(lambda inp: model(inp)[:, targets].sum(-1))
    return summed.attribute(x, n_steps=N_STEPS)


def tdhook_ig(
    model: nn.Module, x: torch.Tensor, targets: list[int], per_target: bool, compat: bool = False
) -> torch.Tensor:
    """tdhook's IntegratedGradients context (or ours, with compat): a loop for per-target maps."""
    if compat:
        from tdhook_fn.compat.attribution import IntegratedGradients
    else:
        from tdhook.attribution import IntegratedGradients

    def run(ts: list[int]) -> torch.Tensor:
        pick = lambda out, _: TensorDict(out=out["output"][..., ts].sum(-1), batch_size=out.batch_size)
        factory = IntegratedGradients(init_attr_targets=pick, n_steps=N_STEPS, multiply_by_inputs=True)
        td = TensorDict(input=x, baseline=TensorDict(input=torch.zeros_like(x), batch_size=x.shape[:1]),
                        batch_size=x.shape[:1])
        with factory.prepare(model) as hooked:
            return hooked(td)["attr", "input"]

    return torch.stack([run([t]) for t in targets]) if per_target else run(targets)


def ours(model: nn.Module, x: torch.Tensor, targets: list[int], per_target: bool) -> torch.Tensor:
    f, params = tdhook_fn.functional(model), tdhook_fn.params(model)
    td = TensorDict(input=x, batch_size=x.shape[:1])
    target = tuple(targets) if len(targets) > 1 else targets[0]
    attrs = integrated_gradients(f, params, td, 0.0, target=target, n_steps=N_STEPS, per_target=per_target)
    return attrs["input"]  # type: ignore[index]


def _compare(name: str, model: nn.Module, x: torch.Tensor) -> None:
    cases = [("1 target", [3], False), ("2 targets summed", [3, 7], False),
             ("10 per-target maps", list(range(10)), True)]
    weights = {name: t.detach() for name, t in model.named_parameters()}
    frozen = copy.deepcopy(model).requires_grad_(False)
    walks = plain_walked(model)
    for label, targets, per_target in cases:
        impls: dict[str, Callable[[], torch.Tensor]] = {
            "hand-written vjp floor": lambda: floor(model, weights, x, targets, per_target),
            **({WALK_FLOOR: lambda: floor_walk(frozen, x, targets, per_target)} if walks else {}),
            "tdhook_fn.integrated_gradients": lambda: ours(model, x, targets, per_target),
            "captum 0.9" + (" (loop)" if per_target else ""): lambda: captum_loop(model, x, targets, per_target),
            "tdhook_fn.compat" + (" (loop)" if per_target else ""): lambda: tdhook_ig(
                model, x, targets, per_target, compat=True),
            "tdhook 0.1.3" + (" (loop)" if per_target else ""): lambda: tdhook_ig(model, x, targets, per_target),
        }
        reference = impls["hand-written vjp floor"]()
        for impl_name, fn in impls.items():
            torch.testing.assert_close(fn(), reference, rtol=1e-4, atol=1e-5, msg=f"{impl_name} disagrees")
        times = interleaved_medians(impls)
        baselines = {"floor": min(times["hand-written vjp floor"], times.get(WALK_FLOOR, float("inf"))),
                     "ours": times["tdhook_fn.integrated_gradients"]}
        print_table(f"integrated gradients, {name}, batch {x.shape[0]}, {label}", list(times.items()), baselines)


_MEMORY_SCRIPT = """
import sys, torch
sys.path.insert(0, {here!r})
from _timing import peak_rss_growth_mib
from bench_ig import mlp
import tdhook_fn
from tensordict import TensorDict
from tdhook_fn.attribution import integrated_gradients
model, x = mlp()
f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
td = TensorDict(input=x, batch_size=[64])
integrated_gradients(f, p, td[:2], 0.0, target=3, n_steps=8)  # warm up
print(peak_rss_growth_mib(lambda: integrated_gradients(f, p, td, 0.0, target=3, n_steps=256, chunk_size={chunk})))
"""


def peak_memory(chunk: int | None) -> float:
    """Peak RSS growth in MiB of one IG call with 256 steps, in a fresh process."""
    script = _MEMORY_SCRIPT.format(here=str(Path(__file__).resolve().parent), chunk=chunk)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    torch.set_num_threads(1)
    _compare("MLP 128-256x4-10", *mlp())
    _compare("CNN 2 conv 8x8", *cnn())
    full, chunked = peak_memory(None), peak_memory(32)
    print("\nintegrated gradients peak memory, MLP, batch 64, n_steps=256 (peak RSS growth)")
    print(f"  chunk_size=None   {full:8.1f} MiB")
    print(f"  chunk_size=32     {chunked:8.1f} MiB   ({full / max(chunked, 1e-9):.1f}x less)")


if __name__ == "__main__":
    main()
