"""tdhook_fn.compat.latent.probing side by side with tdhook 0.1.3's ``latent.probing``.

The Probing context must call the same probe factory with the same names, hand every
probe the same values and items, and leave the model without a hook and unchanged (after
an exception too). The estimators must fit to tdhook's own parameters when seeded alike
(same initialisation, same shuffled minibatches, same Adam updates), and the managers
must collect the same metrics. The pure functions behind them are tested on their own.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tdhook.latent.probing as td_probing
import tdhook.latent.probing.estimators as td_estimators
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.datasets import load_digits
from tensordict import TensorDict
from torch import nn
from zoo import TdhookTestModel, same, snapshot

import tdhook_fn.compat.latent.probing as our_probing
import tdhook_fn.compat.latent.probing.estimators as our_estimators
from tdhook_fn.latent._probe_proba import two_class_proba
from tdhook_fn.latent._probe_training import adam_epoch, adam_init, probe_loss, probe_scores

LIBS = {"tdhook": td_probing, "ours": our_probing}
ESTIMATORS = {"tdhook": td_estimators, "ours": our_estimators}


def no_hooks(model: nn.Module) -> bool:
    return not any(
        getattr(m, name) for m in model.modules() for name in vars(m) if name.endswith("hooks") and getattr(m, name)
    )


class Recorder:
    """A probe recording what it is handed; optionally checks the model is hook-free meanwhile."""

    def __init__(self, log: list[Any], name: str, direction: str, model: nn.Module | None = None) -> None:
        self.log, self.name, self.direction, self.model = log, name, direction, model

    def step(self, data: Any, **kwargs: Any) -> None:
        if self.model is not None:
            assert no_hooks(self.model), "a hook on the model while probing"
        value = data[0] if isinstance(data, tuple) else data
        items = {key: (v.clone() if isinstance(v, torch.Tensor) else v) for key, v in kwargs.items()}
        self.log.append((self.name, self.direction, None if value is None else value.detach().clone(), items))


def record(lib: str, model: nn.Module, pattern: str, batches: list[TensorDict], *, check: bool = False,
           backward: bool = False, **kwargs: Any) -> tuple[list[Any], list[Any]]:
    made: list[Any] = []
    log: list[Any] = []

    def factory(name: str, direction: str) -> Recorder:
        made.append((name, direction))
        return Recorder(log, name, direction, model if check else None)

    prepare = kwargs.pop("prepare", {})
    with LIBS[lib].Probing(pattern, factory, **kwargs).prepare(model, **prepare) as hooked:
        for batch in batches:
            out = hooked(batch.clone())
            if backward:
                out[list(out.keys())[-1]].float().sum().backward()
    return made, log


def assert_same_log(theirs: list[Any], ours: list[Any]) -> None:
    assert [(n, d) for n, d, _, _ in theirs] == [(n, d) for n, d, _, _ in ours]
    for (_, _, value, items), (_, _, value2, items2) in zip(theirs, ours, strict=True):
        if value is None or value2 is None:  # a grad_input where no input requires a gradient
            assert value is None and value2 is None
        else:
            torch.testing.assert_close(value2, value, rtol=0, atol=0)
        assert sorted(items) == sorted(items2)
        for key in items:
            if isinstance(items[key], torch.Tensor):
                torch.testing.assert_close(items2[key], items[key], rtol=0, atol=0)
            else:
                assert items2[key] == items[key]


def mlp_batches(n: int = 2) -> list[TensorDict]:
    torch.manual_seed(1)
    return [TensorDict({"input": torch.randn(4, 10), "labels": torch.randint(0, 5, (4,)), "step_type": "fit"},
                       batch_size=4) for _ in range(n)]


# ---------------------------------------------------------------- the Probing context


@pytest.mark.parametrize(("pattern", "kwargs"), [
    ("linear1|linear2|activation", {}),
    ("td_module.module.linear", {"relative": False}),
    ("linear", {"directions": ["fwd_pre", "fwd"], "additional_keys": ["labels", "step_type"]}),
    (".*", {"classes_to_skip": [nn.ReLU], "additional_keys": ["labels"]}),
    ("linear[12]", {"classes_to_hook": [nn.Linear], "directions": ["fwd", "bwd"], "backward": True}),
], ids=["pattern", "absolute", "directions-items", "skip", "bwd"])
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # no input requires a gradient, in both
def test_probing_calls_what_tdhook_calls(pattern: str, kwargs: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = TdhookTestModel()
    theirs = record("tdhook", copy.deepcopy(model), pattern, mlp_batches(), **dict(kwargs))
    ours = record("ours", model, pattern, mlp_batches(), check=True, **dict(kwargs))
    assert theirs[0] == ours[0] and ours[0]
    assert_same_log(theirs[1], ours[1])
    assert no_hooks(model)


def test_probing_on_a_transformer_matches_tdhook() -> None:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=40, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    batches = [TensorDict({"input_ids": torch.randint(0, 40, (3, 7)), "labels": torch.arange(3)}, batch_size=3)]
    args = (r"transformer\.h\.\d+\.mlp$|transformer\.ln_f", batches)
    options = {"prepare": {"in_keys": ["input_ids"], "out_keys": ["logits"]}, "additional_keys": ["labels"]}
    before = snapshot(model)
    theirs = record("tdhook", copy.deepcopy(model), *args, **dict(options))
    ours = record("ours", model, *args, check=True, **dict(options))
    assert [n for n, _ in ours[0]] == ["transformer.h.0.mlp", "transformer.h.1.mlp", "transformer.ln_f"]
    assert theirs[0] == ours[0]
    assert_same_log(theirs[1], ours[1])
    assert same(before, snapshot(model))


@pytest.mark.parametrize(("pattern", "relative"), [("module.0|module.1", True), ("td_module.module.0", False)])
def test_probing_a_tensordict_module_matches_tdhook(pattern: str, relative: bool) -> None:
    from tensordict.nn import TensorDictModule

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    batches = [TensorDict(x=torch.randn(2, 4), lab=torch.arange(2), batch_size=[2])]
    logs = {}
    for lib, model in (("tdhook", copy.deepcopy(net)), ("ours", net)):
        logs[lib] = record(lib, TensorDictModule(model, ["x"], ["y"]), pattern, batches, relative=relative,
                           additional_keys=["lab"])
    assert logs["ours"][0] == logs["tdhook"][0] and logs["ours"][0]
    assert_same_log(logs["tdhook"][1], logs["ours"][1])
    assert no_hooks(net)


def test_key_pattern_setter_changes_the_next_entry() -> None:
    made: list[Any] = []
    context = our_probing.Probing("linear1", lambda name, direction: made.append(name) or Recorder([], name, ""))
    context.key_pattern = "linear3"
    assert context.key_pattern == "linear3"
    with context.prepare(TdhookTestModel()):
        pass
    assert made == ["linear3"]


def test_model_unchanged_when_a_probe_raises() -> None:
    class Failing:
        def step(self, data: Any, **kwargs: Any) -> None:
            raise RuntimeError("probe failed")

    model = TdhookTestModel()
    before = snapshot(model)
    with our_probing.Probing("linear2", lambda name, direction: Failing()).prepare(model) as hooked:
        with pytest.raises(RuntimeError, match="probe failed"):
            hooked(TensorDict({"input": torch.randn(2, 10)}, batch_size=2))
    assert same(before, snapshot(model)) and no_hooks(model)


def test_a_failing_factory_leaves_nothing_registered() -> None:
    manager = our_probing.ProbeManager(our_estimators.LinearEstimator, {"d_latent": 20, "num_classes": 5, "epochs": 1},
                                       lambda p, y: {})
    manager.probe_factory("linear2", "fwd")  # taken: the context's second probe fails on entry
    model = TdhookTestModel()
    before = snapshot(model)
    context = our_probing.Probing("linear[12]", manager.probe_factory, additional_keys=["labels", "step_type"]
                                  ).prepare(model)
    with pytest.raises(ValueError, match="linear2_fwd already exists"):
        context.__enter__()
    assert same(before, snapshot(model)) and no_hooks(model)
    manager.reset_estimators()
    with context as hooked:  # the context was left closed: it can be entered again
        hooked(mlp_batches(1)[0])  # step_type "fit": both probes fit
    assert set(manager.fit_metrics) == {"linear1_fwd", "linear2_fwd"}


def test_missing_additional_key_is_named() -> None:
    context = our_probing.Probing("linear1", lambda name, direction: Recorder([], name, direction),
                                  additional_keys=["labels", "step_type"])
    with context.prepare(TdhookTestModel()) as hooked:
        with pytest.raises(KeyError, match="step_type"):
            hooked(TensorDict({"input": torch.randn(2, 10), "labels": torch.zeros(2)}, batch_size=2))


@pytest.mark.parametrize("lib", LIBS)
def test_a_nested_additional_key_hands_the_probe_its_top_entry(lib: str) -> None:
    log: list[Any] = []
    context = LIBS[lib].Probing("linear1", lambda name, direction: Recorder(log, name, direction),
                                additional_keys=[("meta", "labels"), "step_type"])
    labels = torch.arange(2)
    with context.prepare(TdhookTestModel()) as hooked:
        hooked(TensorDict(input=torch.randn(2, 10), meta={"labels": labels}, step_type="fit", batch_size=[2]))
    ((_, _, _, items),) = log
    assert set(items) == {"meta", "step_type"} and items["step_type"] == "fit"
    assert torch.equal(items["meta"]["labels"], labels)


# ---------------------------------------------------------------- managers and estimators end to end


def accuracy(predictions: Any, labels: Any) -> dict[str, float]:
    return {"accuracy": float((np.asarray(predictions) == np.asarray(labels)).mean())}


def probe_run(lib: str, model: nn.Module, make_manager: Callable[[Any], Any], bilinear: bool) -> Any:
    torch.manual_seed(0)
    manager = make_manager(lib)
    pattern = manager.key_pattern if bilinear else "linear1|linear2"
    context = LIBS[lib].Probing(pattern, manager.probe_factory, additional_keys=["labels", "step_type"])
    gen = torch.Generator().manual_seed(3)
    if bilinear:
        manager.before_all()
    with context.prepare(model) as hooked:
        for step_type in ("fit", "fit", "predict"):
            x = torch.randn(40, 10, generator=gen)
            batch = TensorDict({"input": x, "labels": (x[:, 0] > 0).long() + (x[:, 1] > 0).long(),
                                "step_type": step_type}, batch_size=40)
            hooked(batch)
    if bilinear:
        manager.after_all()
    return manager


def linear_manager(lib: str) -> Any:
    return LIBS[lib].ProbeManager(ESTIMATORS[lib].LinearEstimator,
                                  {"d_latent": 20, "num_classes": 3, "epochs": 4, "batch_size": 16},
                                  accuracy, allow_overwrite=True)


def bilinear_manager(estimator: str) -> Callable[[str], Any]:
    def make(lib: str) -> Any:
        return LIBS[lib].BilinearProbeManager(
            [("linear1", "linear2"), ("linear2", "linear2")], getattr(ESTIMATORS[lib], estimator),
            {"d_latent1": 20, "d_latent2": 20, "num_classes": 3, "epochs": 3, "batch_size": 16},
            accuracy, allow_overwrite=True)
    return make


@pytest.mark.parametrize(("make_manager", "bilinear"), [
    (linear_manager, False),
    (bilinear_manager("BilinearEstimator"), True),
    (bilinear_manager("LowRankBilinearEstimator"), True),
], ids=["linear", "bilinear", "low-rank"])
def test_managers_fit_and_score_as_tdhook(make_manager: Callable[[str], Any], bilinear: bool) -> None:
    torch.manual_seed(0)
    model = TdhookTestModel()
    before = snapshot(model)
    theirs = probe_run("tdhook", copy.deepcopy(model), make_manager, bilinear)
    ours = probe_run("ours", model, make_manager, bilinear)
    assert ours.fit_metrics == theirs.fit_metrics and ours.fit_metrics
    assert ours.predict_metrics == theirs.predict_metrics and ours.predict_metrics
    assert ours.estimators.keys() == theirs.estimators.keys()
    for key, estimator in theirs.estimators.items():
        for (name, value), (name2, value2) in zip(estimator.named_parameters(),
                                                  ours.estimators[key].named_parameters(), strict=True):
            assert name == name2
            torch.testing.assert_close(value2, value, rtol=1e-6, atol=1e-7)
    assert same(before, snapshot(model)) and no_hooks(model)


@pytest.mark.parametrize(("name", "kwargs", "inputs", "target"), [
    ("LinearEstimator", {"d_latent": 6, "num_classes": 4}, (6,), "class"),
    ("LinearEstimator", {"d_latent": 6, "bias": False}, (6,), "value"),
    ("BilinearEstimator", {"d_latent1": 6, "d_latent2": 5, "num_classes": 4, "bias": False}, (6, 5), "class"),
    ("LowRankBilinearEstimator", {"d_latent1": 6, "d_latent2": 5}, (6, 5), "value"),
    ("LowRankBilinearEstimator", {"d_latent1": 6, "d_latent2": 5, "num_classes": 3, "bias": False}, (6, 5),
     "class"),
], ids=["linear", "linear-regression", "bilinear", "low-rank-regression", "low-rank"])
def test_estimators_fit_tdhooks_parameters(name: str, kwargs: dict[str, Any], inputs: tuple[int, ...],
                                           target: str) -> None:
    gen = torch.Generator().manual_seed(5)
    xs = tuple(torch.randn(96, d, generator=gen) for d in inputs)
    y = (torch.randint(0, kwargs.get("num_classes", 1), (96,), generator=gen) if target == "class"
         else torch.randn(96, 1, generator=gen))
    fitted = {}
    for lib in ESTIMATORS:
        torch.manual_seed(0)
        estimator = getattr(ESTIMATORS[lib], name)(epochs=3, batch_size=32, lr=1e-2, **kwargs)
        fitted[lib] = (estimator.fit(*xs, y=y), torch.rand(3))  # and the global generator after the fit
    theirs, ours = fitted["tdhook"], fitted["ours"]
    torch.testing.assert_close(ours[1], theirs[1], rtol=0, atol=0)
    for (n, v), (n2, v2) in zip(theirs[0].named_parameters(), ours[0].named_parameters(), strict=True):
        assert n == n2
        torch.testing.assert_close(v2, v, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours[0].predict(*xs), theirs[0].predict(*xs), rtol=1e-6, atol=1e-6)


def two_layer_probe(lib: str) -> type:
    """A user's estimator: tdhook's (or our) TorchEstimator with its own forward and loss, and an unused layer."""

    class TwoLayer(ESTIMATORS[lib].TorchEstimator):  # type: ignore[misc, name-defined]
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.hidden, self.out, self.unused = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.tanh(self.hidden(x)))

        def _loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(output, target, label_smoothing=0.1)

    return TwoLayer


@pytest.mark.parametrize("case", ["subclass", "frozen-bias"])
def test_user_estimators_train_as_in_tdhook(case: str) -> None:
    """A subclass's own forward and loss are what is trained; a frozen parameter stays as it is."""
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(90, 6, generator=gen), torch.randint(0, 3, (90,), generator=gen)
    fitted = {}
    for lib in ESTIMATORS:
        torch.manual_seed(0)
        if case == "subclass":
            estimator = two_layer_probe(lib)(num_classes=3, epochs=4, batch_size=16, lr=1e-2)
        else:
            estimator = ESTIMATORS[lib].LinearEstimator(d_latent=6, num_classes=3, epochs=4, batch_size=16, lr=1e-2)
            estimator.linear.bias.requires_grad_(False)
        before = {n: v.detach().clone() for n, v in estimator.named_parameters()}
        fitted[lib] = (estimator.fit(x, y=y), before)
    for (n, v), (n2, v2) in zip(fitted["tdhook"][0].named_parameters(), fitted["ours"][0].named_parameters(),
                                strict=True):
        assert n == n2
        torch.testing.assert_close(v2, v, rtol=1e-6, atol=1e-7)
    frozen = "unused.weight" if case == "subclass" else "linear.bias"
    assert torch.equal(dict(fitted["ours"][0].named_parameters())[frozen], fitted["ours"][1][frozen])
    changed = "out.weight" if case == "subclass" else "linear.weight"
    assert not torch.equal(dict(fitted["ours"][0].named_parameters())[changed], fitted["ours"][1][changed])


