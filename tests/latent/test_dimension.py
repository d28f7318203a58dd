"""Intrinsic dimension estimators: hand-written loops and tdhook 0.1.3 as oracles, noisy manifolds, batching."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tdhook.latent.dimension_estimation import (
    CaPcaDimensionEstimator,
    LocalKnnDimensionEstimator,
    LocalPcaDimensionEstimator,
    TwoNnDimensionEstimator,
)
from tensordict import TensorDict

from tdhook_fn.latent.dimension import ca_pca, local_knn, local_pca, two_nn

# ---------------------------------------------------------------- references: plain loops, float64 numpy


def _neighbour_lists(x, eps=1e-5):
    """Per point: (distance, index) of the other points farther than eps, nearest first."""
    x = np.asarray(x, dtype=np.float64)
    out = []
    for i in range(len(x)):
        row = [(float(np.linalg.norm(x[i] - x[j])), j) for j in range(len(x)) if j != i]
        out.append(sorted(p for p in row if p[0] > eps))
    return out


def _two_nn_loop(x, discard_fraction):
    mus = sorted(r[1][0] / r[0][0] for r in _neighbour_lists(x) if len(r) >= 2)
    n = len(mus)
    kept = min(math.floor(n * (1 - discard_fraction) + 1e-9), n - 1)  # 10 * (1 - 0.3) is 6.999...
    sxy = sxx = 0.0
    for i in range(1, kept + 1):
        lx, ly = math.log(mus[i - 1]), -math.log(1 - i / n)
        sxy += lx * ly
        sxx += lx * lx
    return sxy / sxx


def _local_knn_loop(x, k):
    out = []
    for r in _neighbour_lists(x):
        ok = len(r) >= 2 * k and r[2 * k - 1][0] > r[k - 1][0]
        out.append(math.log(2) / math.log(r[2 * k - 1][0] / r[k - 1][0]) if ok else math.nan)
    return out


def _spectrum(points, k):
    centred = points - points.mean(0)
    return np.sort(np.clip(np.linalg.svd(centred, compute_uv=False) ** 2 / k, 0, None))[::-1]


def _local_pca_loop(x, k, criterion):
    x = np.asarray(x, dtype=np.float64)
    out = []
    for i, r in enumerate(_neighbour_lists(x)):
        if len(r) < k:
            out.append(math.nan)
            continue
        lam = _spectrum(x[[i] + [j for _, j in r[:k]]], k)[: min(k + 1, x.shape[1])]
        if criterion == "ratio":
            out.append(max(1, int(sum(v > 0.05 * lam[0] for v in lam))))
        elif criterion == "maxgap":
            out.append(1 + int(np.argmax([lam[j] / (lam[j + 1] + 1e-15) for j in range(len(lam) - 1)])))
        else:  # gap: the usable eigenvalues, floored denominators
            use = lam[: min(k, len(lam))]
            lower_median = sorted(use)[(len(use) - 1) // 2]  # torch.median's: the lower of the middle two
            floor = max(math.sqrt(np.finfo(np.float64).eps) * use[0], 0.1 * lower_median)
            gaps = [use[j] / max(use[j + 1], floor) for j in range(len(use) - 1)]
            out.append(1 + int(np.argmax(gaps)) if gaps else 1)
    return out


def _ca_pca_loop(x, k, support=0.01):
    x = np.asarray(x, dtype=np.float64)
    D = x.shape[1]
    out = []
    for r in _neighbour_lists(x):
        if len(r) < k + 1:
            out.append(math.nan)
            continue
        radius = (r[k - 1][0] + r[k][0]) / 2
        lam = np.zeros(D)
        spectrum = _spectrum(x[[j for _, j in r[: k + 1]]], k)[:D]
        lam[: len(spectrum)] = spectrum / radius**2
        scores = []
        for d in range(1, D + 1):
            tail = lam[d:].sum()
            adjusted = lam[:d] + (3 * d + 4) / (d * (d + 4)) * tail
            spread = d == 1 or lam[d - 1] >= support * lam[0]
            scores.append(float(np.linalg.norm(adjusted - 1 / (d + 2))) + 2 * tail if spread else math.inf)
        out.append(1 + int(np.argmin(scores)))
    return out


def _cloud(seed, n=60, dim=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g, dtype=dtype)


def _t(values):
    return torch.tensor(values, dtype=torch.float64)


# ---------------------------------------------------------------- exact against the loops


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("discard_fraction", [0.0, 0.1, 0.25, 0.3])
def test_two_nn_equals_loop(seed, discard_fraction):
    x = _cloud(seed)
    x[3] = x[8]  # a duplicate pair: neither is the other's neighbour
    expected = _two_nn_loop(x, discard_fraction)
    torch.testing.assert_close(two_nn(x, discard_fraction=discard_fraction), _t(expected), rtol=1e-12, atol=0)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_local_knn_equals_loop(k):
    x = _cloud(k)
    x[0] = x[1]
    torch.testing.assert_close(local_knn(x, k), _t(_local_knn_loop(x, k)), rtol=1e-12, atol=0, equal_nan=True)


@pytest.mark.parametrize("criterion", ["gap", "maxgap", "ratio"])
@pytest.mark.parametrize(("k", "dim"), [(4, 6), (8, 6), (5, 3)])
def test_local_pca_equals_loop(criterion, k, dim):
    x = _cloud(k + dim, dim=dim)
    x[:, -1] *= 0.05  # a flat direction, so the criteria have something to find
    torch.testing.assert_close(local_pca(x, k, criterion=criterion), _t(_local_pca_loop(x, k, criterion)))


@pytest.mark.parametrize(("k", "dim"), [(4, 6), (10, 4), (1, 3)])
def test_ca_pca_equals_loop(k, dim):
    x = _cloud(k * dim, dim=dim)
    x[:, -1] *= 0.1
    torch.testing.assert_close(ca_pca(x, k), _t(_ca_pca_loop(x, k)))
    torch.testing.assert_close(ca_pca(x, k, support=0.0), _t(_ca_pca_loop(x, k, support=0.0)))


# ---------------------------------------------------------------- tdhook 0.1.3 where it is right


def _td(x):
    return TensorDict({"data": x}, batch_size=x.shape[:-2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_two_nn_discard_zero_equals_tdhook(dtype):
    x = _cloud(3, n=200, dim=12, dtype=dtype)
    theirs = TwoNnDimensionEstimator(return_xy=True)(_td(x))
    d, log_mu, log_y = two_nn(x, discard_fraction=0, return_xy=True)
    torch.testing.assert_close(d, theirs["dimension"].to(dtype), rtol=1e-5, atol=0)
    torch.testing.assert_close(log_mu, theirs["dimension_x"].to(dtype), equal_nan=True)
    torch.testing.assert_close(log_y, theirs["dimension_y"].to(dtype), equal_nan=True)


@pytest.mark.parametrize("k", [2, 6])
def test_local_knn_equals_tdhook(k):
    x = _cloud(k, n=120, dim=8)
    torch.testing.assert_close(local_knn(x, k).float(), LocalKnnDimensionEstimator(k=k)(_td(x))["dimension"],
                               equal_nan=True)


@pytest.mark.parametrize("criterion", ["maxgap", "ratio"])
@pytest.mark.parametrize("k", [3, 12])
def test_local_pca_equals_tdhook(criterion, k):
    x = _cloud(k, n=80, dim=10)
    x[:, 5:] *= 0.02
    theirs = LocalPcaDimensionEstimator(k=k, criterion=criterion)(_td(x))["dimension"]
    torch.testing.assert_close(local_pca(x, k, criterion=criterion), theirs)


@pytest.mark.parametrize("k", [3, 15])
def test_ca_pca_equals_tdhook(k):
    x = F.normalize(_cloud(k, n=150, dim=5), dim=-1)  # the 4-sphere
    theirs = CaPcaDimensionEstimator(k=k)(_td(x))["dimension"]
    torch.testing.assert_close(ca_pca(x, k, support=0.0), theirs)  # support=0 is tdhook's rule
    torch.testing.assert_close(ca_pca(x, k), theirs)  # the default differs only at lopsided neighbourhoods


# ---------------------------------------------------------------- noisy manifolds of known dimension


def _rotated(x, ambient, g):
    q = torch.linalg.qr(torch.randn(ambient, ambient, generator=g, dtype=torch.float64)).Q
    return F.pad(x, (0, ambient - x.shape[-1])) @ q


def _manifold(name, g, n=1000, quieter=1.0):
    u = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)
    z = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    t, h = 1.5 * math.pi * (1 + 2 * u(n)), 21 * u(n)
    swiss = torch.stack([t * torch.cos(t), h, t * torch.sin(t)], 1)
    clean, d, noise = {
        "plane in R^20": (_rotated(u(n, 2), 20, g), 2, 0.003),
        "5-subspace in R^50": (_rotated(z(n, 5), 50, g), 5, 0.02),
        "2-sphere in R^10": (_rotated(F.normalize(z(n, 3), dim=-1), 10, g), 2, 0.01),
        "3-sphere in R^20": (_rotated(F.normalize(z(n, 4), dim=-1), 20, g), 3, 0.01),
        "swiss roll in R^3": (swiss, 2, 0.1),
        "swiss roll in R^20": (_rotated(swiss, 20, g), 2, 0.1),
    }[name]
    return clean + noise / quieter * z(*clean.shape), d


MANIFOLDS = ["plane in R^20", "5-subspace in R^50", "2-sphere in R^10", "3-sphere in R^20", "swiss roll in R^3",
             "swiss roll in R^20"]


@pytest.mark.parametrize("name", MANIFOLDS)
def test_noisy_manifolds_local_pca_default(name):
    x, d = _manifold(name, torch.Generator().manual_seed(0))
    estimate = local_pca(x, 20)
    assert (estimate == d).double().mean() >= 0.95, name


def test_maxgap_answers_k_on_noisy_data_where_gap_is_right():
    x, d = _manifold("5-subspace in R^50", torch.Generator().manual_seed(0))
    assert (local_pca(x, 10, criterion="maxgap") == 10).all()  # tdhook's: the structural zero
    assert (local_pca(x, 10) == d).double().mean() >= 0.9


@pytest.mark.parametrize("name", ["5-subspace in R^50", "3-sphere in R^20", "swiss roll in R^3"])
def test_noisy_manifolds_two_nn_and_local_knn(name):
    x, d = _manifold(name, torch.Generator().manual_seed(1))
    assert abs(local_knn(x, 10).nanmedian().item() - d) < 0.3, name
    # TwoNN reads the scale of the nearest neighbour, where noise spans every direction: less noise
    x, d = _manifold(name, torch.Generator().manual_seed(1), quieter=10)
    assert abs(two_nn(x).item() - d) < 0.5, name


@pytest.mark.parametrize("name", ["2-sphere in R^10", "3-sphere in R^20", "swiss roll in R^20"])
def test_noisy_manifolds_ca_pca(name):
    x, d = _manifold(name, torch.Generator().manual_seed(2))
    assert (ca_pca(x, 20) == d).double().mean() >= 0.95, name


def test_ca_pca_does_not_answer_ambient_at_lopsided_neighbourhoods_as_tdhook_does():
    """NOTE [CA-PCA at the edges]: tdhook answers D at edge points of a noise-free 8-D Gaussian; we do not."""
    g = torch.Generator().manual_seed(1)
    x = _rotated(torch.randn(200, 8, generator=g, dtype=torch.float64), 12, g)
    theirs = CaPcaDimensionEstimator(k=14)(_td(x))["dimension"]
    torch.testing.assert_close(ca_pca(x, 14, support=0.0), theirs)
    ambient = theirs == 12
    assert 0 < ambient.sum() < 20
    spread = (x - x.mean(0)).norm(dim=-1)
    assert spread[ambient].mean() > spread[~ambient].mean()  # at the edge of the Gaussian
    ours = ca_pca(x, 14)
    assert not (ours == 12).any()
    assert (ours[~ambient] == theirs[~ambient]).all()  # elsewhere tdhook's answers
    assert (ours[ambient] == 8).double().mean() > 0.5


@pytest.mark.parametrize("noise", [0.0, 0.01])
@pytest.mark.parametrize(("name", "dim", "ambient"), [("gaussian", 8, 12), ("cube", 8, 12), ("gaussian", 3, 10)])
def test_ca_pca_support_loses_no_right_answer(name, dim, ambient, noise):
    g = torch.Generator().manual_seed(3)
    points = torch.randn(600, dim, generator=g, dtype=torch.float64) if name == "gaussian" else torch.rand(
        600, dim, generator=g, dtype=torch.float64)
    x = _rotated(points, ambient, g)
    x = x + noise * torch.randn(x.shape, generator=g, dtype=x.dtype)
    tdhook_rule, ours = ca_pca(x, 20, support=0.0), ca_pca(x, 20)
    assert ((tdhook_rule == dim) <= (ours == dim)).all()  # every right answer kept
    assert not (ours == ambient).any()
    assert (ours == dim).double().mean() >= (tdhook_rule == dim).double().mean()


# ---------------------------------------------------------------- batching, vmap, dtype, duplicates


ESTIMATORS = {
    "two_nn": lambda x: two_nn(x),
    "local_knn": lambda x: local_knn(x, 4),
    "local_pca": lambda x: local_pca(x, 6),
    "ca_pca": lambda x: ca_pca(x, 6),
}


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_batch_equals_loop_and_vmap(name):
    fn = ESTIMATORS[name]
    x = torch.stack([torch.stack([_cloud(10 * i + j, n=40, dim=5) for j in range(3)]) for i in range(2)])
    batched = fn(x)
    looped = torch.stack([torch.stack([fn(x[i, j]) for j in range(3)]) for i in range(2)])
    torch.testing.assert_close(batched, looped, rtol=1e-12, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(torch.vmap(torch.vmap(fn))(x), batched, rtol=1e-12, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("name", list(ESTIMATORS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtype_kept_and_input_untouched(name, dtype):
    x = _cloud(0, n=40, dim=5, dtype=dtype)
    before = x.clone()
    assert ESTIMATORS[name](x).dtype == dtype
    assert torch.equal(x, before)


def test_two_nn_return_xy_padding():
    x = _cloud(4, n=50)
    d, log_mu, log_y = two_nn(x, return_xy=True)
    assert log_mu.shape == log_y.shape == (49,)
    fitted = torch.isfinite(log_mu)
    assert fitted.sum() == 45 and fitted[:45].all()  # floor(50 * 0.9), in increasing order
    assert torch.all(log_mu[:45].diff() >= 0)
    torch.testing.assert_close(d, (log_mu[fitted] * log_y[fitted]).sum() / (log_mu[fitted] ** 2).sum())


@pytest.mark.parametrize(("n", "discard_fraction", "fitted"),
                         [(10, 0.3, 7), (20, 0.15, 17), (10, 0.0, 9), (50, 0.1, 45)])
def test_two_nn_keeps_the_exact_share(n, discard_fraction, fitted):
    """``floor(n (1 - f))`` ratios, at most ``n - 1``: ``10 * (1 - 0.3)`` in floating point is 6.999..."""
    _, log_mu, _ = two_nn(_cloud(n, n=n), discard_fraction=discard_fraction, return_xy=True)
    assert int(torch.isfinite(log_mu).sum()) == fitted


def test_duplicates_are_excluded_and_too_few_give_nan():
    x = torch.ones(6, 3, dtype=torch.float64)
    assert torch.isnan(two_nn(x))
    assert torch.isnan(local_knn(x, 2)).all()
    assert torch.isnan(local_pca(x, 2)).all()
    assert torch.isnan(ca_pca(x, 2)).all()
    y = torch.cat([_cloud(0, n=30), _cloud(0, n=30)[:5]])  # five points twice
    assert torch.isfinite(two_nn(y))
    torch.testing.assert_close(local_knn(y, 3), _t(_local_knn_loop(y, 3)), equal_nan=True)


def test_two_nn_regular_grid_is_nan_in_its_own_cloud_only():
    """On a grid every ratio r2/r1 is 1 (no slope): nan, as documented, without touching another cloud."""
    grid = torch.stack(torch.meshgrid(torch.arange(6.0), torch.arange(6.0), indexing="ij"), -1).reshape(-1, 2)
    clouds = torch.stack([grid.double(), _cloud(0, n=36)[:, :2]])
    dims = two_nn(clouds)
    assert torch.isnan(dims[0]) and torch.isfinite(dims[1])
    torch.testing.assert_close(dims[1], two_nn(clouds[1]))


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_duplicates_found_eagerly_as_under_vmap(name):
    """Eager calls look for duplicates in the nearest distances before masking them all; under ``vmap`` (no
    data-dependent branch) they are always masked: the same numbers, with duplicates in one cloud only."""
    fn = ESTIMATORS[name]
    x = torch.stack([_cloud(i, n=40, dim=5) for i in range(3)])
    x[1, 7] = x[1, 20]
    x[1, 3] = x[1, 30] + 1e-7  # within eps: a duplicate too
    eager = torch.stack([fn(cloud) for cloud in x])
    torch.testing.assert_close(fn(x), eager, rtol=1e-12, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(torch.vmap(fn)(x), eager, rtol=1e-12, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("offset", [0.0, 100.0])
@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_float32_duplicates_and_offsets_give_the_float64_numbers(name, offset):
    """Points repeated exactly (a shared BOS token's activations) are duplicates in float32 too, and a common offset
    costs no precision: torch.cdist's matrix-product formula put equal float32 points 1e-2 apart, so they counted
    as each other's nearest neighbours (NOTE [exact duplicates])."""
    fn = ESTIMATORS[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 4, generator=g, dtype=torch.float64) @ torch.randn(4, 24, generator=g, dtype=torch.float64)
    x = (torch.cat([x, x[:15]]) + offset).float()  # fifteen points twice, each of norm ~10 (+ the offset)
    assert float(torch.cdist(x, x)[:15, 120:].diagonal().max()) > 1e-5  # what the formula alone gives them
    exact = fn(x.double())
    if name in ("local_pca", "ca_pca"):  # (dimensions: the same integers, but at a point with a float32 tie)
        assert int((fn(x).double() != exact).sum()) <= 1
    else:
        torch.testing.assert_close(fn(x).double(), exact, rtol=1e-4, atol=1e-4, equal_nan=True)
    torch.testing.assert_close(torch.vmap(fn)(x[None]).squeeze(0), fn(x), rtol=1e-5, atol=1e-5, equal_nan=True)


@settings(max_examples=20, deadline=None)
@given(scale=st.floats(0.1, 10), shift=st.floats(-10, 10), seed=st.integers(0, 10))
def test_invariant_to_scale_shift_and_rotation(scale, shift, seed):
    """A dimension is a property of the shape: similarity transforms leave every estimate unchanged.

    Up to rounding: torch.cdist computes |a|^2 + |b|^2 - 2 a.b, which a shift changes."""
    g = torch.Generator().manual_seed(seed)
    x = _cloud(seed, n=50, dim=4)
    q = torch.linalg.qr(torch.randn(4, 4, generator=g, dtype=torch.float64)).Q
    y = scale * x @ q + shift
    torch.testing.assert_close(two_nn(y, eps=0), two_nn(x, eps=0), rtol=1e-6, atol=0)
    torch.testing.assert_close(local_knn(y, 3, eps=0), local_knn(x, 3, eps=0), rtol=1e-6, atol=0)
    assert torch.equal(local_pca(y, 8, eps=0, criterion="ratio"), local_pca(x, 8, eps=0, criterion="ratio"))


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: two_nn(torch.randn(2, 3)), ValueError, "two_nn: at least 3 points"),
        (lambda: two_nn(torch.arange(12).reshape(4, 3)), TypeError, "floating-point"),
        (lambda: two_nn(torch.randn(5)), ValueError, r"shape \(\.\.\., N, D\)"),
        (lambda: two_nn([[0.0, 1.0]]), TypeError, "must be a tensor"),
        (lambda: two_nn(torch.randn(9, 3), discard_fraction=1.0), ValueError, "discard_fraction"),
        (lambda: two_nn(torch.randn(9, 3), eps=-1.0), ValueError, "eps must be"),
        (lambda: local_knn(torch.randn(4, 3), 2), ValueError, r"local_knn: at least 5 points \(2k \+ 1"),
        (lambda: local_knn(torch.randn(9, 3), 0), ValueError, "k must be at least 1"),
        (lambda: local_knn(torch.randn(9, 3), 2.5), TypeError, "k must be an int"),
        (lambda: local_pca(torch.randn(5, 3), 5), ValueError, r"local_pca: at least 6 points"),
        (lambda: local_pca(torch.randn(9, 3), 2, criterion="median"), ValueError, "criterion must be one of"),
        (lambda: local_pca(torch.randn(9, 3), 2, alpha=1.5), ValueError, "alpha must be in"),
        (lambda: ca_pca(torch.randn(6, 3), 5), ValueError, r"ca_pca: at least 7 points \(k \+ 2"),
    ],
)
def test_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()
