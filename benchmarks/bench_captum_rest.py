"""The rest of captum's methods against their hand-written floors: deconvolution, guided Grad-CAM, feature
permutation, layer DeepLift and DeepLiftShap, tdhook_fn.attribution against captum 0.9.0, in one process.

The models of ``bench_lrp.py`` (an MLP 128-256x2-10 and a CNN of two 3x3 convs on 8x8 inputs with a max pool),
64 random inputs, target class 0 (feature permutation: each input's predicted class). Ours runs at its
default settings, captum's class at its default and, where it has a batching knob
(``perturbations_per_eval``), at settings that batch; "captum best" is the fastest. The floor is the
plain torch a capable engineer writes for the same numbers, everything it needs built before the timing:

- deconvolution: one forward of a frozen copy whose ReLUs are a small ``autograd.Function`` (``relu``
  forward, ``relu`` of the arriving gradient backward), one input gradient; and the same numbers without
  autograd, a walk of the chain by hand (forward without a graph, the adjoints back from the last linear
  layer's target row, ``relu`` of the gradient at each ReLU); the faster is the floor;
- guided Grad-CAM (the CNN, at its second conv): one forward of a frozen copy whose ReLUs' backward is
  switched by a flag, one plain gradient back to the layer (kept for the second), one guided gradient
  to the input; the layer's channels weighted by their mean gradient, summed, ReLU'd, upsampled
  (nearest) and multiplied in; and the same without autograd, the walk by hand pulled back twice;
- feature permutation (every element its own feature): the permutations drawn as captum draws them,
  every permuted copy of the batch built once by indexing, the target read off batched forwards
  (all in one, and in equal forwards of at most 32 copies: the faster is the floor);
- layer DeepLift (the MLP's second linear layer, the CNN's second conv): ``bench_deeplift.py``'s
  hand-written DeepLift walk, its forward plain up to the layer, its backward stopped there and
  multiplied by the layer's change;
- DeepLiftShap (4 inputs against 16 references): the same walk on all 64 input x reference pairs at
  once (``2 n k`` rows forward), then the mean over the references; and the faster floor, a forward
  of the 4 inputs and 16 references only (``n + k`` rows), each pair's multipliers by broadcasting,
  the backward on the 64 pairs.

Every variant is timed in the same shuffled, interleaved rounds; times are CPU seconds of this
one-thread process. After the timing each variant's maps are checked against the floor's (the
permutations drawn from the same seed; captum's DeepLift on the copy ``bench_deeplift.py`` makes for
it). Last, the peak memory a feature-permutation call adds (256 inputs) by default, with every copy in
one forward, and with ``chunk_size`` 8 and 1: bounded by the chunks. Run:
``python benchmarks/bench_captum_rest.py [part ...]`` (parts: ``deconvolution``, ``feature_permutation``,
``layer_deeplift``, ``deeplift_shap``, ``guided_grad_cam``, ``memory``; none: all).
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from _digits import fastest_pooling, max_pool_with_indices
from _timing import cpu_medians, peak_rss_growth_mib, print_table
from _walk_floor import walked_forward
from bench_deeplift import Back, _captum_safe, _Copy, _floor_step, _rescaled, affine_step, max_pool_back, walk_to_target
from bench_lrp import cnn, mlp
from captum.attr import Deconvolution, DeepLiftShap, FeaturePermutation, GuidedGradCam, LayerDeepLift
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import deconvolution, deeplift_shap, feature_permutation, guided_grad_cam, layer_deeplift

warnings.filterwarnings("ignore")
TARGET, SEED, EPS = 0, 0, 1e-10
CAPTUM = "captum 0.9.0 (default)"
Impls = dict[str, Callable[[], torch.Tensor]]


def report(title: str, impls: Impls, *, rounds: int, number: int, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Time every variant in interleaved rounds, print the ratios, then check each against the floor."""
    times = cpu_medians(impls, rounds=rounds, number=number)
    floor = min(v for k, v in times.items() if k.startswith("floor"))
    best = min(v for k, v in times.items() if k.startswith("captum"))
    print_table(title, list(times.items()), {"floor": floor, "captum default": times[CAPTUM], "captum best": best})
    reference = next(fn for name, fn in impls.items() if name.startswith("floor"))()
    for name, fn in impls.items():
        torch.testing.assert_close(fn().detach(), reference, rtol=rtol, atol=atol, msg=f"{title}: {name} differs")


