"""Probes against scikit-learn (Ridge, RidgeClassifier, LogisticRegression) and tdhook's mean-difference classifier."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression, Ridge, RidgeClassifier
from tensordict import TensorDict

from tdhook_fn.latent.probing import (
    decision_function,
    fit_probes,
    merge_ridge_statistics,
    predict_probes,
    ridge_statistics,
    score_probes,
    solve_ridge,
)

TIGHT = {"rtol": 1e-9, "atol": 1e-9}


@pytest.fixture(scope="module")
def digits():
    x, y = load_digits(return_X_y=True)
    return x / 16.0, y


def _sites(x: np.ndarray) -> dict[str, np.ndarray]:
    """Three 'layers' of different widths, one shifted and scaled (the intercept is exercised)."""
    return {"a": x, "b": x[:, :32] * 3 + 2, "c": np.tanh(x[:, 16:48] - 0.5)}


def _td(sites: dict[str, np.ndarray]) -> TensorDict:
    return TensorDict({k: torch.tensor(v) for k, v in sites.items()}, batch_size=[next(iter(sites.values())).shape[0]])


@pytest.mark.parametrize("alpha", [0.01, 1.0, 30.0])
@pytest.mark.parametrize("fit_intercept", [True, False])
def test_ridge_classifier_equals_sklearn_per_site(digits, alpha, fit_intercept):
    x, y = digits
    sites = _sites(x)
    acts, labels = _td(sites), torch.tensor(y)
    probes = fit_probes(acts, labels, alpha=alpha, fit_intercept=fit_intercept)
    predicted, scores = predict_probes(probes, acts), score_probes(probes, acts, labels)
    decisions = decision_function(probes, acts)
    for key, value in sites.items():
        oracle = RidgeClassifier(alpha=alpha, fit_intercept=fit_intercept).fit(value, y)
        torch.testing.assert_close(probes[key, "weight"], torch.tensor(oracle.coef_), **TIGHT)
        torch.testing.assert_close(probes[key, "bias"], torch.tensor(np.broadcast_to(oracle.intercept_, (10,))),
                                   **TIGHT)
        torch.testing.assert_close(decisions[key], torch.tensor(oracle.decision_function(value)), **TIGHT)
        assert predicted[key].tolist() == oracle.predict(value).tolist()
        assert scores[key].item() == pytest.approx(oracle.score(value, y), abs=1e-12)


def test_binary_ridge_classifier_one_column_and_sign(digits):
    """Two classes: one column of +-1 targets, the prediction is the sign, the labels are the classes given."""
    x, y = digits
    labels = np.where(y % 2 == 0, 7, -3)
    probes = fit_probes(torch.tensor(x), torch.tensor(labels), alpha=2.0)
    oracle = RidgeClassifier(alpha=2.0).fit(x, labels)
    assert probes["weight"].shape == (1, 64)
    # scikit-learn 1.9 gives this coef_ as (64,), LogisticRegression's as (1, 64): ours is (1, 64) for both
    torch.testing.assert_close(probes["weight"], torch.tensor(oracle.coef_).reshape(1, 64), **TIGHT)
    torch.testing.assert_close(probes["bias"], torch.tensor(oracle.intercept_).reshape(1), **TIGHT)
    assert predict_probes(probes, torch.tensor(x)).tolist() == oracle.predict(x).tolist()


@pytest.mark.parametrize("n", [40, 300])  # fewer samples than features: the dual system
@pytest.mark.parametrize("outputs", [None, 3])
@pytest.mark.parametrize("fit_intercept", [True, False])
def test_ridge_regression_equals_sklearn(n, outputs, fit_intercept):
    g = np.random.default_rng(n)
    x = g.normal(size=(n, 120)) * g.uniform(0.1, 3, size=120) + g.normal(size=120)
    y = x[:, :5] @ g.normal(size=(5, outputs or 1)) + g.normal(size=(n, outputs or 1)) + 4
    y = y[:, 0] if outputs is None else y
    probes = fit_probes(torch.tensor(x), torch.tensor(y), alpha=0.7, fit_intercept=fit_intercept)
    oracle = Ridge(alpha=0.7, fit_intercept=fit_intercept).fit(x, y)
    torch.testing.assert_close(probes["weight"], torch.tensor(oracle.coef_), rtol=1e-8, atol=1e-9)
    intercept = np.broadcast_to(oracle.intercept_, probes["bias"].shape).copy()  # 0.0 without an intercept
    torch.testing.assert_close(probes["bias"], torch.as_tensor(intercept, dtype=torch.float64),
                               rtol=1e-8, atol=1e-9)
    torch.testing.assert_close(predict_probes(probes, torch.tensor(x)), torch.tensor(oracle.predict(x)),
                               rtol=1e-8, atol=1e-8)
    assert score_probes(probes, torch.tensor(x), torch.tensor(y)).item() == pytest.approx(oracle.score(x, y), abs=1e-10)


@pytest.mark.parametrize("C", [0.1, 1.0])
@pytest.mark.parametrize("binary", [True, False])
def test_logistic_equals_sklearn(digits, C, binary):
    x, y = digits
    x, y = x[:300], (y[:300] > 4).astype(int) if binary else y[:300]
    sites = {"a": x[:, ::2], "b": x[:, 1::2] * 2 - 1}  # one width: one batched Newton solve
    probes = fit_probes(_td(sites), torch.tensor(y), kind="logistic", C=C)
    for key, value in sites.items():
        oracle = LogisticRegression(C=C, tol=1e-12, max_iter=20000).fit(value, y)
        torch.testing.assert_close(probes[key, "weight"], torch.tensor(oracle.coef_), rtol=0, atol=1e-4)
        torch.testing.assert_close(probes[key, "bias"], torch.tensor(oracle.intercept_), rtol=0, atol=1e-4)
        single = TensorDict(weight=probes[key, "weight"], bias=probes[key, "bias"], classes=probes[key, "classes"])
        assert predict_probes(single, torch.tensor(value)).tolist() == oracle.predict(value).tolist()


def test_logistic_without_intercept_equals_sklearn(digits):
    x, y = digits
    x, y = x[:300, ::2], y[:300]
    probes = fit_probes(torch.tensor(x), torch.tensor(y), kind="logistic", fit_intercept=False)
    oracle = LogisticRegression(fit_intercept=False, tol=1e-12, max_iter=20000).fit(x, y)
    torch.testing.assert_close(probes["weight"], torch.tensor(oracle.coef_), rtol=0, atol=1e-4)
    assert (probes["bias"] == 0).all()


def test_mean_difference_equals_tdhook(digits):
    estimators = pytest.importorskip("tdhook.latent.probing.estimators")
    x, y = digits
    labels = (y > 4).astype(int)
    for normalize in (True, False):
        oracle = estimators.MeanDifferenceClassifier(normalize=normalize)
        oracle.fit(x, labels)
        probes = fit_probes(torch.tensor(x), torch.tensor(labels), kind="mean_difference", normalize=normalize)
        torch.testing.assert_close(probes["weight"], torch.tensor(oracle.coef_), **TIGHT)
        torch.testing.assert_close(probes["bias"], torch.tensor(oracle.intercept_), **TIGHT)
        assert predict_probes(probes, torch.tensor(x)).tolist() == oracle.predict(x).astype(int).tolist()


@pytest.mark.parametrize("kind", ["ridge", "logistic", "mean_difference"])
def test_batched_equals_each_site(kind):
    """A stack of sites (leading dim) gives each site's own probe."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 120, 10, generator=g, dtype=torch.float64)
    labels = (x[0, :, 0] + 0.5 * torch.randn(120, generator=g, dtype=torch.float64) > 0).long()
    batched = fit_probes(x, labels, kind=kind)
    assert batched.batch_size == (4,)
    tolerance = 1e-7 if kind == "logistic" else 1e-10  # Newton stops when no step moves more than tol=1e-8
    for i in range(4):
        alone = fit_probes(x[i], labels, kind=kind)
        for key in ("weight", "bias"):
            torch.testing.assert_close(batched[key][i], alone[key], rtol=tolerance, atol=tolerance)
        assert (predict_probes(batched, x)[i] == predict_probes(alone, x[i])).all()


