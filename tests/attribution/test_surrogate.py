"""lime and kernel_shap: Shapley values by enumeration, efficiency, linear models, composition, chunks, purity."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from _tolerance import assert_close_ulps
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torch import nn
from zoo import same, snapshot

import tdhook_fn
from tdhook_fn.attribution._kernel_shap import kernel_shap, shapley_kernel_samples
from tdhook_fn.attribution._lime import lime

METHODS = {"lime": lime, "kernel_shap": kernel_shap}


def mlp(n_in: int = 5, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(n_in, 10), nn.Tanh(), nn.Linear(10, 3)).double().eval()


@torch.no_grad()
def exact_shapley(net: nn.Module, x: torch.Tensor, base: torch.Tensor, target: int) -> torch.Tensor:
    """Shapley values of every element of ``x`` ``[N, F]`` by enumerating all coalitions."""
    n_features = x.shape[-1]

    def value(members: list[int]) -> torch.Tensor:
        keep = torch.zeros(n_features, dtype=torch.bool)
        keep[members] = True
        return net(torch.where(keep, x, base))[:, target]

    phi = torch.zeros_like(x)
    for i in range(n_features):
        others = [j for j in range(n_features) if j != i]
        for r in range(n_features):
            weight = math.factorial(r) * math.factorial(n_features - r - 1) / math.factorial(n_features)
            for members in itertools.combinations(others, r):
                phi[:, i] += weight * (value([*members, i]) - value(list(members)))
    return phi


def test_kernel_shap_converges_to_the_exact_shapley_values() -> None:
    net = mlp()
    f, p = tdhook_fn.pure(net)
    g = torch.Generator().manual_seed(0)
    x, base = torch.randn(2, 5, dtype=torch.float64, generator=g), torch.randn(2, 5, dtype=torch.float64, generator=g)
    exact = exact_shapley(net, x, base, 1)
    errors = [float((kernel_shap(f, p, x, base, target=1, n_samples=n, generator=torch.Generator().manual_seed(1))
                     - exact).abs().max()) for n in (50, 800, 12_800)]
    scale = float(exact.abs().max())
    assert errors[2] < 5e-3 * scale
    assert errors[2] < errors[1] < errors[0]


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), n_features=st.integers(2, 6), n_samples=st.integers(8, 60))
def test_kernel_shap_efficiency(seed: int, n_features: int, n_samples: int) -> None:
    """The values sum to ``F(x) - F(baseline)`` (up to the finite end-point weight), for any draws."""
    net = mlp(n_features, seed % 7)
    f, p = tdhook_fn.pure(net)
    g = torch.Generator().manual_seed(seed)
    x, base = torch.randn(3, n_features, dtype=torch.float64, generator=g), torch.randn(1, n_features,
                                                                                       dtype=torch.float64, generator=g)
    phi = kernel_shap(f, p, x, base, target=2, n_samples=n_samples, generator=g)
    with torch.no_grad():
        gap = net(x)[:, 2] - net(base.expand_as(x))[:, 2]
    # the end points weigh 1e6 against n_samples weights of 1: the sum is off by about n_samples / 1e6
    torch.testing.assert_close(phi.sum(-1), gap, rtol=0, atol=1e-5 * n_samples * (1 + float(gap.abs().max())))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), n_features=st.integers(2, 7), method=st.sampled_from(["kernel_shap", "linear"]))
def test_a_linear_model_is_recovered_exactly(seed: int, n_features: int, method: str) -> None:
    """For ``F(x) = w.x + c`` the fit is exact: ``w_i (x_i - b_i)``, for any samples spanning the features."""
    torch.manual_seed(seed)
    net = nn.Linear(n_features, 1).double()
    f, p = tdhook_fn.pure(net)
    g = torch.Generator().manual_seed(seed)
    x, base = torch.randn(2, n_features, dtype=torch.float64, generator=g), torch.randn(2, n_features,
                                                                                       dtype=torch.float64, generator=g)
    n = 4 * n_features + 8
    if method == "kernel_shap":
        phi = kernel_shap(f, p, x, base, target=0, n_samples=n, generator=g)
    else:
        phi = lime(f, p, x, base, target=0, n_samples=n, generator=g, interpretable_model="linear")
    expected = net.weight[0].detach() * (x - base)
    torch.testing.assert_close(phi, expected, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("name", list(METHODS))
def test_per_target_is_one_call_per_target(name: str) -> None:
    net = mlp()
    f, p = tdhook_fn.pure(net)
    x = TensorDict(input=torch.randn(4, 5, dtype=torch.float64), batch_size=[4])
    samples = shapley_kernel_samples(5, 30, (4,), generator=torch.Generator().manual_seed(2))
    method = METHODS[name]
    both = method(f, p, x, target=(0, 2), samples=samples, per_target=True)
    assert both.batch_size == torch.Size([2, 4])
    for t, c in enumerate((0, 2)):
        assert_close_ulps(both[t], method(f, p, x, target=c, samples=samples), ulps=64)
    summed = method(f, p, x, target=(0, 2), samples=samples, interpretable_model="linear") if name == "lime" else \
        method(f, p, x, target=(0, 2), samples=samples)
    if name == "kernel_shap":  # least squares is linear in the targets
        assert_close_ulps(summed["input"], both["input"].sum(0), ulps=64)


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("chunk_size", [1, 7, 100])
def test_chunk_size_gives_the_same_maps(name: str, chunk_size: int) -> None:
    net = mlp()
    f, p = tdhook_fn.pure(net)
    x = TensorDict(input=torch.randn(2, 3, 5, dtype=torch.float64), batch_size=[2, 3])
    samples = shapley_kernel_samples(5, 20, generator=torch.Generator().manual_seed(3))
    whole = METHODS[name](f, p, x, target=1, samples=samples)
    assert whole.batch_size == torch.Size([2, 3])
    assert_close_ulps(METHODS[name](f, p, x, target=1, samples=samples, chunk_size=chunk_size), whole, ulps=64)


@pytest.mark.parametrize("name", list(METHODS))
def test_vmap_per_sample_equals_the_batched_call(name: str) -> None:
    net = mlp()
    f, p = tdhook_fn.pure(net)
    x = TensorDict(input=torch.randn(4, 5, dtype=torch.float64), batch_size=[4])
    samples = shapley_kernel_samples(5, 24, generator=torch.Generator().manual_seed(4))
    batched = METHODS[name](f, p, x, target=1, samples=samples)
    per_sample = torch.vmap(lambda td: METHODS[name](f, p, td, target=1, samples=samples))(x)
    assert_close_ulps(per_sample, batched, ulps=2**12)  # (the lasso runs all its steps under vmap)


def test_vmap_draws_with_different_randomness() -> None:
    net = mlp()
    f, p = tdhook_fn.pure(net)
    x = TensorDict(input=torch.randn(3, 5, dtype=torch.float64).expand(3, 5).clone(), batch_size=[3])
    x["input"][:] = x["input"][0]
    out = torch.vmap(lambda td: kernel_shap(f, p, td, target=1, n_samples=12)["input"], randomness="different")(x)
    assert not torch.equal(out[0], out[1])  # the same input, other draws


def test_grad_through_params() -> None:
    """KernelSHAP of a linear model is ``w (x - b)``: its sum's gradient in the weight is ``x - b``."""
    torch.manual_seed(0)
    net = nn.Linear(4, 1).double()
    f, p = tdhook_fn.pure(net)
    x = torch.randn(3, 4, dtype=torch.float64)
    samples = shapley_kernel_samples(4, 20, generator=torch.Generator().manual_seed(5))

    def total(params: TensorDict) -> torch.Tensor:
        return kernel_shap(f, params, x, target=0, samples=samples).sum()

    grads = torch.func.grad(total)(p)
    torch.testing.assert_close(grads["weight"][0], x.sum(0), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", list(METHODS))
def test_nothing_is_mutated(name: str) -> None:
    net = mlp()
    before = snapshot(net)
    f, p = tdhook_fn.pure(net)
    p_before = p.clone()
    x = TensorDict(input=torch.randn(2, 5, dtype=torch.float64), batch_size=[2])
    x_before = x.clone()
    METHODS[name](f, p, x, 0.5, target=1, n_samples=10, chunk_size=3)
    assert same(before, snapshot(net))
    assert (p == p_before).all()
    assert (x == x_before).all()


def test_unbatched_input_and_a_batched_feature_mask() -> None:
    net = mlp()
    f, p = tdhook_fn.pure(net)
    x = torch.randn(2, 5, dtype=torch.float64)
    per_sample_masks = torch.tensor([[0, 0, 1, 1, 2], [0, 1, 1, 2, 2]])
    samples = shapley_kernel_samples(3, 10, generator=torch.Generator().manual_seed(6))
    both = kernel_shap(f, p, x, target=0, samples=samples, feature_mask=per_sample_masks)
    for b in range(2):
        one = kernel_shap(f, p, TensorDict(input=x[b], batch_size=[]), target=0, samples=samples,
                          feature_mask=per_sample_masks[b])["input"]
        assert_close_ulps(one, both[b], ulps=64)
    assert torch.equal(both[0, 0], both[0, 1]) and torch.equal(both[1, 3], both[1, 4])


def test_the_draws_follow_the_shapley_kernel() -> None:
    """Coalition sizes are drawn with probability proportional to ``(F - 1) / (k (F - k))``."""
    n_features = 6
    rows = shapley_kernel_samples(n_features, 40_002, generator=torch.Generator().manual_seed(7))
    assert rows[0].all() and not rows[1].any()
    sizes = rows[2:].sum(-1)
    k = torch.arange(1, n_features, dtype=torch.float64)
    expected = 1 / (k * (n_features - k))
    expected /= expected.sum()
    seen = torch.bincount(sizes, minlength=n_features)[1:].double() / len(sizes)
    torch.testing.assert_close(seen, expected, rtol=0, atol=0.01)
    members = rows[2:][sizes == 2].double().mean(0)  # uniform members
    torch.testing.assert_close(members, torch.full_like(members, 2 / n_features), rtol=0, atol=0.02)


def test_lime_seeded_draws_are_reproducible_and_float32_works() -> None:
    net = mlp().float()
    f, p = tdhook_fn.pure(net)
    x = torch.randn(3, 5)
    a = lime(f, p, x, target=1, generator=torch.Generator().manual_seed(8))
    b = lime(f, p, x, target=1, generator=torch.Generator().manual_seed(8))
    assert a.dtype == torch.float32 and torch.equal(a, b)


def test_a_callable_similarity_and_interpretable_model() -> None:
    net = mlp()
    f, p = tdhook_fn.pure(net)
    x = torch.randn(2, 5, dtype=torch.float64)
    samples = shapley_kernel_samples(5, 20, generator=torch.Generator().manual_seed(9))
    seen: dict[str, torch.Size] = {}

    def ones(inputs: TensorDict, perturbed: TensorDict, rows: torch.Tensor) -> torch.Tensor:
        seen["perturbed"], seen["rows"] = perturbed.batch_size, rows.shape
        return torch.ones(perturbed.batch_size, dtype=torch.float64)

    def zeros(xs: torch.Tensor, ys: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*xs.shape[:-2], ys.shape[-1], xs.shape[-1], dtype=xs.dtype)

    unweighted = lime(f, p, x, target=1, samples=samples, similarity_func=ones, interpretable_model="linear")
    assert seen == {"perturbed": torch.Size([2, 20]), "rows": torch.Size([2, 20, 5])}
    assert not unweighted.eq(0).all()
    assert lime(f, p, x, target=1, samples=samples, interpretable_model=zeros).eq(0).all()


def test_kernel_shap_compiles_with_fullgraph_given_its_samples() -> None:
    """With the samples given (no draws inside) and the default features; least squares by pseudo-inverse there."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).eval()
    f, p = tdhook_fn.pure(net)
    x = TensorDict(input=torch.randn(5, 3), batch_size=[5])
    samples = shapley_kernel_samples(3, 10, generator=torch.Generator().manual_seed(0))

    def explain(params: TensorDict, td: TensorDict) -> torch.Tensor:
        return kernel_shap(f, params, td, target=1, samples=samples)["input"]

    torch._dynamo.reset()
    compiled = torch.compile(explain, fullgraph=True)
    torch.testing.assert_close(compiled(p, x), explain(p, x), rtol=1e-5, atol=1e-6)


def test_threads_sharing_one_model_get_their_own_maps() -> None:
    """Three threads, each with its own params and inputs, on one shared model: each gets its own maps."""
    import threading

    net = mlp()
    before = snapshot(net)
    f, p = tdhook_fn.pure(net)
    samples = shapley_kernel_samples(5, 16, generator=torch.Generator().manual_seed(10))
    params = [p.apply(lambda t, s=s: t * s) for s in (1.0, 0.5, -1.0)]
    xs = [torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    expected = [kernel_shap(f, params[i], xs[i], target=1, samples=samples) for i in range(3)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(3)

    def work(i: int) -> None:
        try:
            barrier.wait()
            for _ in range(10):
                assert torch.equal(kernel_shap(f, params[i], xs[i], target=1, samples=samples), expected[i])
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert same(before, snapshot(net))


@pytest.mark.parametrize("name", list(METHODS))
def test_a_non_tensor_input_reaches_the_forward_of_every_sample(name: str) -> None:
    """The samples go to the engine as flat copies (NOTE [flat copies]); a string kwarg goes with them."""
    from tensordict import NonTensorData
    from zoo import Moded

    torch.manual_seed(0)
    net = Moded()
    moded, p = tdhook_fn.pure(net, in_keys={"input": "x", "mode": "mode"})
    plain, plain_params = tdhook_fn.pure(nn.Sequential(net.lin, nn.Tanh()))
    x = torch.randn(3, 2)
    td = TensorDict(input=x, batch_size=[3])
    td["mode"] = NonTensorData("tanh")
    samples = shapley_kernel_samples(2, 6, (3,), generator=torch.Generator().manual_seed(2))
    ours = METHODS[name](moded, p, td, target=0, input_keys=["input"], samples=samples)["input"]
    want = METHODS[name](plain, plain_params, TensorDict(input=x, batch_size=[3]), target=0,
                         samples=samples)["input"]
    torch.testing.assert_close(ours, want)