def _frozen_with_relus(model: nn.Module, function: type[torch.autograd.Function]) -> nn.Sequential:
    """A frozen copy of the chain ``model`` whose ReLUs apply ``function`` (the same values, another backward), its
    max pooling on channels-last copies (`_digits.fastest_pooling`, as ours runs it: NOTE [shadow max pooling])."""

    class Relu(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = function.apply(x)  # type: ignore[no-untyped-call]
            return out

    frozen = copy.deepcopy(model).requires_grad_(False)
    return fastest_pooling(nn.Sequential(*(Relu() if isinstance(m, nn.ReLU) else m for m in frozen)))


class _DeconvReLU(torch.autograd.Function):
    """``relu`` forward; ``relu`` of the arriving gradient backward (the deconvnet's rule)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.relu(grad)


def floor_deconvolution(model: nn.Module, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    net = _frozen_with_relus(model, _DeconvReLU)

    def run() -> torch.Tensor:
        inputs = x.detach().requires_grad_()
        (grad,) = torch.autograd.grad(net(inputs)[:, TARGET].sum(), inputs)
        return grad

    return run


def floor_deconvolution_walk(model: nn.Sequential, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The deconvnet by hand, without autograd: `walked_forward`, then the adjoints back, ``relu`` of the gradient
    at each ReLU."""
    frozen = copy.deepcopy(model).requires_grad_(False)

    def run() -> torch.Tensor:
        with torch.no_grad():
            _, backs, g = walked_forward(frozen, x, lambda g, _y: torch.relu(g), TARGET)
            for back in reversed(backs):
                g = back(g)
            return g

    return run


def bench_deconvolution(title: str, model: nn.Sequential, x: torch.Tensor) -> None:
    f, p = tdhook_fn.pure(model)
    report(f"deconvolution, {title}, batch {len(x)}", {
        "floor (one forward, input grad)": floor_deconvolution(model, x),
        "floor (walk without autograd)": floor_deconvolution_walk(model, x),
        "ours": lambda: deconvolution(f, p, x, target=TARGET),
        CAPTUM: lambda: Deconvolution(model).attribute(x, target=TARGET),
    }, rounds=41, number=16)


def floor_guided_grad_cam(model: nn.Sequential, x: torch.Tensor, layer: int) -> Callable[[], torch.Tensor]:
    guided = [False]  # the ReLUs' backward: plain for the Grad-CAM gradient, then guided for the input's

    class GuidedReLU(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, h: torch.Tensor) -> torch.Tensor:
            y = torch.relu(h)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            (y,) = ctx.saved_tensors
            return (torch.relu(grad) if guided[0] else grad) * (y > 0)

    net = _frozen_with_relus(model, GuidedReLU)
    head, tail = net[:layer + 1], net[layer + 1:]

    def run() -> torch.Tensor:
        inputs = x.detach().requires_grad_()
        act = head(inputs)
        out = tail(act)[:, TARGET].sum()
        guided[0] = False
        (at_layer,) = torch.autograd.grad(out, act, retain_graph=True)
        guided[0] = True
        (at_input,) = torch.autograd.grad(out, inputs)
        with torch.no_grad():
            cam = torch.relu((at_layer.mean((2, 3), keepdim=True) * act).sum(1, keepdim=True))
            return at_input * F.interpolate(cam, size=x.shape[2:], mode="nearest")

    return run


def floor_guided_grad_cam_walk(model: nn.Sequential, x: torch.Tensor, layer: int) -> Callable[[], torch.Tensor]:
    """Guided Grad-CAM by hand, without autograd: `walked_forward`, the plain backward to the layer, the guided one
    to the input, then the map as `floor_guided_grad_cam`'s."""
    frozen = copy.deepcopy(model).requires_grad_(False)
    guided = [False]

    def relu_back(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (torch.relu(g) if guided[0] else g) * (y > 0)

    def run() -> torch.Tensor:
        with torch.no_grad():
            outs, backs, seed = walked_forward(frozen, x, relu_back, TARGET)
            guided[0], g = False, seed
            for back in reversed(backs[layer + 1:]):
                g = back(g)
            act = outs[layer]
            guided[0], at_input = True, seed
            for back in reversed(backs):
                at_input = back(at_input)
            cam = torch.relu((g.reshape(act.shape).mean((2, 3), keepdim=True) * act).sum(1, keepdim=True))
            return at_input * F.interpolate(cam, size=x.shape[2:], mode="nearest")

    return run


def bench_guided_grad_cam(title: str, model: nn.Sequential, x: torch.Tensor, layer: int) -> None:
    f, p = tdhook_fn.pure(model)
    report(f"guided Grad-CAM at [{layer}], {title}, batch {len(x)}", {
        "floor (one forward, two grads)": floor_guided_grad_cam(model, x, layer),
        "floor (walk without autograd)": floor_guided_grad_cam_walk(model, x, layer),
        "ours": lambda: guided_grad_cam(f, p, x, target=TARGET, layer=f"[{layer}]"),
        CAPTUM: lambda: GuidedGradCam(model, model[layer]).attribute(x, target=TARGET),
    }, rounds=15, number=8)


def _permutations(n: int, count: int) -> torch.Tensor:
    """One permutation of the ``n`` samples per feature, never the identity, drawn as captum draws them."""
    torch.manual_seed(SEED)
    identity, out = torch.arange(n), []
    for _ in range(count):
        perm = torch.randperm(n)
        while torch.equal(perm, identity):
            perm = torch.randperm(n)
        out.append(perm)
    return torch.stack(out)


def floor_feature_permutation(net: nn.Module, x: torch.Tensor, target: torch.Tensor, rows: int) -> torch.Tensor:
    """Every element of ``x`` a feature; ``rows`` copies of the batch per forward (the first one unpermuted)."""
    n = len(x)
    flat = x.reshape(n, -1)
    features = flat.shape[1]
    perms = _permutations(n, features)
    with torch.no_grad():
        moved = flat[perms, torch.arange(features)[:, None]]  # [P, N]: feature p of sample perms[p, i]
        values = []
        for lo in range(0, features + 1, rows):
            hi = min(lo + rows, features + 1)
            chunk = flat.expand(hi - lo, n, features).clone()
            permuted = torch.arange(max(lo, 1), hi)  # copy j permutes feature j - 1
            chunk[permuted - lo, :, permuted - 1] = moved[permuted - 1]
            out = net(chunk.view(-1, *x.shape[1:])).view(hi - lo, n, -1)
            values.append(out.gather(2, target.view(1, n, 1).expand(hi - lo, n, 1))[..., 0])
        value = torch.cat(values)  # [P + 1, N]
        return (value[:1] - value[1:]).T.reshape(x.shape)


def bench_feature_permutation(title: str, model: nn.Module, x: torch.Tensor) -> None:
    f, p = tdhook_fn.pure(model)
    fast = fastest_pooling(model)  # (the floor's forward: NOTE [shadow max pooling])
    with torch.no_grad():
        target = model(x).argmax(-1)
    copies = x[0].numel() + 1
    equal = -(-copies // -(-copies // 32))  # equal forwards of at most 32 copies

    def ours() -> torch.Tensor:
        torch.manual_seed(SEED)
        return feature_permutation(f, p, x, target=target)

    def captum(per_eval: int) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            torch.manual_seed(SEED)
            return FeaturePermutation(model).attribute(x, target=target, perturbations_per_eval=per_eval)
        return run

    report(f"feature permutation, every element ({copies - 1}), {title}, batch {len(x)}", {
        "floor, one forward": lambda: floor_feature_permutation(fast, x, target, copies),
        f"floor, {equal} per forward": lambda: floor_feature_permutation(fast, x, target, equal),
        "ours": ours, CAPTUM: captum(1), "captum 0.9.0 (ppe=16)": captum(16),
        f"captum 0.9.0 (ppe={copies - 1}, all)": captum(copies - 1),
    }, rounds=9, number=2, atol=1e-5)


def permutation_memory(title: str, model: nn.Module, x: torch.Tensor) -> None:
    """Peak resident memory a feature-permutation call adds, by ``chunk_size`` (each run once after a warm-up)."""
    f, p = tdhook_fn.pure(model)
    copies = x[0].numel() + 1
    print(f"\nfeature permutation, {title}, batch {len(x)}: peak memory added ({copies} copies of the batch)")
    for label, chunk_size in (("ours (default)", None), (f"ours, chunk_size={copies} (all)", copies),
                              ("ours, chunk_size=8", 8), ("ours, chunk_size=1", 1)):
        def run(chunk_size: int | None = chunk_size) -> torch.Tensor:
            return feature_permutation(f, p, x, target=TARGET, chunk_size=chunk_size)
        run()
        print(f"  {label:<34}{peak_rss_growth_mib(run):>10.1f} MiB")


def floor_layer_deeplift(model: nn.Sequential, x: torch.Tensor, layer: int) -> Callable[[], torch.Tensor]:
    """DeepLift (zero reference) of the output of ``model[layer]``: the walk of ``bench_deeplift.py`` stopped there."""
    frozen = copy.deepcopy(model).requires_grad_(False)
    fast = fastest_pooling(frozen)
    n = len(x)

    def run() -> torch.Tensor:
        with torch.no_grad():
            h = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
            for module in fast[:layer + 1]:
                h = module(h)
            return walk_to_target(frozen[layer + 1:], h, n, TARGET, EPS) * (h[:n] - h[n:])

    return run


def bench_layer_deeplift(title: str, model: nn.Sequential, x: torch.Tensor, layer: int) -> None:
    f, p = tdhook_fn.pure(model)
    theirs = _captum_safe(copy.deepcopy(model))
    at = [m for m in theirs if not isinstance(m, _Copy)][layer]  # (the copy has modules between ReLU and pool)
    report(f"layer DeepLift at [{layer}], {title}, batch {len(x)}", {
        "floor (walk stopped at layer)": floor_layer_deeplift(model, x, layer),
        "ours": lambda: layer_deeplift(f, p, x, target=TARGET, layers=[f"[{layer}]"]),
        CAPTUM: lambda: LayerDeepLift(theirs, at).attribute(x, target=TARGET),
    }, rounds=15, number=8)


def floor_deeplift_shap(model: nn.Sequential, x: torch.Tensor, refs: torch.Tensor) -> Callable[[], torch.Tensor]:
    """DeepLift of every input against every reference, in one batch of pairs, averaged over the references."""
    frozen = copy.deepcopy(model).requires_grad_(False)
    n, k = len(x), len(refs)

    def run() -> torch.Tensor:
        with torch.no_grad():
            xs = x.repeat_interleave(k, 0)
            rs = refs.repeat(n, *(1,) * (refs.dim() - 1))
            h, backs = torch.cat([xs, rs]), []
            for module in frozen:
                h, back = _floor_step(module, h, n * k, EPS)
                backs.append(back)
            g = h.new_zeros((n * k, h.shape[1]))
            g[:, TARGET] = 1.0
            for back in reversed(backs):
                g = back(g)
            return (g * (xs - rs)).view(n, k, *x.shape[1:]).mean(1)

    return run


def _pairs(t: torch.Tensor, n: int) -> torch.Tensor:
    """Rows ``t[:n]`` (inputs) minus rows ``t[n:]`` (references), every pair: ``[n * k, ...]``, input-major."""
    return (t[:n, None] - t[None, n:]).flatten(0, 1)


def _each_pair(t: torch.Tensor, k: int) -> torch.Tensor:
    """Each of the ``n`` rows of ``t`` once per reference: ``[n * k, ...]`` (a copy, made only where needed)."""
    return t[:, None].expand(t.shape[0], k, *t.shape[1:]).flatten(0, 1)


def _pair_step(layer: nn.Module, h: torch.Tensor, n: int, eps: float) -> tuple[torch.Tensor, Back]:
    """One layer's forward on ``n`` inputs then ``k`` references (``n + k`` rows), and its DeepLift backward on the
    ``n * k`` pairs (multipliers by broadcasting)."""
    k = h.shape[0] - n
    affine = affine_step(layer, h)
    if affine is not None:
        return affine
    if isinstance(layer, nn.ReLU):
        y = torch.relu(h)
        dx = _pairs(h, n)
        m = _rescaled(dx, _pairs(y, n) / dx, lambda: _each_pair(y[:n] > 0, k).to(y.dtype), eps)
        return y, lambda g: g * m
    if isinstance(layer, nn.MaxPool2d):
        y, idx = max_pool_with_indices(layer, h)
        top = torch.maximum(y[:n, None], y[None, n:])
        up, down = (top - y[None, n:]).flatten(0, 1), (y[:n, None] - top).flatten(0, 1)
        at_x = _each_pair(idx[:n], k).flatten(2)
        at_ref = idx[None, n:].expand(n, *idx[n:].shape).flatten(0, 1).flatten(2)
        dx, shape = _pairs(h, n), (n * k, *h.shape[1:])
        return y, max_pool_back(shape, at_x, at_ref, up, down, dx, eps)
    if isinstance(layer, nn.Flatten):
        return h.flatten(1), lambda g: g.reshape(g.shape[0], *h.shape[1:])
    raise TypeError(f"floor_deeplift_shap: no rule for {type(layer).__name__}")


def floor_deeplift_shap_broadcast(model: nn.Sequential, x: torch.Tensor,
                                  refs: torch.Tensor) -> Callable[[], torch.Tensor]:
    """DeepLiftShap with a forward of the ``n`` inputs and ``k`` references only (``n + k`` rows, not ``2 n k``):
    the pairs' multipliers by broadcasting, the backward on the ``n k`` pairs."""
    frozen = copy.deepcopy(model).requires_grad_(False)
    n, k = len(x), len(refs)

    def run() -> torch.Tensor:
        with torch.no_grad():
            h, backs = torch.cat([x, refs]), []
            for module in frozen:
                h, back = _pair_step(module, h, n, EPS)
                backs.append(back)
            g = h.new_zeros((n * k, h.shape[1]))
            g[:, TARGET] = 1.0
            for back in reversed(backs):
                g = back(g)
            return (g.view(n, k, *x.shape[1:]) * (x[:, None] - refs[None])).mean(1)

    return run


def bench_deeplift_shap(title: str, model: nn.Sequential, x: torch.Tensor) -> None:
    f, p = tdhook_fn.pure(model)
    theirs = _captum_safe(copy.deepcopy(model))
    torch.manual_seed(1)
    few, refs = x[:4], torch.randn(16, *x.shape[1:])
    report(f"DeepLiftShap, {len(few)} inputs x {len(refs)} references, {title}", {
        "floor (walk on every pair)": floor_deeplift_shap(model, few, refs),
        "floor (n + k rows forward)": floor_deeplift_shap_broadcast(model, few, refs),
        "ours": lambda: deeplift_shap(f, p, few, refs, target=TARGET),
        CAPTUM: lambda: DeepLiftShap(theirs).attribute(few, refs, target=TARGET),
    }, rounds=15, number=8)


PARTS = ("deconvolution", "feature_permutation", "layer_deeplift", "deeplift_shap", "guided_grad_cam", "memory")


def main(parts: tuple[str, ...] = PARTS) -> None:
    torch.set_num_threads(1)
    (net, x), (conv, images) = mlp(), cnn()
    assert isinstance(net, nn.Sequential) and isinstance(conv, nn.Sequential)
    for title, model, inputs in (("MLP 128-256x2-10", net, x), ("CNN 2 conv 8x8 (max pool)", conv, images)):
        if "deconvolution" in parts:
            bench_deconvolution(title, model, inputs)
        if "feature_permutation" in parts:
            bench_feature_permutation(title, model, inputs)
        if "layer_deeplift" in parts:
            bench_layer_deeplift(title, model, inputs, 2 if model is net else 3)
        if "deeplift_shap" in parts:
            bench_deeplift_shap(title, model, inputs)
    if "guided_grad_cam" in parts:
        bench_guided_grad_cam("CNN 2 conv 8x8 (max pool)", conv, images, 3)
    for title, model, inputs in (("MLP 128-256x2-10", net, x), ("CNN 2 conv 8x8 (max pool)", conv, images)):
        if "memory" in parts:
            permutation_memory(title, model, inputs.repeat(4, *(1,) * (inputs.dim() - 1)))  # 256 inputs


if __name__ == "__main__":
    unknown = set(sys.argv[1:]) - set(PARTS)
    if unknown:
        sys.exit(f"bench_captum_rest: unknown parts {sorted(unknown)}; choose among {list(PARTS)} (none: all)")
    main(tuple(sys.argv[1:]) or PARTS)
