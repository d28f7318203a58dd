"""The compat integrated-gradients context call against the pure call it makes (issue 24: <= 1.05x).

``with IntegratedGradients(...).prepare(model) as hooked: hooked(td)`` (context entry and exit
included) against `tdhook_fn.attribution.integrated_gradients` with the same target and
options, on the models of ``bench_ig.py`` and a small MLP where a fixed overhead shows most.
CPU time, one thread, interleaved rounds, medians. Run from the repository root:
``PYTHONPATH=benchmarks python -m benchmarks.bench_compat_overhead``.
"""

from __future__ import annotations

import statistics

import torch
from _timing import cpu_medians
from bench_ig import cnn, mlp
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import integrated_gradients
from tdhook_fn.compat.attribution import IntegratedGradients

N_STEPS = 50


def small() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10)).eval(), torch.randn(8, 16)


def _pick(out: TensorDict, _: object = None) -> TensorDict:
    return TensorDict(out=out["output"][..., 3], batch_size=out.batch_size)


def ratio(model: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    """(compat seconds, pure seconds) per call."""
    td = TensorDict(input=x, baseline=TensorDict(input=torch.zeros_like(x), batch_size=x.shape[:1]),
                    batch_size=x.shape[:1])
    f = tdhook_fn.functional(model)

    def compat() -> torch.Tensor:
        with IntegratedGradients(init_attr_targets=_pick, n_steps=N_STEPS, multiply_by_inputs=True
                                 ).prepare(model) as hooked:
            return hooked(td.clone())["attr", "input"]

    def pure() -> torch.Tensor:
        out = integrated_gradients(f, tdhook_fn.params(model), td.select("input"), td["baseline"], target=_pick,
                                   n_steps=N_STEPS, interpolate="inputs")  # (the options compat passes)
        return out["input"]  # type: ignore[index]

    torch.testing.assert_close(compat(), pure())
    times = cpu_medians({"compat": compat, "pure": pure}, rounds=15, number=5)
    return times["compat"], times["pure"]


def main() -> None:
    torch.set_num_threads(1)
    for name, (model, x) in (("MLP 16-32-10, batch 8", small()), ("MLP 128-256x4-10, batch 64", mlp()),
                             ("CNN 2 conv 8x8", cnn())):
        runs = [ratio(model, x) for _ in range(3)]
        ratios = [c / p for c, p in runs]
        print(f"{name}: compat {statistics.median(c for c, _ in runs) * 1e3:.2f} ms, pure "
              f"{statistics.median(p for _, p in runs) * 1e3:.2f} ms, compat/pure {statistics.median(ratios):.3f}x "
              f"(runs {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
