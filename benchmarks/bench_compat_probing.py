"""tdhook_fn.compat.latent.probing against tdhook 0.1.3's probing and a hand-written floor.

- Estimator fits (``LinearEstimator`` classification and regression, ``BilinearEstimator``,
  ``LowRankBilinearEstimator``): N=2000 samples of width 64 (and 32), 5 epochs of
  minibatch Adam (batch 128), as tdhook trains them. The floor is the plain torch loop a
  capable engineer writes: the epoch's shuffled rows gathered once, module forward,
  ``backward`` and a fused ``torch.optim.Adam`` step.
- ``MeanDifferenceClassifier`` on load_digits (3 vs 8) and on 20000 x 512 random samples:
  tdhook's numpy fit, ours (through ``fit_probes``) and a floor of two masked means in numpy.
- ``Probing`` + ``ProbeManager(LinearEstimator)`` on an MLP (10 -> 256 -> 256 -> 5), two
  probed layers, 4 fit calls and 1 predict call of batch 256; the floor captures both
  layers with forward hooks on the model and fits with the floor loop.

Every variant is checked to give the same parameters (floors: the same accuracy range)
before it is timed. One intra-op thread; OpenBLAS single-threaded.
"""

from __future__ import annotations

import copy
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "1")

import numpy as np
import tdhook.latent.probing as td_probing
import tdhook.latent.probing.estimators as td_estimators
import torch
from _timing import interleaved_medians, print_table
from sklearn.datasets import load_digits
from tensordict import TensorDict
from torch import nn

import tdhook_fn.compat.latent.probing as our_probing
import tdhook_fn.compat.latent.probing.estimators as our_estimators

torch.set_num_threads(1)
N, EPOCHS, BATCH = 2000, 5, 128


def floor_fit(module: nn.Module, xs: tuple[torch.Tensor, ...], y: torch.Tensor, classes: bool) -> nn.Module:
    """Minibatch Adam the plain way: one gather per epoch, forward, backward, fused step."""
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3, fused=True)
    loss_fn = nn.functional.cross_entropy if classes else nn.functional.mse_loss
    for _ in range(EPOCHS):
        order = torch.randperm(y.shape[0])
        shuffled = [x[order] for x in xs]
        target = y[order]
        for start in range(0, y.shape[0], BATCH):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(module(*(x[start:start + BATCH] for x in shuffled)), target[start:start + BATCH]).backward()
            optimizer.step()
    return module


def fit(lib: object, name: str, kwargs: dict[str, object], xs: tuple[torch.Tensor, ...], y: torch.Tensor) -> nn.Module:
    torch.manual_seed(0)
    estimator: nn.Module = getattr(lib, name)(epochs=EPOCHS, batch_size=BATCH, **kwargs)
    return estimator.fit(*xs, y=y)


def bench_estimators() -> None:
    g = torch.Generator().manual_seed(0)
    x, x2 = torch.randn(N, 64, generator=g), torch.randn(N, 32, generator=g)
    classes, values = torch.randint(0, 4, (N,), generator=g), torch.randn(N, 1, generator=g)
    cases = [
        ("LinearEstimator (4 classes)", "LinearEstimator", {"d_latent": 64, "num_classes": 4}, (x,), classes,
         lambda: nn.Linear(64, 4)),
        ("LinearEstimator (regression)", "LinearEstimator", {"d_latent": 64}, (x,), values, lambda: nn.Linear(64, 1)),
        ("BilinearEstimator", "BilinearEstimator", {"d_latent1": 64, "d_latent2": 32, "num_classes": 4}, (x, x2),
         classes, lambda: nn.Bilinear(64, 32, 4)),
        ("LowRankBilinearEstimator", "LowRankBilinearEstimator",
         {"d_latent1": 64, "d_latent2": 32, "num_classes": 4}, (x, x2), classes, None),
    ]
    for title, name, kwargs, xs, y, floor_module in cases:
        theirs, ours = fit(td_estimators, name, kwargs, xs, y), fit(our_estimators, name, kwargs, xs, y)
        for (n, a), (_, b) in zip(theirs.named_parameters(), ours.named_parameters(), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=f"{title}: {n}")
        impls = {
            "tdhook": lambda name=name, kwargs=kwargs, xs=xs, y=y: fit(td_estimators, name, kwargs, xs, y),
            "ours": lambda name=name, kwargs=kwargs, xs=xs, y=y: fit(our_estimators, name, kwargs, xs, y),
        }
        if floor_module is not None:
            is_class = "num_classes" in kwargs
            impls["floor"] = lambda m=floor_module, xs=xs, y=y, c=is_class: floor_fit(m(), xs, y, c)
        times = interleaved_medians(impls, rounds=5)
        baselines = {k: times[k] for k in ("tdhook", "floor") if k in times}
        print_table(f"{title}: fit, N={N}, {EPOCHS} epochs, batch {BATCH}", list(times.items()), baselines)