@pytest.mark.parametrize("size", [160, 190])
def test_batched_solve_is_right_at_sizes_torch_solve_gets_wrong(size):
    """Six systems of 160 (190) with 2 threads: where torch's batched CPU linalg.solve (inv) fails."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(size)
        x = torch.randn(6, 400, size, generator=g, dtype=torch.float64)
        y = torch.randn(400, 3, generator=g, dtype=torch.float64)
        probes = fit_probes(x, y, alpha=0.5)
    finally:
        torch.set_num_threads(threads)
    for i in range(6):
        oracle = Ridge(alpha=0.5).fit(x[i].numpy(), y.numpy())
        torch.testing.assert_close(probes["weight"][i], torch.tensor(oracle.coef_), rtol=1e-8, atol=1e-10)


def test_dtype_kept():
    x = torch.randn(50, 4)
    labels = torch.arange(50) % 3
    for kind in ("ridge", "logistic", "mean_difference"):
        labs = labels % 2 if kind == "mean_difference" else labels
        assert fit_probes(x, labs, kind=kind)["weight"].dtype == torch.float32
        assert fit_probes(x.double(), labs, kind=kind)["weight"].dtype == torch.float64


@pytest.mark.parametrize("kind", ["ridge", "logistic"])
def test_vmap_equals_batched(kind):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 80, 6, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 3, (80,), generator=g)
    classes = torch.arange(3)
    batched = fit_probes(x, labels, kind=kind, classes=classes)
    mapped = torch.vmap(lambda a: fit_probes(a, labels, kind=kind, classes=classes, max_iter=30))(x)
    torch.testing.assert_close(mapped["weight"], batched["weight"], rtol=1e-8, atol=1e-8)
    predicted = torch.vmap(predict_probes)(batched, x)
    assert (predicted == predict_probes(batched, x)).all()


def test_alpha_per_batch_element():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(60, 5, generator=g, dtype=torch.float64), torch.randn(60, generator=g, dtype=torch.float64)
    alphas = torch.tensor([0.0, 1.0, 100.0], dtype=torch.float64)
    swept = fit_probes(x.expand(3, -1, -1), y, alpha=alphas)
    for i, alpha in enumerate(alphas.tolist()):
        torch.testing.assert_close(swept["weight"][i], fit_probes(x, y, alpha=alpha)["weight"], **TIGHT)


@settings(max_examples=10, deadline=None)
@given(cuts=st.lists(st.integers(1, 149), max_size=5, unique=True), intercept=st.booleans())
def test_streamed_statistics_equal_in_memory(cuts, intercept):
    """Statistics merged over any split of the samples solve to the in-memory probe."""
    g = torch.Generator().manual_seed(4)
    acts = TensorDict(a=torch.randn(150, 6, generator=g, dtype=torch.float64) * 5 + 30,
                      b=torch.randn(150, 9, generator=g, dtype=torch.float64), batch_size=[150])
    labels = torch.randint(0, 4, (150,), generator=g)
    bounds = [0, *sorted(cuts), 150]
    parts = [ridge_statistics(acts[i:j], labels[i:j], classes=torch.arange(4)) for i, j in itertools.pairwise(bounds)]
    stats = parts[0]
    for part in parts[1:]:
        stats = merge_ridge_statistics(stats, part)
    streamed = solve_ridge(stats, alpha=0.2, fit_intercept=intercept)
    direct = fit_probes(acts, labels, alpha=0.2, fit_intercept=intercept)
    for key in ("a", "b"):
        torch.testing.assert_close(streamed[key, "weight"], direct[key, "weight"], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(streamed[key, "bias"], direct[key, "bias"], rtol=1e-9, atol=1e-10)
        assert (streamed[key, "classes"] == direct[key, "classes"]).all()


def test_streamed_regression_on_a_tensor():
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(2, 90, 4, generator=g, dtype=torch.float64), torch.randn(90, generator=g, dtype=torch.float64)
    stats = merge_ridge_statistics(ridge_statistics(x[:, :30], y[:30]), ridge_statistics(x[:, 30:], y[30:]))
    torch.testing.assert_close(solve_ridge(stats)["weight"], fit_probes(x, y)["weight"], **TIGHT)


def test_inputs_are_not_modified(digits):
    x, y = digits
    acts, labels = _td(_sites(x)), torch.tensor(y)
    before, labels_before = acts.clone(), labels.clone()
    for kind in ("ridge", "mean_difference"):
        fit_probes(acts, labels % 2 if kind == "mean_difference" else labels, kind=kind)
    fit_probes(acts.exclude("a"), labels, kind="logistic", max_iter=40)
    assert (acts == before).all() and (labels == labels_before).all()


ERRORS = [
    (lambda a, y: fit_probes(a, y[:-1]), ValueError, "N=1797"),
    (lambda a, y: fit_probes(a, y, kind="svm"), ValueError, "kind must be"),
    (lambda a, y: fit_probes(a, y * 0), ValueError, "at least 2"),
    (lambda a, y: fit_probes(a, y, kind="mean_difference"), ValueError, "exactly 2"),
    (lambda a, y: fit_probes(a, y, alpha=-1.0), ValueError, "alpha must be >= 0"),
    (lambda a, y: fit_probes(a, y, kind="logistic", C=0.0), ValueError, "C must be"),
    (lambda a, y: fit_probes(a.set("b", a["b"].clone().index_fill_(0, torch.tensor([3]), float("nan"))), y),
     ValueError, "'b' holds NaN"),
    (lambda a, y: fit_probes(TensorDict(a=a["a"], b=torch.zeros(5, 3)), y), ValueError, r"'b'\] has N=5"),
    (lambda a, y: fit_probes(TensorDict(a=a["b"], c=torch.ones(1797, 4, dtype=torch.float64)), y, alpha=0.0,
                             fit_intercept=False), ValueError, "'c' are singular"),
    (lambda a, y: fit_probes(a.set("b", a["b"].long()), y), TypeError, "floating point"),
    (lambda a, y: fit_probes(a, y, kind="logistic", task="regression"), ValueError, "classifier"),
    (lambda a, y: predict_probes(fit_probes(a, y), a.exclude("b")), ValueError, "no site 'b'"),
]


@pytest.mark.parametrize(("call", "exc", "words"), ERRORS)
def test_bad_input_names_the_argument(digits, call, exc, words):
    x, y = digits
    with pytest.raises(exc, match=words):
        call(_td(_sites(x)), torch.tensor(y))


def test_logistic_by_conjugate_gradients_equals_sklearn(digits):
    """10 classes x 129 unknowns each: past the size whose Hessian is formed, solved by Hessian-vector products."""
    x, y = digits
    x = np.concatenate([x, x**2], 1)[:300]
    y = y[:300]
    probes = fit_probes(torch.tensor(x), torch.tensor(y), kind="logistic", C=0.5)
    oracle = LogisticRegression(C=0.5, tol=1e-12, max_iter=20000).fit(x, y)
    torch.testing.assert_close(probes["weight"], torch.tensor(oracle.coef_), rtol=0, atol=1e-4)
    torch.testing.assert_close(probes["bias"], torch.tensor(oracle.intercept_), rtol=0, atol=1e-4)


def test_mean_difference_refuses_a_class_without_samples():
    """``classes=`` names a class this data lacks: its mean does not exist, so the probe would be nan and predict
    class 0 everywhere (tdhook's classifier raises too)."""
    x = torch.randn(30, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"mean_difference.*class 1 has none"):
        fit_probes(x, torch.zeros(30, dtype=torch.long), kind="mean_difference", classes=torch.tensor([0, 1]))


def test_a_tensor_alpha_with_sites_is_refused():
    """A tensor of penalties sweeps one tensor's leading dims; over a TensorDict of sites it was broadcast over
    each stack of alike widths, so which site took which penalty depended on the stacking."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(30, 4, generator=g, dtype=torch.float64), torch.randn(30, generator=g, dtype=torch.float64)
    acts = TensorDict(a=x, w=torch.randn(30, 6, generator=g, dtype=torch.float64), b=2 * x, batch_size=[30])
    alpha = torch.tensor([1.0, 100.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"fit_probes: alpha is a tensor of shape \[2\].*TensorDict of sites"):
        fit_probes(acts, y, alpha=alpha)
    with pytest.raises(ValueError, match=r"solve_ridge: alpha is a tensor of shape \[2\]"):
        solve_ridge(ridge_statistics(acts, y), alpha=alpha)
    one = fit_probes(acts, y, alpha=torch.tensor(1.0, dtype=torch.float64))  # one penalty, as a 0-d tensor: fine
    torch.testing.assert_close(one, fit_probes(acts, y, alpha=1.0))
    swept = fit_probes(x.expand(2, 30, 4), y, alpha=alpha)  # over a tensor's leading dims: each its own
    torch.testing.assert_close(swept["weight"][1], fit_probes(x, y, alpha=100.0)["weight"])
