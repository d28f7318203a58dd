"""``tdhook_fn.latent.similarity``: CKA and information imbalance.

Values against hand-written float64 references (explicit centring matrix, Song et al.'s
unbiased HSIC formula, ranks from a full sort) and against tdhook 0.1.3's estimators;
axioms by hypothesis; all pairs by broadcasting against loops; vmap, dtypes, errors.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from sklearn.datasets import load_digits
from tensordict import TensorDict

from tdhook_fn.latent.similarity import cka, information_imbalance

F64 = torch.float64


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def related_pair(n: int = 60, dx: int = 7, dy: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two representations sharing some structure (CKA well inside (0, 1))."""
    x = randn(n, dx, seed=seed)
    y = torch.tanh(x[:, :3] @ randn(3, dy, seed=seed + 1)) + 0.5 * randn(n, dy, seed=seed + 2)
    return x, y


# ---------------------------------------------------------------- hand-written references


def ref_gram(x: torch.Tensor, kernel: str, sigma: float | None, fraction: float) -> torch.Tensor:
    x = x.to(F64)
    if kernel == "linear":
        return x @ x.T
    n = x.shape[0]
    d = torch.tensor([[float(((x[i] - x[j]) ** 2).sum().sqrt()) for j in range(n)] for i in range(n)], dtype=F64)
    if sigma is None:
        pairs = sorted(float(d[i, j]) for i in range(n) for j in range(i + 1, n))
        sigma = fraction * pairs[(len(pairs) - 1) // 2]  # the lower median
    return torch.exp(-(d**2) / (2 * sigma**2))


def ref_hsic_biased(k: torch.Tensor, m: torch.Tensor) -> float:
    n = k.shape[0]
    h = torch.eye(n, dtype=F64) - torch.ones(n, n, dtype=F64) / n
    return float(torch.trace(k @ h @ m @ h)) / (n - 1) ** 2


def ref_hsic_unbiased(k: torch.Tensor, m: torch.Tensor) -> float:
    """Song et al. (2012), equation (5)."""
    n = k.shape[0]
    kt, lt = k - torch.diag(torch.diag(k)), m - torch.diag(torch.diag(m))
    one = torch.ones(n, dtype=F64)
    term = float(torch.trace(kt @ lt)) + float(one @ kt @ one) * float(one @ lt @ one) / ((n - 1) * (n - 2))
    term -= 2 / (n - 2) * float(one @ kt @ lt @ one)
    return term / (n * (n - 3))


def ref_cka(x: torch.Tensor, y: torch.Tensor, kernel: str = "linear", debiased: bool = False,
            sigma: float | None = None, fraction: float = 1.0) -> float:
    k, m = ref_gram(x, kernel, sigma, fraction), ref_gram(y, kernel, sigma, fraction)
    hsic = ref_hsic_unbiased if debiased else ref_hsic_biased
    return hsic(k, m) / math.sqrt(hsic(k, k) * hsic(m, m))


def ref_imbalance(x: torch.Tensor, y: torch.Tensor, p: float = 2.0) -> float:
    """2/N mean rank in y of each point's nearest neighbour in x, ranks from a full sort (no ties)."""
    n = x.shape[0]
    dx, dy = torch.cdist(x.to(F64), x.to(F64), p=p), torch.cdist(y.to(F64), y.to(F64), p=p)
    total = 0
    for i in range(n):
        others = [j for j in range(n) if j != i]
        nearest = min(others, key=lambda j: float(dx[i, j]))
        by_y = sorted(others, key=lambda j: float(dy[i, j]))
        total += by_y.index(nearest) + 1
    return 2 / n * total / n


# ---------------------------------------------------------------- values


@pytest.mark.parametrize("kernel", ["linear", "rbf"])
@pytest.mark.parametrize("debiased", [False, True])
def test_cka_equals_reference(kernel: str, debiased: bool) -> None:
    x, y = related_pair()
    expected = ref_cka(x, y, kernel, debiased)
    assert 0.05 < abs(expected) < 0.95
    torch.testing.assert_close(cka(x, y, kernel=kernel, debiased=debiased), torch.tensor(expected, dtype=F64),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("sigma", "fraction"), [(2.5, 1.0), (None, 0.4)])
def test_rbf_bandwidth_options_equal_reference(sigma: float | None, fraction: float) -> None:
    x, y = related_pair(n=41, seed=3)
    got = cka(x, y, kernel="rbf", sigma=sigma, median_fraction=fraction)
    torch.testing.assert_close(got, torch.tensor(ref_cka(x, y, "rbf", sigma=sigma, fraction=fraction), dtype=F64),
                               rtol=1e-12, atol=1e-12)


def test_linear_cka_covariance_and_gram_paths_agree() -> None:
    """Wide samples take the covariance path, wide features the Gram path: both the reference."""
    for n, dx, dy in [(200, 3, 4), (8, 50, 60)]:
        x, y = related_pair(n=n, dx=dx, dy=dy, seed=n)
        torch.testing.assert_close(cka(x, y), torch.tensor(ref_cka(x, y), dtype=F64), rtol=1e-12, atol=1e-12)


def test_rbf_median_of_coinciding_samples_raises() -> None:
    x = randn(6, 8, seed=3)
    y = torch.tensor([[-1.0], [1.0], [1.0], [1.0], [1.0], [1.0]], dtype=F64)  # 10 of 15 pairs coincide
    with pytest.raises(ValueError, match="samples of y coincide.*pass sigma="):
        cka(x, y, kernel="rbf")
    assert torch.isfinite(cka(x, y, kernel="rbf", sigma=1.0))


def test_rbf_with_a_wide_bandwidth_tends_to_linear_cka() -> None:
    x, y = related_pair()
    torch.testing.assert_close(cka(x, y, kernel="rbf", sigma=1e3), cka(x, y), rtol=1e-4, atol=1e-5)


def test_debiased_cka_of_independent_representations_is_near_zero_unlike_biased() -> None:
    x, y = randn(5, 30, 40, seed=1), randn(5, 30, 40, seed=2)  # N < D: the biased estimate is far from 0
    biased, debiased = cka(x, y), cka(x, y, debiased=True)
    assert bool((biased > 0.5).all()), biased
    assert float(debiased.abs().max()) < 0.15, debiased


def test_cka_matches_tdhook_on_digits() -> None:
    from tdhook.latent.representation_similarity import CkaEstimator

    pixels = torch.tensor(load_digits().data[:400], dtype=torch.float32)
    hidden = torch.relu(pixels @ randn(64, 32, seed=5, dtype=torch.float32))
    theirs = CkaEstimator()(TensorDict(data_a=pixels, data_b=hidden))["cka"]
    torch.testing.assert_close(cka(pixels, hidden), theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cka(pixels.double(), hidden.double()).float(), theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, math.inf])
