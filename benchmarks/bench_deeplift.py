"""DeepLift and DeepLiftShap: tdhook_fn.attribution against captum 0.9, in one process.

``/ gradient`` is the floor for an input map: one forward and one backward of the target
with respect to the input only, weights frozen (``requires_grad=False``,
``torch.autograd.grad`` of the input). DeepLift's maps (zero baseline) are one forward
of the inputs and the reference and one modified backward; per-target maps come from that
one forward (captum needs one call per target). DeepLiftShap: 4 inputs against 16
references. The hand-written floor is DeepLift's rescale rule written out in plain torch for
these chains (``floor_deeplift``): one forward of the inputs and the zero reference in one
batch without a graph, each layer's multiplier made there, and a backward of adjoints and
products. Our rows run first, then captum's, each set in rounds interleaved with the
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
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from _digits import max_pool_with_indices
from _timing import in_our_units, input_gradient, interleaved_medians, print_table
from bench_lrp import cnn, mlp
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import deeplift, deeplift_shap

warnings.filterwarnings("ignore")
TARGETS = tuple(range(10))
GRADIENT = "input gradient (weights frozen)"
FLOOR = "hand-written DeepLift, one target"


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


Back = Callable[[torch.Tensor], torch.Tensor]


def _rescaled(dx: torch.Tensor, ratio: torch.Tensor, plain: Callable[[], torch.Tensor], eps: float) -> torch.Tensor:
    """``dy / dx``, the plain gradient where ``|dx| < eps`` (built only where some ``|dx|`` is)."""
    small = dx.abs()
    return ratio if small.amin().item() >= eps else torch.where(small < eps, plain(), ratio)


def _conv_adjoint(c: nn.Conv2d) -> Back:
    """``J^T``: the transposed convolution (with torch 2.13 on the CPU 1.1-1.4x faster on these models than the
    convolution with the kernel flipped, even with that kernel made once)."""
    return lambda g: F.conv_transpose2d(g, c.weight, None, c.stride, c.padding, 0, c.groups, c.dilation)


def _floor_max_pool(layer: nn.MaxPool2d, h: torch.Tensor, n: int, eps: float) -> tuple[torch.Tensor, Back]:
    y, idx = max_pool_with_indices(layer, h)  # (on a channels-last copy where that is the faster)
    top = torch.maximum(y[:n], y[n:])
    up, down, dx, shape = top - y[n:], y[:n] - top, h[:n] - h[n:], h[:n].shape
    at_x, at_ref = idx[:n].flatten(2), idx[n:].expand(n, -1, -1, -1).flatten(2)
    return y, max_pool_back(shape, at_x, at_ref, up, down, dx, eps)


def max_pool_back(shape: tuple[int, ...], at_x: torch.Tensor, at_ref: torch.Tensor, up: torch.Tensor,
                  down: torch.Tensor, dx: torch.Tensor, eps: float) -> Back:
    """Max pooling's DeepLift backward: the multipliers sent to the input's and the reference's maxima
    (``at_x``, ``at_ref``: flat indices), weighted by how far each moved (``up``, ``down``), rescaled by ``dx``."""
    def back(g: torch.Tensor) -> torch.Tensor:
        moved = g.new_zeros(shape).flatten(2)
        moved.scatter_add_(2, at_x, (g * up).flatten(2)).scatter_add_(2, at_ref, (g * down).flatten(2))
        return _rescaled(dx, moved.view(shape) / dx,
                         lambda: g.new_zeros(shape).flatten(2).scatter_add_(2, at_x, g.flatten(2)).view(shape), eps)

    return back


def affine_step(layer: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, Back] | None:
    """A linear layer's or a convolution's forward on ``h`` and its adjoint (the multipliers pass through), or None."""
    if isinstance(layer, nn.Linear):
        w = layer.weight
        return F.linear(h, w, layer.bias), lambda g: g @ w
    if isinstance(layer, nn.Conv2d):
        return layer(h), _conv_adjoint(layer)
    return None


def _floor_step(layer: nn.Module, h: torch.Tensor, n: int, eps: float) -> tuple[torch.Tensor, Back]:
    """One layer's forward on the stacked rows (``n`` inputs, then the reference) and its DeepLift backward."""
    shape = h[:n].shape
    affine = affine_step(layer, h)
    if affine is not None:
        return affine
    if isinstance(layer, nn.ReLU):
        y = torch.relu(h)
        dx = h[:n] - h[n:]
        m = _rescaled(dx, (y[:n] - y[n:]) / dx, lambda: (y[:n] > 0).to(y.dtype), eps)
        return y, lambda g: g * m
    if isinstance(layer, nn.MaxPool2d):
        return _floor_max_pool(layer, h, n, eps)
    if isinstance(layer, nn.Flatten):
        return h.flatten(1), lambda g: g.reshape(shape)
    raise TypeError(f"floor_deeplift: no rule for {type(layer).__name__}")


def floor_deeplift(model: nn.Sequential, x: torch.Tensor, target: int, eps: float = 1e-10) -> torch.Tensor:
    """DeepLift (rescale rule, zero reference, one target, times the input change) of a chain of linear layers,
    2-d convolutions, ReLUs, 2-d max pooling and flattens, written out in plain torch (captum's numbers)."""
    with torch.no_grad():
        h = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])  # the inputs' rows, then the one reference row
        return walk_to_target(model, h, len(x), target, eps) * x


def walk_to_target(layers: Iterable[nn.Module], h: torch.Tensor, n: int, target: int, eps: float) -> torch.Tensor:
    """The multipliers at ``h`` (``n`` rows, then the reference row) of the ``target`` output of ``layers``."""
    backs = []
    for layer in layers:
        h, back = _floor_step(layer, h, n, eps)
        backs.append(back)
    g = h.new_zeros((n, h.shape[1]))
    g[:, target] = 1.0
    for back in reversed(backs):
        g = back(g)
    return g


def _refs(x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(16, *x.shape[1:])


def _time_ours(model: nn.Module, x: torch.Tensor) -> dict[str, float]:
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    td = TensorDict(input=x, batch_size=x.shape[:1])
    few, refs = td[:4], _refs(x)
    frozen = copy.deepcopy(model).requires_grad_(False)
    torch.testing.assert_close(floor_deeplift(frozen, x, TARGETS[0]), deeplift(f, p, x, target=TARGETS[0]),
                               rtol=1e-4, atol=1e-6)  # the same maps
    return interleaved_medians({
        GRADIENT: input_gradient(model, x, TARGETS[0]),
        FLOOR: lambda: floor_deeplift(frozen, x, TARGETS[0]),
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
                    {"gradient": times[GRADIENT], "floor": times[FLOOR], "captum": times["captum, one target"]})


if __name__ == "__main__":
    main()
