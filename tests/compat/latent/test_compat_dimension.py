"""compat's dimension estimators against tdhook 0.1.3's: same keys, shapes and numbers where tdhook is right."""

import pytest
import tdhook.latent.dimension_estimation as theirs
import torch
from tensordict import TensorDict

import tdhook_fn.compat.latent.dimension_estimation as ours


def _td(x):
    return TensorDict({"acts": x}, batch_size=x.shape[:-2])


def _points(seed, shape=(2, 90, 10), flat_from=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[..., flat_from:] *= 0.03
    return x


def _assert_tdhooks(ours_value, theirs_value):
    """tdhook's number, to float32 rounding: ours centres the points before their distances and tdhook does not,
    so in float32 the two round differently (NOTE [exact duplicates]; in float64 they agree to 1e-6)."""
    torch.testing.assert_close(ours_value, theirs_value, rtol=1e-4, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("return_xy", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_twonn_equals_tdhook(seed, return_xy):
    x = _points(seed)
    kwargs = {"in_key": "acts", "out_key": "id", "return_xy": return_xy}
    a, b = ours.TwoNnDimensionEstimator(**kwargs)(_td(x)), theirs.TwoNnDimensionEstimator(**kwargs)(_td(x))
    assert set(a.keys()) == set(b.keys())
    for key in b.keys():
        if key != "acts":
            assert a[key].shape == b[key].shape
            _assert_tdhooks(a[key], b[key])


@pytest.mark.parametrize("k", [2, 5, "auto"])
def test_local_knn_equals_tdhook(k):
    x = _points(2)
    a = ours.LocalKnnDimensionEstimator(k=k, in_key="acts")(_td(x))["dimension"]
    _assert_tdhooks(a, theirs.LocalKnnDimensionEstimator(k=k, in_key="acts")(_td(x))["dimension"])


@pytest.mark.parametrize("k", [2, 5, "auto"])
def test_local_knn_in_float64_equals_tdhook(k):
    x = _points(2).double()
    a = ours.LocalKnnDimensionEstimator(k=k, in_key="acts")(_td(x))["dimension"]
    b = theirs.LocalKnnDimensionEstimator(k=k, in_key="acts")(_td(x))["dimension"]  # (float32: docs/compat.md)
    torch.testing.assert_close(a, b.double(), rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("criterion", ["maxgap", "ratio"])
@pytest.mark.parametrize("k", [3, "auto"])
def test_local_pca_equals_tdhook(criterion, k):
    x = _points(3)
    a = ours.LocalPcaDimensionEstimator(k=k, criterion=criterion, in_key="acts")(_td(x))["dimension"]
    b = theirs.LocalPcaDimensionEstimator(k=k, criterion=criterion, in_key="acts")(_td(x))["dimension"]
    torch.testing.assert_close(a, b)


def test_local_pca_default_is_right_where_tdhooks_answers_k():
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(32, 3, generator=g)).Q.T
    x = torch.randn(300, 3, generator=g) @ basis + 0.01 * torch.randn(300, 32, generator=g)
    assert (theirs.LocalPcaDimensionEstimator(k=10, in_key="acts")(_td(x))["dimension"] == 10).all()
    a = ours.LocalPcaDimensionEstimator(k=10, in_key="acts")(_td(x))["dimension"]
    assert (a == 3).float().mean() > 0.95


@pytest.mark.parametrize("k", [1, 6, "auto"])
def test_ca_pca_equals_tdhook(k):
    x = _points(4, shape=(3, 60, 6), flat_from=3)
    a = ours.CaPcaDimensionEstimator(k=k, in_key="acts")(_td(x))["dimension"]
    b = theirs.CaPcaDimensionEstimator(k=k, in_key="acts")(_td(x))["dimension"]
    differ = a != b  # only where tdhook answers a dimension without the spread for it (docs/compat.md)
    assert differ.double().mean() < 0.05
    assert (b[differ] > a[differ]).all()


def test_float64_kept_and_input_untouched():
    x = _points(5).double()
    before = x.clone()
    td = _td(x)
    out = ours.TwoNnDimensionEstimator(in_key="acts")(td)
    assert out is td and out["dimension"].dtype == torch.float64
    assert torch.equal(td["acts"], before)
    torch.testing.assert_close(out["dimension"],
                               theirs.TwoNnDimensionEstimator(in_key="acts")(_td(x))["dimension"].double())


@pytest.mark.parametrize("name", ["TwoNnDimensionEstimator", "LocalKnnDimensionEstimator",
                                  "LocalPcaDimensionEstimator", "CaPcaDimensionEstimator"])
def test_repr_and_keys_as_tdhook(name):
    kwargs = {} if name == "TwoNnDimensionEstimator" else {"k": 3}
    a, b = getattr(ours, name)(**kwargs), getattr(theirs, name)(**kwargs)
    assert a.in_keys == b.in_keys and a.out_keys == b.out_keys
    assert repr(a).splitlines()[:3] == repr(b).splitlines()[:3]


@pytest.mark.parametrize(
    ("build", "x", "error", "match"),
    [
        (lambda m: m.TwoNnDimensionEstimator(), torch.randn(2, 5), ValueError, "At least 3 points"),
        (lambda m: m.TwoNnDimensionEstimator(), torch.ones(5, 3), ValueError, "At least 3 valid points"),
        (lambda m: m.LocalKnnDimensionEstimator(k=2), torch.randn(4, 5), ValueError, r"At least 2k\+1 points"),
        (lambda m: m.LocalPcaDimensionEstimator(k=5), torch.randn(5, 5), ValueError, r"At least k\+1 points"),
        (lambda m: m.LocalPcaDimensionEstimator(k=2, criterion="x"), torch.randn(9, 5), ValueError,
         "Unknown criterion"),
        (lambda m: m.CaPcaDimensionEstimator(k=5), torch.randn(6, 5), ValueError, r"At least k\+2 points"),
    ],
)
def test_errors_as_tdhook(build, x, error, match):
    for module in (ours, theirs):
        with pytest.raises(error, match=match):
            build(module)(TensorDict({"data": x}, batch_size=[]))


def test_k_checks_as_tdhook():
    for module in (ours, theirs):
        with pytest.raises(ValueError, match="k must be greater than 1"):
            module.LocalKnnDimensionEstimator(k=1)
        with pytest.raises(TypeError, match="k must be an int or 'auto'"):
            module.CaPcaDimensionEstimator(k=2.5)


def test_twonn_on_a_regular_grid_says_why_it_has_no_answer():
    """Every point's two nearest neighbours equally far: all ratios are 1, no slope (tdhook answers 0.0, which is
    no dimension of a grid); the message says so, not that points are missing."""
    grid = torch.stack(torch.meshgrid(torch.arange(6.0), torch.arange(6.0), indexing="ij"), -1).reshape(-1, 2)
    with pytest.raises(ValueError, match="equally far"):
        ours.TwoNnDimensionEstimator()(TensorDict(data=grid))
    with pytest.raises(ValueError, match="At least 3 valid points"):
        ours.TwoNnDimensionEstimator()(TensorDict(data=torch.ones(5, 2)))
