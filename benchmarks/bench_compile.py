"""``torch.compile(fullgraph=True)`` (inductor) of the core and gradient methods against eager.

For each model and method: the first compiled call (tracing and code generation), the
steady-state compiled time over the eager time of the same function (medians of rounds
that time both in turn, so that both share the machine's drift), and the graph breaks
``torch._dynamo.explain`` counts (0 is what fullgraph needs). The last row of each model
is the floor: ``torch.func.functional_call`` written by hand with the same params, which
is what compiling any call of the model costs over its eager run, and the module itself
compiled (a copy whose weights need no gradient): torch's own ratio for the model.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch
from _timing import interleaved_medians
from bench_call import _models
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import DimsConfig, grad_cam, integrated_gradients, saliency

LAYERS = {"transformer layer d64, batch 8x16": "linear1"}  # else "[1]", the first ReLU or conv
TARGETS: dict[str, Any] = {"transformer layer d64, batch 8x16": lambda out: out["output"][..., -1, 1]}  # else 1


def _methods(net: nn.Module, layer: str, target: Any) -> dict[str, Callable[..., Any]]:
    f = tdhook_fn.functional(net)
    frozen = copy.deepcopy(net).requires_grad_(False)  # the module's own forward, its weights not trained
    # the floor's plain dict of the same tensors as the params, built once outside the timing
    tensors = {".".join(k): v for k, v in tdhook_fn.params(net).items(include_nested=True, leaves_only=True)}
    return {
        "call": lambda p, td: tdhook_fn.call(net, p, td["input"]),
        "functional": lambda p, td: f(p, td),
        "saliency": lambda p, td: saliency(f, p, td, target=target),
        f"layer saliency {layer}": lambda p, td: saliency(f, p, td, target=target, layers=[layer]),
        f"layer IG {layer}, n=16": lambda p, td: integrated_gradients(f, p, td, 0.0, target=target, n_steps=16,
                                                                      layers=[layer]),
        "integrated_gradients n=16": lambda p, td: integrated_gradients(f, p, td, 0.0, target=target, n_steps=16),
        f"Grad-CAM {layer}": lambda p, td: grad_cam(f, p, td, target=target, layers={layer: _dims(net, layer)}),
        "floor: functional_call": lambda p, td: torch.func.functional_call(net, tensors, (td["input"],)),
        "floor: the module itself": lambda p, td: frozen(td["input"]),
    }


def _dims(net: nn.Module, layer: str) -> DimsConfig:
    """captum's LayerGradCam pooling on a conv layer's ``[C, H, W]``; the plain gradient elsewhere."""
    conv = isinstance(net, nn.Sequential) and isinstance(net[0], nn.Conv2d)
    return DimsConfig((1, 2), (0,)) if conv else DimsConfig()


def _calls(fn: Callable[..., Any], *args: Any) -> int:
    """How many calls of ``fn(*args)`` last about 20 ms, so that a sample is not one short call."""
    fn(*args)
    start = time.perf_counter()
    fn(*args)
    return max(1, int(0.02 / max(time.perf_counter() - start, 1e-6)))


def _repeated(fn: Callable[..., Any], n: int, *args: Any) -> Callable[[], None]:
    """``fn(*args)`` ``n`` times: eager and compiled get the same ``n``, so their sample times compare per call."""

    def run() -> None:
        for _ in range(n):
            fn(*args)

    return run


def main() -> None:
    torch.set_num_threads(1)
    # torch's fused encoder-layer kernel (eval mode) has no derivative, and under Dynamo the
    # fast-path check misses the grad transform's inputs; eager takes the slow path by itself
    torch.backends.mha.set_fastpath_enabled(False)
    print("\ntorch.compile(fullgraph=True, inductor) against eager, steady state (first call: trace and codegen)")
    print(f"{'model':<36}{'method':<28}{'first call':>12}{'compiled/eager':>16}{'breaks':>8}{'graphs':>8}")
    for model_name, (net, x) in _models().items():
        layer = LAYERS.get(model_name, "[1]")
        p = tdhook_fn.params(net)
        td = TensorDict(input=x, batch_size=x.shape[:1])
        for name, fn in _methods(net, layer, TARGETS.get(model_name, 1)).items():
            torch._dynamo.reset()
            breaks = torch._dynamo.explain(fn)(p, td).graph_break_count
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            compiled = torch.compile(fn, fullgraph=True)
            start = time.perf_counter()
            compiled(p, td)
            first = time.perf_counter() - start
            torch.testing.assert_close(compiled(p, td), fn(p, td), rtol=1e-4, atol=1e-5)
            n = _calls(fn, p, td)
            variants = {"eager": _repeated(fn, n, p, td), "compiled": _repeated(compiled, n, p, td)}
            times = interleaved_medians(variants, rounds=15)
            eager, fast = times["eager"], times["compiled"]
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            print(f"{model_name:<36}{name:<28}{first:>11.2f}s{fast / eager:>15.2f}x{breaks:>8}{graphs:>8}")


if __name__ == "__main__":
    main()