def bench_mean_difference() -> None:
    data = load_digits()
    keep = np.isin(data.target, (3, 8))
    digits = (data.data[keep] / 16.0, (data.target[keep] == 8).astype(np.int64))
    rng = np.random.default_rng(0)
    large = (rng.normal(size=(20000, 512)), (rng.random(20000) > 0.5).astype(np.int64))
    for title, (x, y), number in (("digits 3 vs 8", digits, 20), ("random", large, 1)):

        def fitted(cls: type, x: np.ndarray = x, y: np.ndarray = y) -> object:
            classifier = cls()
            classifier.fit(x, y)
            return classifier

        def floor(x: np.ndarray = x, y: np.ndarray = y) -> tuple[np.ndarray, float]:
            pos, neg = x[y == 1].mean(0), x[y == 0].mean(0)
            w = pos - neg
            norm = np.linalg.norm(w)
            return w / norm, -0.5 * (pos @ pos - neg @ neg) / norm

        theirs, ours = fitted(td_estimators.MeanDifferenceClassifier), fitted(our_estimators.MeanDifferenceClassifier)
        np.testing.assert_allclose(ours.coef_, theirs.coef_, rtol=1e-10, atol=1e-12)
        times = interleaved_medians({"tdhook": lambda f=fitted: f(td_estimators.MeanDifferenceClassifier),
                                     "ours": lambda f=fitted: f(our_estimators.MeanDifferenceClassifier),
                                     "floor": floor}, rounds=7, number=number)
        print_table(f"MeanDifferenceClassifier.fit, {title} ({x.shape[0]} x {x.shape[1]})", list(times.items()),
                    {"tdhook": times["tdhook"], "floor": times["floor"]})


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1, self.linear2, self.linear3 = nn.Linear(10, 256), nn.Linear(256, 256), nn.Linear(256, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear3(torch.relu(self.linear2(torch.relu(self.linear1(x)))))


def accuracy(predicted: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    return {"accuracy": float((predicted == labels).float().mean())}


def batches() -> list[TensorDict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for step_type in ("fit",) * 4 + ("predict",):
        x = torch.randn(256, 10, generator=g)
        out.append(TensorDict(input=x, labels=(x[:, 0] > 0).long() + (x[:, 1] > 0).long(), step_type=step_type,
                              batch_size=[256]))
    return out


def probing_run(lib: object, model: nn.Module, data: list[TensorDict]) -> object:
    torch.manual_seed(0)
    manager = lib.ProbeManager(  # type: ignore[attr-defined]
        lib.LinearEstimator, {"d_latent": 256, "num_classes": 3, "epochs": EPOCHS}, accuracy,
        allow_overwrite=True)
    context = lib.Probing("linear1|linear2", manager.probe_factory,  # type: ignore[attr-defined]
                          additional_keys=["labels", "step_type"])
    with context.prepare(model) as hooked:
        for td in data:
            hooked(td)
    return manager


def floor_probing(model: nn.Module, data: list[TensorDict]) -> dict[str, float]:
    seen: dict[str, torch.Tensor] = {}
    handles = [getattr(model, name).register_forward_hook(lambda m, a, o, name=name: seen.__setitem__(name, o))
               for name in ("linear1", "linear2")]
    probes = {name: nn.Linear(256, 3) for name in ("linear1", "linear2")}
    metrics = {}
    with torch.no_grad():
        for td in data:
            model(td["input"])
            for name, probe in probes.items():
                if td["step_type"] == "fit":
                    with torch.enable_grad():
                        floor_fit(probe, (seen[name],), td["labels"], True)
                else:
                    metrics[name] = accuracy(probe(seen[name]).argmax(-1), td["labels"])["accuracy"]
    for handle in handles:
        handle.remove()
    return metrics


def bench_probing() -> None:
    torch.manual_seed(0)
    model, data = MLP(), batches()
    td_model = copy.deepcopy(model)  # tdhook hooks the model while its context is open
    theirs, ours = probing_run(td_probing, td_model, data), probing_run(our_probing, model, data)
    assert ours.predict_metrics == theirs.predict_metrics, (ours.predict_metrics, theirs.predict_metrics)  # type: ignore[attr-defined]
    times = interleaved_medians({"tdhook": lambda: probing_run(td_probing, td_model, data),
                                 "ours": lambda: probing_run(our_probing, model, data),
                                 "floor": lambda: floor_probing(model, data)}, rounds=5)
    print_table("Probing + ProbeManager(LinearEstimator): 2 layers, 4 fit + 1 predict calls of 256",
                list(times.items()), {"tdhook": times["tdhook"], "floor": times["floor"]})


if __name__ == "__main__":
    bench_estimators()
    bench_mean_difference()
    bench_probing()
