"""Surrogate-model perturbation methods: KernelSHAP and LIME against captum 0.9.0 and a batched floor.

A digits-sized CNN (``[N, 1, 8, 8] -> 10`` classes) on the first ``N = 16`` of
scikit-learn's digits, 16 features (the 2x2 patches), 100 interpretable samples per
image, the predicted class as target.

- kernel_shap with its defaults (least squares, end-point weights 1e6), also at its
  default ``n_samples=25``;
- lime with its defaults (cosine kernel, lasso ``alpha=0.01``), and with
  ``interpretable_model="linear"``.

captum runs at its default ``perturbations_per_eval=1`` and at its best setting (all 100
samples of an image in one forward); it explains one image at a time and fits one
scikit-learn model per image. The floor is the plain torch a capable engineer writes:
the same interpretable samples (drawn in every variant), every perturbed image built at
once with ``torch.where``, one forward without autograd (its max pooling on a channels-last
copy, as ours runs it: NOTE [shadow max pooling]), the weights, one batched
least-squares solve (``gelsd``); for the lasso, no plain-torch solver exists, so the floor
calls the same batched lasso as ours (the row then times everything but the solver).
Ours and the floor are first checked to give the same numbers (captum draws its own
samples; tests/attribution/test_surrogate_captum.py checks it on the same ones). Times are
CPU seconds of this one-thread process, medians of interleaved rounds.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from _digits import cnn, digits, fastest_pooling
from _timing import cpu_medians, print_table
from captum.attr import KernelShap, Lime
from torch import nn

import tdhook_fn
from tdhook_fn.attribution._kernel_shap import kernel_shap, shapley_kernel_samples
from tdhook_fn.attribution._lime import lime
from tdhook_fn.attribution._surrogate_fit import lasso

warnings.filterwarnings("ignore")
N, SAMPLES, SEED = 16, 100, 0
ROWS = torch.arange(8) // 2
MASK = (ROWS[:, None] * 4 + ROWS[None, :]).reshape(1, 1, 8, 8)  # 16 patch features, captum's layout
FLAT = MASK.reshape(-1)


def floor_values(net: nn.Module, x: torch.Tensor, target: torch.Tensor, samples: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every perturbed image at once, one forward: the perturbed images ``[N, n, ...]`` and the target values."""
    n = samples.shape[-2]
    keep = samples[..., FLAT].reshape(N, n, 1, 8, 8)
    moved = torch.where(keep, x[:, None], torch.zeros(()))
    out = net(moved.reshape(N * n, 1, 8, 8)).reshape(N, n, 10)
    return moved, out.gather(-1, target[:, None, None].expand(N, n, 1))


def floor_least_squares(samples: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xs = samples.float()
    p = w / w.sum(-1, keepdim=True)
    xc = xs - (p[:, None] @ xs)
    yc = y - (p[:, None] @ y)
    root = w.sqrt()[..., None]
    coefs = torch.linalg.lstsq(root * xc, root * yc, driver="gelsd").solution[..., 0]
    return coefs[:, FLAT].reshape(N, 1, 8, 8)


def _compare(method: str, ours: Callable[[], torch.Tensor], floor: Callable[[], torch.Tensor], explainer: Any,
             x: torch.Tensor, target: torch.Tensor, n_samples: int) -> None:
    """Check ours against the floor, then time both and captum's ``explainer`` (1 and all samples per eval)."""
    def captum(per_eval: int) -> Callable[[], torch.Tensor]:
        return lambda: explainer.attribute(x, target=target, n_samples=n_samples, feature_mask=MASK,
                                           perturbations_per_eval=per_eval)

    best = f"captum 0.9.0 ({n_samples} per eval)"
    impls = {"ours": ours, "captum 0.9.0 (default, 1 per eval)": captum(1), best: captum(n_samples),
             "hand-written batched floor": floor}
    torch.testing.assert_close(ours(), floor(), rtol=1e-4, atol=1e-5)
    times = cpu_medians(impls, rounds=7, number=1)
    print_table(f"{method}, CNN on digits, batch {N}, 16 patch features, {n_samples} samples", list(times.items()),
                {"floor": times["hand-written batched floor"], "captum best": times[best]})


def bench_kernel_shap(net: nn.Sequential, x: torch.Tensor, target: torch.Tensor, n_samples: int = SAMPLES) -> None:
    f, p = tdhook_fn.pure(net)
    explainer = KernelShap(net)
    fast = fastest_pooling(net)

    def ours() -> torch.Tensor:
        return kernel_shap(f, p, x, target=target, n_samples=n_samples, feature_mask=MASK,
                           generator=torch.Generator().manual_seed(SEED))

    def floor() -> torch.Tensor:
        samples = shapley_kernel_samples(16, n_samples, (N,), generator=torch.Generator().manual_seed(SEED))
        with torch.no_grad():
            _, y = floor_values(fast, x, target, samples)
            sizes = samples.sum(-1)
            w = torch.where((sizes == 0) | (sizes == 16), 1e6, 1.0)
            return floor_least_squares(samples, y, w)

    _compare("kernel_shap", ours, floor, explainer, x, target, n_samples)


def bench_lime(net: nn.Sequential, x: torch.Tensor, target: torch.Tensor, model: str) -> None:
    f, p = tdhook_fn.pure(net)
    fast = fastest_pooling(net)
    explainer = Lime(net) if model == "lasso" else Lime(net, interpretable_model=_captum_linear())

    def ours() -> torch.Tensor:
        return lime(f, p, x, target=target, n_samples=SAMPLES, feature_mask=MASK, interpretable_model=model,
                    generator=torch.Generator().manual_seed(SEED))

    def floor() -> torch.Tensor:
        g = torch.Generator().manual_seed(SEED)
        samples = torch.bernoulli(torch.full((N, SAMPLES, 16), 0.5), generator=g).bool()
        with torch.no_grad():
            moved, y = floor_values(fast, x, target, samples)
            cos = torch.nn.functional.cosine_similarity(x.reshape(N, 1, 64), moved.reshape(N, SAMPLES, 64), dim=-1)
            w = torch.exp(-((1 - cos) ** 2) / 2)
            if model == "linear":
                return floor_least_squares(samples, y, w)
            coefs = lasso(samples.float(), y, w, 0.01)[:, 0]
            return coefs[:, FLAT].reshape(N, 1, 8, 8)

    _compare(f"lime ({model})", ours, floor, explainer, x, target, SAMPLES)


def _captum_linear():  # type: ignore[no-untyped-def]
    from captum._utils.models.linear_model import SkLearnLinearRegression

    return SkLearnLinearRegression()


def main() -> None:
    net = cnn()
    x = digits(N)
    with torch.no_grad():
        target = net(x).argmax(-1)
    bench_kernel_shap(net, x, target)
    bench_kernel_shap(net, x, target, 25)  # captum's default n_samples
    bench_lime(net, x, target, "lasso")
    bench_lime(net, x, target, "linear")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