def test_imbalance_equals_reference_and_tdhook(p: float) -> None:
    from tdhook.latent.representation_similarity import InformationImbalanceEstimator

    x, y = related_pair(n=50, seed=7)
    expected = (ref_imbalance(x, y, p), ref_imbalance(y, x, p))
    got = information_imbalance(x, y, p=p)
    torch.testing.assert_close(got, tuple(torch.tensor(e, dtype=F64) for e in expected), rtol=1e-12, atol=1e-12)
    out = InformationImbalanceEstimator(p=p)(TensorDict(data_a=x.float(), data_b=y.float()))
    theirs = (out["information_imbalance_a_to_b"], out["information_imbalance_b_to_a"])
    torch.testing.assert_close(information_imbalance(x.float(), y.float(), p=p), theirs, rtol=1e-6, atol=1e-7)


def test_imbalance_of_a_noisy_curve_against_its_parameter() -> None:
    """A noisy helix predicts its parameter's neighbours; an unrelated cloud does not."""
    t = torch.rand(300, 1, generator=torch.Generator().manual_seed(0), dtype=F64) * 4 * math.pi
    helix = torch.cat([t.cos(), t.sin(), 0.3 * t], -1) + 0.01 * randn(300, 3, seed=1)
    to_t, _ = information_imbalance(helix, t)
    noise_to_t, _ = information_imbalance(randn(300, 3, seed=2), t)
    assert float(to_t) < 0.05
    assert 0.8 < float(noise_to_t) < 1.2


