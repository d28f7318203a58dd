"""Layer conductance, neuron conductance and internal influence: tdhook_fn against a hand-written floor and captum 0.9.

tdhook 0.1.3 has none of the three. 50 steps, captum's default methods, a zero baseline,
batch 64. The floor splits the model at the layer by hand (``model[:k]``, ``model[k:]``:
what a capable engineer writes for a ``Sequential``), runs all path points in one
batched forward, takes the gradient at the layer by plain autograd and, for neuron
conductance, pulls the neuron's weighted gradient back to the inputs: no TensorDicts,
no taps, no checks, on a copy of the model whose weights do not require grad (made before
the timing; ours take the params as constants too). Per-target maps pull one one-hot each
back through the same graph. Times are CPU seconds of this one-thread process in
interleaved rounds (steadier on a shared machine than wall time, as in ``bench_noise.py``).
Run from a worktree with ``PYTHONPATH=<worktree>`` (else the installed ``tdhook_fn`` is timed).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import torch
from _timing import cpu_medians, print_table
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import quadrature
from tdhook_fn.attribution._internal_influence import internal_influence
from tdhook_fn.attribution._layer_conductance import layer_conductance
from tdhook_fn.attribution._neuron_conductance import neuron_conductance

warnings.filterwarnings("ignore")
N_STEPS = 50


def mlp() -> tuple[nn.Sequential, torch.Tensor, int]:
    torch.manual_seed(0)
    widths = [128, 256, 256, 256, 256, 10]
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1]).eval(), torch.randn(64, 128), 3  # layer [3]: the second ReLU


def cnn() -> tuple[nn.Sequential, torch.Tensor, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                          nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    return model.eval(), torch.randn(64, 1, 8, 8), 1  # layer [1]: the first conv's ReLU


def _points(x: torch.Tensor, alphas: tuple[float, ...]) -> torch.Tensor:
    a = torch.tensor(alphas, dtype=x.dtype).reshape(-1, *[1] * x.dim())
    return (a * x).reshape(-1, *x.shape[1:])  # zero baseline


def _split(model: nn.Sequential, k: int) -> tuple[nn.Module, nn.Module]:
    return model[: k + 1], model[k + 1 :]


def _one_hots(out: torch.Tensor, targets: list[int]) -> torch.Tensor:
    cot = torch.zeros(len(targets), *out.shape)
    for i, t in enumerate(targets):
        cot[i, :, t] = 1
    return cot


def floor_layer_conductance(model: nn.Sequential, k: int, x: torch.Tensor, targets: list[int]) -> torch.Tensor:
    alphas, _ = quadrature("gausslegendre", N_STEPS + 1)
    head, tail = _split(model, k)
    with torch.no_grad():
        acts = head(_points(x, alphas))
    acts.requires_grad_()
    out = tail(acts)
    n = len(x)
    diffs = (acts[n:] - acts[:-n]).detach()
    maps = []
    for cot in _one_hots(out, targets):
        (g,) = torch.autograd.grad(out, acts, cot, retain_graph=True)
        maps.append((g[:-n] * diffs).reshape(N_STEPS, n, *acts.shape[1:]).sum(0))
    return torch.stack(maps) if len(targets) > 1 else maps[0]


def floor_internal_influence(model: nn.Sequential, k: int, x: torch.Tensor, targets: list[int]) -> torch.Tensor:
    alphas, steps = quadrature("gausslegendre", N_STEPS)
    head, tail = _split(model, k)
    with torch.no_grad():
        acts = head(_points(x, alphas))
    acts.requires_grad_()
    out = tail(acts)
    (g,) = torch.autograd.grad(out, acts, _one_hots(out, targets)[0])
    w = torch.tensor(steps).reshape(-1, *[1] * acts.dim())
    return (g.reshape(N_STEPS, len(x), *acts.shape[1:]) * w).sum(0)


def floor_neuron_conductance(model: nn.Sequential, k: int, x: torch.Tensor, targets: list[int],
                             neuron: tuple[int, ...]) -> torch.Tensor:
    alphas, steps = quadrature("riemann_trapezoid", N_STEPS)
    head, tail = _split(model, k)
    points = _points(x, alphas).requires_grad_()
    acts = head(points)
    held = acts.detach().requires_grad_()
    out = tail(held)
    (g,) = torch.autograd.grad(out, held, _one_hots(out, targets)[0])
    index = (slice(None), *neuron)
    cot = torch.zeros_like(acts)
    cot[index] = g[index]
    (gi,) = torch.autograd.grad(acts, points, cot)
    w = torch.tensor(steps).reshape(-1, *[1] * x.dim())
    return (gi.reshape(N_STEPS, *x.shape) * w).sum(0) * x


def _ours(model: nn.Module) -> tuple[tdhook_fn.Functional, TensorDict]:
    return tdhook_fn.functional(model), tdhook_fn.params(model)


def _compare(name: str, model: nn.Sequential, x: torch.Tensor, k: int) -> None:
    import captum.attr as ca

    f, params = _ours(model)
    frozen = copy.deepcopy(model).requires_grad_(False)
    td = TensorDict(input=x, batch_size=x.shape[:1])
    path = f"[{k}]"
    neuron = (5,) if x.dim() == 2 else (3, 4, 4)
    cases: dict[str, dict[str, Callable[[], torch.Tensor]]] = {
        "layer conductance, 1 target": {
            "hand-written floor": lambda: floor_layer_conductance(frozen, k, x, [3]),
            "tdhook_fn.layer_conductance": lambda: layer_conductance(
                f, params, td, target=3, layers=[path], n_steps=N_STEPS)[path],
            "captum 0.9": lambda: ca.LayerConductance(model, model[k]).attribute(x, target=3, n_steps=N_STEPS),
        },
        "layer conductance, 10 per-target maps": {
            "hand-written floor": lambda: floor_layer_conductance(frozen, k, x, list(range(10))),
            "tdhook_fn.layer_conductance": lambda: layer_conductance(
                f, params, td, target=tuple(range(10)), per_target=True, layers=[path], n_steps=N_STEPS)[path],
            "captum 0.9 (loop)": lambda: torch.stack([ca.LayerConductance(model, model[k]).attribute(
                x, target=t, n_steps=N_STEPS) for t in range(10)]),
        },
        "internal influence, 1 target": {
            "hand-written floor": lambda: floor_internal_influence(frozen, k, x, [3]),
            "tdhook_fn.internal_influence": lambda: internal_influence(
                f, params, td, target=3, layers=[path], n_steps=N_STEPS)[path],
            "captum 0.9": lambda: ca.InternalInfluence(model, model[k]).attribute(x, target=3, n_steps=N_STEPS),
        },
        "neuron conductance, 1 target": {
            "hand-written floor": lambda: floor_neuron_conductance(frozen, k, x, [3], neuron),
            "tdhook_fn.neuron_conductance": lambda: neuron_conductance(
                f, params, td, target=3, layer=path, neuron_selector=neuron, n_steps=N_STEPS)["input"],
            "captum 0.9": lambda: ca.NeuronConductance(model, model[k]).attribute(
                x, neuron, target=3, n_steps=N_STEPS),
        },
    }
    for label, impls in cases.items():
        reference = impls["hand-written floor"]()
        for impl_name, fn in impls.items():
            torch.testing.assert_close(fn(), reference, rtol=1e-4, atol=1e-5, msg=f"{impl_name} disagrees")
        times = cpu_medians(impls, rounds=15)
        ours = next(n for n in times if n.startswith("tdhook_fn"))
        baselines = {"floor": times["hand-written floor"], "ours": times[ours]}
        print_table(f"{label}, {name}, batch {x.shape[0]}, {N_STEPS} steps", list(times.items()), baselines)


def main() -> None:
    torch.set_num_threads(1)
    _compare("MLP 128-256x4-10", *mlp())
    _compare("CNN 2 conv 8x8", *cnn())


if __name__ == "__main__":
    main()