def test_estimator_refuses_inputs_and_targets_of_other_lengths() -> None:
    estimator = our_estimators.LinearEstimator(d_latent=3, num_classes=2, epochs=1)
    with pytest.raises(ValueError, match=r"inputs of \[5\] rows for 4 targets"):
        estimator.fit(torch.randn(5, 3), y=torch.zeros(4, dtype=torch.long))


# ---------------------------------------------------------------- the mean-difference classifier


def digits_pair() -> tuple[np.ndarray, np.ndarray]:
    data = load_digits()
    keep = np.isin(data.target, (3, 8))
    return data.data[keep] / 16.0, (data.target[keep] == 8).astype(np.int64)


@pytest.mark.parametrize("normalize", [True, False])
def test_mean_difference_matches_tdhook_on_digits(normalize: bool) -> None:
    x, y = digits_pair()
    theirs, ours = td_estimators.MeanDifferenceClassifier(normalize), our_estimators.MeanDifferenceClassifier(normalize)
    theirs.fit(x, y)
    ours.fit(x, y)
    np.testing.assert_allclose(ours.coef_, theirs.coef_, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ours.intercept_, theirs.intercept_, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(ours.predict(x), theirs.predict(x))
    np.testing.assert_allclose(ours.predict_proba(x), theirs.predict_proba(x), rtol=1e-12, atol=1e-12)
    assert ours.coef_.shape == (1, x.shape[1]) and ours.intercept_.shape == (1,)
    assert (ours.predict(x) == y).mean() > 0.8


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("kind", ["tensor", "array"])
def test_mean_difference_gives_tdhooks_kinds_and_dtypes(kind: str, normalize: bool) -> None:
    """tdhook's arithmetic: float64 weights from float32 samples and integer labels; a tensor's predictions are
    a bool tensor (what a probe manager hands compute_metrics), its direction a tensor."""
    torch.manual_seed(0)
    x, y = torch.randn(40, 6), (torch.rand(40) > 0.4).long()
    data, labels = (x, y) if kind == "tensor" else (x.numpy(), y.numpy())
    theirs, ours = td_estimators.MeanDifferenceClassifier(normalize), our_estimators.MeanDifferenceClassifier(normalize)
    theirs.fit(data, labels)
    ours.fit(data, labels)
    for name in ("coef_", "intercept_", "predict", "predict_proba"):
        ref, got = getattr(theirs, name), getattr(ours, name)
        ref, got = (ref(data), got(data)) if callable(ref) else (ref, got)
        assert type(got) is type(ref) and got.dtype == ref.dtype, name
        np.testing.assert_allclose(np.asarray(got, dtype=float), np.asarray(ref, dtype=float), rtol=0, atol=1e-15)


@pytest.mark.parametrize("lib", LIBS)
def test_mean_difference_in_a_probe_manager_hands_metrics_tensors(lib: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(64, 4)
    labels = (x[:, 0] > 0).long()

    def metrics(predicted: Any, expected: Any) -> dict[str, float]:  # written for tdhook's tensors
        return {"accuracy": (predicted == expected).float().mean().item(), "rate": predicted.float().mean().item()}

    manager = LIBS[lib].ProbeManager(LIBS[lib].MeanDifferenceClassifier, {}, metrics)
    with LIBS[lib].Probing("0", manager.probe_factory, additional_keys=["labels", "step_type"]).prepare(model) as h:
        for step in ("fit", "predict"):
            h(TensorDict(input=x, labels=labels, step_type=step, batch_size=[64]))
    assert manager.predict_metrics["0_fwd"]["accuracy"] > 0.7
    assert isinstance(manager.estimators["0_fwd"].coef_, torch.Tensor)


@pytest.mark.parametrize(("y", "match"), [
    (np.array([0, 1, 2, 1]), "0/1 labels"),
    (np.array([1, 1, 1, 1]), "Both classes must be present"),
    (np.array([1, 0, 1]), "shape"),
])
def test_mean_difference_refuses_bad_labels(y: np.ndarray, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        our_estimators.MeanDifferenceClassifier().fit(np.random.randn(4, 3), y)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(-5, 5), st.booleans())
def test_mean_difference_axioms(seed: int, shift: float, normalize: bool) -> None:
    """The midpoint of the class means is even odds; shifting every sample keeps the direction."""
    x = np.random.default_rng(seed).normal(size=(12, 4))
    y = np.array([0, 1] * 6)
    classifier = our_estimators.MeanDifferenceClassifier(normalize)
    classifier.fit(x, y)
    midpoint = (x[y == 1].mean(0) + x[y == 0].mean(0)) / 2
    np.testing.assert_allclose(classifier.predict_proba(midpoint[None]), [[0.5, 0.5]], rtol=0, atol=1e-12)
    shifted = our_estimators.MeanDifferenceClassifier(normalize)
    shifted.fit(x + shift, y)
    np.testing.assert_allclose(shifted.coef_, classifier.coef_, rtol=1e-10, atol=1e-10)


def test_two_class_proba() -> None:
    scores = torch.tensor([[-2.0, 0.0], [1.0, 30.0]], dtype=torch.float64)
    proba = two_class_proba(scores)
    assert proba.shape == (2, 2, 2) and proba.dtype == torch.float64
    torch.testing.assert_close(proba[..., 1], torch.sigmoid(scores))
    torch.testing.assert_close(proba.sum(-1), torch.ones(2, 2, dtype=torch.float64))


# ---------------------------------------------------------------- the training functions


def test_probe_scores_are_the_documented_forms() -> None:
    gen = torch.Generator().manual_seed(0)
    h1, h2 = torch.randn(7, 4, generator=gen), torch.randn(7, 3, generator=gen)
    p = {"linear1.weight": torch.randn(2, 4, generator=gen), "linear1.bias": torch.randn(2, generator=gen),
         "linear2.weight": torch.randn(2, 3, generator=gen), "linear2.bias": torch.randn(2, generator=gen),
         "bias": torch.randn(2, generator=gen)}
    expected = (h1 @ p["linear1.weight"].T + p["linear1.bias"]) * (h2 @ p["linear2.weight"].T + p["linear2.bias"])
    torch.testing.assert_close(probe_scores("low_rank_bilinear", p, h1, h2), expected + p["bias"])
    a = {"bilinear.weight": torch.randn(2, 4, 3, generator=gen)}
    expected = torch.einsum("ni,cij,nj->nc", h1, a["bilinear.weight"], h2)
    torch.testing.assert_close(probe_scores("bilinear", a, h1, h2), expected)
    with pytest.raises(ValueError, match="expects 2 input"):
        probe_scores("bilinear", a, h1)
    with pytest.raises(ValueError, match="kind must be one of"):
        probe_scores("quadratic", a, h1)


def test_adam_epoch_is_torch_adam_and_pure() -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(50, 4, generator=gen), torch.randint(0, 3, (50,), generator=gen)
    order = torch.randperm(50, generator=gen)
    module = nn.Linear(4, 3)
    params = {f"linear.{n}": v.detach().clone() for n, v in module.named_parameters()}
    initial, before = dict(params), {n: v.clone() for n, v in params.items()}
    state = adam_init(params)
    for _ in range(2):
        params, state = adam_epoch("linear", params, state, (x,), y, order, num_classes=3, lr=0.05, batch_size=16)
    optimizer = torch.optim.Adam(module.parameters(), lr=0.05)
    for _ in range(2):
        for batch in order.split(16):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(module(x[batch]), y[batch]).backward()
            optimizer.step()
    assert state.step == {"linear.weight": 8, "linear.bias": 8}
    for n, v in module.named_parameters():
        torch.testing.assert_close(params[f"linear.{n}"], v.detach(), rtol=1e-6, atol=1e-7)
    assert all(torch.equal(initial[n], before[n]) for n in before)  # the given tensors are not written
    with pytest.raises(ValueError, match="permutation of the 50 samples"):
        adam_epoch("linear", params, state, (x,), y, order[:10], num_classes=3)


def test_probe_loss_names_the_shapes() -> None:
    with pytest.raises(ValueError, match=r"does not match target shape.*reshape y to \(N, 1\)"):
        probe_loss(torch.zeros(4, 1), torch.zeros(4), num_classes=None)
    with pytest.raises(ValueError, match=r"does not match target shape.*\(N,\) indices"):
        probe_loss(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long), num_classes=3)


class Pause(nn.Module):
    """Gives other threads the interpreter between a call's start and the probed module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.002)
        return x


def test_threads_calling_one_context_see_their_own_items() -> None:
    """Each probe call gets the labels of its own input, with threads calling one hooked module at once."""
    import threading

    seen: list[bool] = []

    class Check:
        def step(self, data: Any, **kwargs: Any) -> None:
            seen.append(torch.equal(data[:, 0], kwargs["labels"]))  # the Identity's output is the input

    model = nn.Sequential(Pause(), nn.Identity(), nn.Linear(10, 2))
    context = our_probing.Probing("1", lambda name, direction: Check(), additional_keys=["labels"])
    with context.prepare(model) as hooked:
        def work(tag: float) -> None:
            for _ in range(25):
                x = torch.randn(3, 10)
                x[:, 0] = tag
                hooked(TensorDict({"input": x, "labels": torch.full((3,), tag)}, batch_size=3))

        threads = [threading.Thread(target=work, args=(float(tag),)) for tag in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(seen) == 100 and all(seen)
    assert no_hooks(model)