def test_imbalance_ties_take_lowest_index_and_best_rank() -> None:
    x = torch.tensor([[0.0], [1.0], [-1.0], [5.0]], dtype=F64)  # point 0: neighbours 1 and 2 tie, 1 is chosen
    y = torch.tensor([[0.0], [3.0], [3.0], [1.0]], dtype=F64)   # in y, 1 and 2 tie behind 3
    # x->y: 0 picks 1 (rank 2: only 3 is closer); 1 picks 0 (d=3; y: 2 at 0 and 3 at 2 closer: rank 3);
    # 2 picks 0 (y: 1 at 0 and 3 at 2 closer: rank 3); 3 picks 1 (d=4; y: 0 at 1 closer, 1 and 2 tie at 2: rank 2)
    x_to_y, _ = information_imbalance(x, y)
    torch.testing.assert_close(x_to_y, torch.tensor(2 / 4 * (2 + 3 + 3 + 2) / 4, dtype=F64))


def test_identical_views_give_two_over_n() -> None:
    x = randn(3, 64, 8, seed=4)
    for value in information_imbalance(x, x.clone()):
        torch.testing.assert_close(value, torch.full((3,), 2 / 64, dtype=F64))


# ---------------------------------------------------------------- axioms


@st.composite
def representations(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    n, dx, dy = draw(st.integers(5, 40)), draw(st.integers(1, 12)), draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    x = randn(n, dx, seed=seed) * draw(st.floats(1e-3, 1e3))
    # (some noise always: a saturated tanh of a wide x gives coinciding samples, for which the RBF
    # kernel's median bandwidth is 0 and cka raises: test_rbf_median_of_coinciding_samples_raises)
    mix = draw(st.floats(0.0, 0.9))
    y = mix * torch.tanh(x @ randn(dx, dy, seed=seed + 1)) + (1 - mix) * randn(n, dy, seed=seed + 2)
    return x, y


@settings(max_examples=40, deadline=None)
@given(representations(), st.sampled_from(["linear", "rbf"]), st.floats(1e-3, 1e3), st.integers(0, 2**31 - 1))
def test_cka_axioms(pair: tuple[torch.Tensor, torch.Tensor], kernel: str, scale: float, seed: int) -> None:
    x, y = pair
    value = cka(x, y, kernel=kernel)
    assert 0.0 <= float(value) <= 1.0
    torch.testing.assert_close(cka(y, x, kernel=kernel), value, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(cka(x, x, kernel=kernel), torch.tensor(1.0, dtype=F64), rtol=1e-9, atol=1e-12)
    q, _ = torch.linalg.qr(randn(x.shape[1], x.shape[1], seed=seed))
    moved = scale * x @ q + randn(1, x.shape[1], seed=seed + 1)  # rotation, isotropic scale, translation
    if kernel == "rbf":  # the median bandwidth follows the scale; a fixed one would not
        torch.testing.assert_close(cka(moved, y, kernel=kernel), value, rtol=1e-6, atol=1e-9)
    else:
        torch.testing.assert_close(cka(moved, y), value, rtol=1e-6, atol=1e-9)
    if x.shape[0] >= 4:
        torch.testing.assert_close(cka(moved, y, kernel=kernel, debiased=True),
                                   cka(x, y, kernel=kernel, debiased=True), rtol=1e-6, atol=1e-9)


@settings(max_examples=30, deadline=None)
@given(representations(), st.integers(0, 2**31 - 1))
def test_imbalance_axioms(pair: tuple[torch.Tensor, torch.Tensor], seed: int) -> None:
    x, y = pair
    n = x.shape[0]
    for t in (x, y):  # the order of tied points is a convention (lowest index), not an axiom
        d = torch.cdist(t, t)[~torch.eye(n, dtype=torch.bool)].reshape(n, n - 1)
        assume(bool((d.sort(-1).values.diff(dim=-1) > 1e-9 * d.amax()).all()))
    a_to_b, b_to_a = information_imbalance(x, y)
    for value in (a_to_b, b_to_a):
        assert 2 / n - 1e-12 <= float(value) <= 2 * (n - 1) / n + 1e-12
    swapped = information_imbalance(y, x)
    torch.testing.assert_close(swapped, (b_to_a, a_to_b), rtol=0, atol=0)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))  # samples carry no order
    torch.testing.assert_close(information_imbalance(x[order], y[order]), (a_to_b, b_to_a), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(information_imbalance(3 * x, y)[0], a_to_b, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- batching


@pytest.mark.parametrize("options", [{}, {"debiased": True}, {"kernel": "rbf"}, {"kernel": "rbf", "sigma": 3.0}])
@pytest.mark.parametrize("shape", [(5, 30, 6), (4, 12, 40)], ids=["covariances", "grams"])  # linear CKA's two paths
def test_all_pairs_by_broadcasting_equals_the_loop(options: dict[str, object], shape: tuple[int, int, int]) -> None:
    acts = randn(*shape, seed=8)
    layers = shape[0]
    table = cka(acts[:, None], acts[None, :], **options)  # type: ignore[arg-type]
    loop = torch.stack([torch.stack([cka(a, b, **options) for b in acts]) for a in acts])  # type: ignore[arg-type]
    torch.testing.assert_close(table, loop, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(table, table.T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(table.diagonal(), torch.ones(layers, dtype=F64), rtol=1e-12, atol=1e-12)


def test_all_pairs_of_two_families_with_different_widths() -> None:
    """Layers of two models of different widths: (3, 1, N, 8) against (1, 4, N, 5) gives (3, 4)."""
    a, b = randn(3, 25, 8, seed=1), randn(4, 25, 5, seed=2)
    b = b + 0.3 * a[:1, :, :5]
    table = cka(a[:, None], b[None])
    imb = information_imbalance(a[:, None], b[None])
    assert table.shape == imb[0].shape == imb[1].shape == (3, 4)
    for i in range(3):
        for j in range(4):
            torch.testing.assert_close(table[i, j], cka(a[i], b[j]), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close((imb[0][i, j], imb[1][i, j]), information_imbalance(a[i], b[j]),
                                       rtol=1e-12, atol=1e-12)


def test_mixed_broadcast_dims() -> None:
    x, y = randn(2, 1, 3, 20, 4, seed=1), randn(5, 1, 20, 6, seed=2)  # shared, outer and leading dims
    got = cka(x, y)
    assert got.shape == (2, 5, 3)
    loop = torch.stack([torch.stack([torch.stack([cka(x[i, 0, k], y[j, 0]) for k in range(3)]) for j in range(5)])
                        for i in range(2)])
    torch.testing.assert_close(got, loop, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("options", [{}, {"debiased": True}, {"kernel": "rbf"}])
def test_vmap_equals_the_batched_call(options: dict[str, object]) -> None:
    x, y = randn(4, 20, 6, seed=1), randn(4, 20, 3, seed=2)
    f = lambda a, b: cka(a, b, **options)
    torch.testing.assert_close(torch.vmap(f)(x, y), f(x, y), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.vmap(information_imbalance)(x, y), information_imbalance(x, y), rtol=0, atol=0)


def test_grad_through_cka() -> None:
    x, y = related_pair(n=12, dx=3, dy=2)
    assert torch.autograd.gradcheck(lambda a: cka(a, y, kernel="rbf", debiased=True), (x.requires_grad_(),))
    g = torch.func.grad(lambda a: cka(a, y))(x.detach())
    assert g.shape == x.shape and bool(torch.isfinite(g).all())


def test_dtypes() -> None:
    x, y = related_pair()
    assert cka(x, y).dtype == F64 and information_imbalance(x, y)[0].dtype == F64
    assert cka(x.float(), y.float()).dtype == torch.float32
    ints = torch.arange(512).reshape(128, 4)
    value = cka(ints, ints.clone())
    assert value.dtype == torch.get_default_dtype()
    torch.testing.assert_close(value, torch.tensor(1.0))
    assert information_imbalance(ints, ints)[1].dtype == torch.get_default_dtype()
    assert cka(x.float(), y).dtype == F64  # promoted


def test_inputs_are_not_modified() -> None:
    x, y = related_pair()
    x0, y0 = x.clone(), y.clone()
    cka(x, y, kernel="rbf", debiased=True)
    information_imbalance(x, y)
    assert torch.equal(x, x0) and torch.equal(y, y0)


# ---------------------------------------------------------------- degenerate and bad input


def test_constant_representation_raises_naming_it() -> None:
    x = randn(3, 20, 4)
    x[1] = 2.5
    with pytest.raises(ValueError, match=r"cka: x is constant .*batch index \(1,\).*tdhook returns NaN"):
        cka(x, randn(3, 20, 2))
    with pytest.raises(ValueError, match="cka: y is constant"):
        cka(randn(20, 4), torch.full((20, 3), 0.1))
    with pytest.raises(ValueError, match="cka: x is constant"):
        cka(torch.full((20, 3), 0.1), randn(20, 4), kernel="rbf", debiased=True)


def test_constant_representation_under_vmap_is_nan() -> None:
    x = randn(3, 20, 4)
    x[1] = 2.5
    value = torch.vmap(cka)(x, randn(3, 20, 2))
    assert bool(value[1].isnan()) and bool(value[[0, 2]].isfinite().all())


def test_coinciding_samples_leave_no_median_bandwidth() -> None:
    x = torch.zeros(10, 2, dtype=F64)
    x[0, 0] = 1.0
    with pytest.raises(ValueError, match="median distance is 0.*sigma="):
        cka(x, randn(10, 2), kernel="rbf")
    assert bool(cka(x, randn(10, 2), kernel="rbf", sigma=1.0).isfinite())


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: cka(randn(20), randn(20)), r"shape \(N, D\) or \(\.\.\., N, D\)"),
        (lambda: cka(randn(20, 3), randn(19, 3)), "matching sample counts"),
        (lambda: cka(randn(2, 20, 3), randn(3, 20, 3)), r"do not broadcast.*x\[:, None\]"),
        (lambda: cka(randn(1, 3), randn(1, 3)), "at least 2 samples"),
        (lambda: cka(randn(3, 3), randn(3, 3), debiased=True), "at least 4 samples"),
        (lambda: cka(randn(5, 3), randn(5, 3), kernel="poly"), "kernel must be one of"),
        (lambda: cka(randn(5, 3), randn(5, 3), kernel="rbf", sigma=0.0), "sigma must be a positive"),
        (lambda: cka(randn(5, 3), randn(5, 3), median_fraction=-1.0), "median_fraction must be a positive"),
        (lambda: cka(randn(5, 3), torch.randn(5, 3, device="meta")), "same device"),
        (lambda: cka(randn(5, 3).fill_(math.nan), randn(5, 3)), "x holds NaN or inf"),
        (lambda: information_imbalance(randn(1, 3), randn(1, 3)), "at least 2 samples"),
        (lambda: information_imbalance(randn(5, 3), randn(5, 3), p=0), "p must be a positive"),
        (lambda: information_imbalance(randn(5, 3), randn(5, 3).fill_(math.inf)), "y holds NaN or inf"),
    ],
)
def test_bad_input_raises_value_error(call, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        call()


def test_non_tensor_and_complex_raise_type_error() -> None:
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        cka([[1.0, 2.0]], randn(1, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="y is complex"):
        information_imbalance(randn(4, 2), randn(4, 2).to(torch.complex128))


@pytest.mark.parametrize("scale", [1e-30, 1e12])
def test_linear_cka_in_float32_at_extreme_scales(scale: float) -> None:
    """Scale-invariant in float32 too: no overflow of the fourth powers, no underflow to 0/0."""
    x, y = related_pair()
    x32, y32 = x.float(), y.float()
    for options in ({}, {"debiased": True}):
        expected = cka(x, y, **options).float()  # type: ignore[arg-type]
        torch.testing.assert_close(cka(scale * x32, y32, **options), expected, rtol=1e-5, atol=1e-6)  # type: ignore[arg-type]
    big = randn(3, 400, 20, seed=1, dtype=torch.float32)  # the covariance path (N > D)
    torch.testing.assert_close(cka(scale * big[:, None], big[None]), cka(big[:, None], big[None]), rtol=1e-5,
                               atol=1e-6)


def test_views_of_one_tensor_equal_copies() -> None:
    """The all-pairs call builds each layer's Gram or distances once; copies and overlapping views agree."""
    acts = randn(4, 25, 6, seed=9)
    for fn in (cka, lambda a, b: torch.stack(information_imbalance(a, b))):
        torch.testing.assert_close(fn(acts[:, None], acts[None]), fn(acts[:, None], acts.clone()[None]),
                                   rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(fn(acts, acts[:1]), fn(acts, acts[:1].clone()), rtol=1e-12, atol=1e-12)


def test_imbalance_reuse_across_view_layouts() -> None:
    """y -> x read off x -> y where y is x with its dims moved apart; computed where they overlap."""
    acts = randn(2, 3, 12, 4, seed=10)
    cases = [(acts[:, :, None, None], acts[None, None]),   # all pairs over two batch dims
             (acts[:, :, None], acts[:, None, :]),           # shared dim 0, pairs over dim 1
             (acts, acts)]
    for x, y in cases:
        got = information_imbalance(x, y)
        expected = information_imbalance(x, y.clone())
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_fullgraph_compile_traces_both() -> None:
    """No graph break: the checks that branch on values step aside while compiling (as under vmap)."""
    x, y = randn(3, 30, 6, seed=11), randn(3, 30, 4, seed=12)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: cka(a, b, kernel="rbf"), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, y), cka(x, y, kernel="rbf"), rtol=1e-12, atol=1e-12)
    compiled_ii = torch.compile(information_imbalance, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled_ii(x, y), information_imbalance(x, y), rtol=0, atol=0)


# ---------------------------------------------------------------- the plain linear path and its fall-backs


def test_plain_linear_path_equals_the_checked_one() -> None:
    """The all-pairs Gram path without the checks' passes gives the checked path's numbers (under vmap the values
    are not visible: the checked path); a large mean and float32 included."""
    acts = randn(4, 30, 50, seed=3) + 1e3 * randn(1, 1, 50, seed=4)
    for dtype in (F64, torch.float32):
        a = acts.to(dtype)
        checked = torch.vmap(lambda u: torch.vmap(lambda v: cka(u, v))(a))(a)
        torch.testing.assert_close(cka(a[:, None], a[None]), checked, rtol=1e-5 if dtype == torch.float32 else 1e-10,
                                   atol=1e-6 if dtype == torch.float32 else 1e-12)


def test_a_layer_whose_first_samples_coincide_is_not_constant() -> None:
    x, y = related_pair(n=30, dx=40, dy=35)
    x[1] = x[0]
    value = cka(x, y)
    assert bool(value.isfinite())
    torch.testing.assert_close(value, torch.vmap(cka)(x[None], y[None])[0])


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_one_bad_entry_in_one_layer_of_the_all_pairs_call_raises(bad: float) -> None:
    acts = randn(3, 20, 40, dtype=torch.float32)
    acts[2, 5, 7] = bad
    with pytest.raises(ValueError, match="cka: x holds NaN or inf"):
        cka(acts[:, None], acts[None])


@pytest.mark.parametrize("scale", [1e-30, 1e-12, 1e12, 1e30])
def test_gram_path_in_float32_at_extreme_scales(scale: float) -> None:
    """N < D (the Gram path): out of the unscaled range the checked path scales, and the numbers hold."""
    acts = randn(3, 20, 40, seed=2, dtype=torch.float32)
    torch.testing.assert_close(cka(scale * acts[:, None], scale * acts[None]), cka(acts[:, None], acts[None]),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_constant_layer_whose_mean_rounds_is_refused(dtype: torch.dtype) -> None:
    """0.1 over 33 samples: the mean rounds, so the centred samples are not exactly 0 (a tiny, non-zero Gram); the
    layer is refused as constant all the same, not given a CKA of rounding errors."""
    acts = randn(3, 33, 40, dtype=dtype)
    acts[1] = 0.1
    assert bool((acts[1] - acts[1].mean(0)).abs().max() > 0)
    with pytest.raises(ValueError, match=r"cka: x is constant .*batch index \(1, 0\)"):
        cka(acts[:, None], acts[None])


def test_information_imbalance_of_float32_points_with_an_offset_is_the_float64_one():
    """A common offset costs float32 no neighbour ranks: the points are centred before their distances (the matrix
    product formula's rounding grows with |x|^2; NOTE [exact duplicates])."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 8, generator=g, dtype=torch.float64) @ torch.randn(8, 32, generator=g, dtype=torch.float64)
    y = torch.tanh(x @ torch.randn(32, 16, generator=g, dtype=torch.float64) / 4)
    shifted = (x + 1000.0).float()
    ours = information_imbalance(shifted, y.float())
    exact = information_imbalance(shifted.double(), y.float().double())
    # (a rank swapped at a float32 tie moves a mean by about 1e-5; the offset cost 2e-3)
    torch.testing.assert_close(torch.stack(ours).double(), torch.stack(exact), rtol=0, atol=1e-4)
