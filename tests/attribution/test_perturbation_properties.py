"""The perturbation methods' own properties: chunks, vmap, grad, batch shapes, purity, axioms, errors.

Shapley sampling's efficiency (the shares of every order sum to ``F(x) - F(b)``) is a
hypothesis property; its convergence is checked against exact Shapley values computed
by enumerating every coalition of four features.
"""

from __future__ import annotations

import itertools
import math

import attr_zoo
import pytest
import torch
from _tolerance import assert_close_ulps
from attr_zoo import build
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution._feature_ablation import feature_ablation
from tdhook_fn.attribution._feature_permutation import feature_permutation
from tdhook_fn.attribution._occlusion import occlusion
from tdhook_fn.attribution._shapley_value_sampling import shapley_value_sampling

F64 = torch.float64


@pytest.fixture(autouse=True)
def _one_thread():
    yield from attr_zoo.one_thread()


def methods(seed: int = 0):
    """Each method as ``call(f, params, inputs, **options)`` with its random draws fixed by ``seed``."""
    return {
        "feature_ablation": lambda f, p, x, **kw: feature_ablation(f, p, x, 0.1, target=1, **kw),
        "occlusion": lambda f, p, x, **kw: occlusion(f, p, x, 0.1, target=1, sliding_window_shapes=(1, 2, 3),
                                                     strides=(1, 1, 2), **kw),
        "feature_permutation": lambda f, p, x, **kw: feature_permutation(
            f, p, x, target=1, generator=torch.Generator().manual_seed(seed), **kw),
        "shapley_value_sampling": lambda f, p, x, **kw: shapley_value_sampling(
            f, p, x, 0.1, target=1, n_samples=2, generator=torch.Generator().manual_seed(seed), **kw),
    }


METHODS = list(methods())


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("chunk_size", [1, 4, 13])
def test_chunks_give_the_same_maps(name, chunk_size):
    e = build("cnn", F64)
    td = e.inputs((3,))
    call = methods()[name]
    assert_close_ulps(call(e.f, e.params, td, chunk_size=chunk_size), call(e.f, e.params, td), scale=10.0)


@pytest.mark.parametrize("name", ["feature_ablation", "occlusion", "shapley_value_sampling"])
def test_batch_shapes_are_kept_and_equal_the_flat_batch(name):
    e = build("cnn", F64)
    td = e.inputs((2, 3))
    call = methods()[name]
    ours = call(e.f, e.params, td)
    assert ours.batch_size == (2, 3) and ours["input"].shape == (2, 3, 1, 5, 5)
    assert_close_ulps(ours.reshape(-1), call(e.f, e.params, td.reshape(-1)), scale=10.0)
    one = call(e.f, e.params, td[0, 1])
    assert one.batch_size == () and one["input"].shape == (1, 5, 5)
    assert_close_ulps(one["input"], ours["input"][0, 1], scale=10.0)


def test_feature_permutation_keeps_batch_shapes():
    e = build("mlp", F64)
    td = e.inputs((2, 3))
    ours = methods()["feature_permutation"](e.f, e.params, td)
    assert ours["input"].shape == (2, 3, 4)
    assert_close_ulps(ours.reshape(-1), methods()["feature_permutation"](e.f, e.params, td.reshape(-1)), scale=10.0)


@pytest.mark.parametrize("name", ["feature_ablation", "occlusion"])
def test_vmap_per_sample_equals_the_batched_call(name):
    e = build("cnn", F64)
    td = e.inputs((4,))
    call = methods()[name]
    per_sample = torch.vmap(lambda one: call(e.f, e.params, one))(td)
    assert_close_ulps(per_sample, call(e.f, e.params, td), scale=10.0)


def test_vmap_shapley_with_the_same_draws_equals_the_batched_call():
    e = build("mlp", F64)
    td = e.inputs((4,))
    g = torch.Generator()
    batched = shapley_value_sampling(e.f, e.params, td, target=1, n_samples=5, generator=g.manual_seed(3))
    g.manual_seed(3)
    per_sample = torch.vmap(lambda one: shapley_value_sampling(e.f, e.params, one, target=1, n_samples=5,
                                                               generator=g), randomness="same")(td)
    assert_close_ulps(per_sample, batched, scale=10.0)


def test_grad_with_respect_to_params_is_that_of_the_formula():
    """A linear model ablated to 0: the map is ``W[t, j] x_j``, so d(sum of maps)/dW[t] is ``sum_n x_n``."""
    torch.manual_seed(0)
    net = nn.Linear(5, 3).double()
    f, p = tdhook_fn.pure(net)
    x = TensorDict(input=torch.randn(4, 5, dtype=F64), batch_size=[4])
    grads = torch.func.grad(lambda q: feature_ablation(f, q, x, target=2)["input"].sum())(p)
    expected = torch.zeros(3, 5, dtype=F64)
    expected[2] = x["input"].sum(0)
    torch.testing.assert_close(grads["weight"], expected)
    torch.testing.assert_close(grads["bias"], torch.zeros(3, dtype=F64))


@pytest.mark.parametrize("name", METHODS)
def test_inputs_params_and_model_are_left_alone(name):
    e = build("cnn", F64)
    td = e.inputs((3,))
    params = e.params
    td_copy, params_copy = td.clone(), params.clone()
    weight = e.model[0].weight.detach().clone()
    methods()[name](e.f, params, td)
    assert (td == td_copy).all() and (params == params_copy).all()
    assert torch.equal(e.model[0].weight, weight)


def test_token_ids_are_ablated_to_a_pad_id():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2)).double()
    f, p = tdhook_fn.pure(net)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    ours = feature_ablation(f, p, ids, 0, target=1)
    for j in range(3):
        ablated = ids.clone()
        ablated[:, j] = 0
        torch.testing.assert_close(ours[:, j], net(ids)[:, 1] - net(ablated)[:, 1])
    assert occlusion(f, p, ids, 0, target=1, sliding_window_shapes=(1,)).dtype == F64
    with pytest.raises(ValueError, match="not a whole number"):
        feature_ablation(f, p, ids, 0.5, target=1)


def test_a_linear_model_gets_exact_shapley_values_from_any_order():
    """Additive in its features: every marginal is ``w_j (x_j - b_j)``, whatever the order."""
    torch.manual_seed(0)
    net = nn.Linear(6, 2).double()
    f, p = tdhook_fn.pure(net)
    x, b = torch.randn(3, 6, dtype=F64), torch.randn(1, 6, dtype=F64)
    phi = shapley_value_sampling(f, p, x, b, target=0, n_samples=3)
    torch.testing.assert_close(phi, net.weight[0].detach() * (x - b))
    torch.testing.assert_close(feature_ablation(f, p, x, b, target=0), phi)


def exact_shapley(model, x, b, target):
    """Shapley values by the coalition formula, every coalition of the ``d`` features enumerated."""
    d = x.shape[-1]
    phi = torch.zeros_like(x)
    for j in range(d):
        others = [i for i in range(d) if i != j]
        for size in range(d):
            weight = math.factorial(size) * math.factorial(d - size - 1) / math.factorial(d)
            for coalition in itertools.combinations(others, size):
                on = torch.zeros(d, dtype=torch.bool)
                on[list(coalition)] = True
                without = torch.where(on, x, b)
                on[j] = True
                phi[:, j] += weight * (model(torch.where(on, x, b))[:, target] - model(without)[:, target])
    return phi


def test_shapley_value_sampling_converges_to_exact_shapley_values():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).double().eval()
    f, p = tdhook_fn.pure(net)
    x, b = 2 * torch.randn(3, 4, dtype=F64), torch.zeros(1, 4, dtype=F64)
    with torch.no_grad():
        exact = exact_shapley(net, x, b, 1)
    g = torch.Generator().manual_seed(0)
    few = shapley_value_sampling(f, p, x, b, target=1, n_samples=8, generator=g)
    many = shapley_value_sampling(f, p, x, b, target=1, n_samples=4000, generator=g, chunk_size=4000)
    scale = exact.abs().max().item()
    assert (many - exact).abs().max().item() < 0.01 * scale
    assert (many - exact).abs().max() < (few - exact).abs().max()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), n_samples=st.integers(1, 6), groups=st.lists(st.integers(0, 3), min_size=5,
                                                                                    max_size=5))
def test_shapley_shares_of_any_orders_sum_to_the_change_of_the_target(seed, n_samples, groups):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    f, p = tdhook_fn.pure(net)
    x, b = torch.randn(3, 5, dtype=F64), torch.randn(3, 5, dtype=F64)
    mask = torch.tensor(groups)
    phi = shapley_value_sampling(f, p, x, b, target=1, n_samples=n_samples, feature_mask=mask[None],
                                 generator=torch.Generator().manual_seed(seed))
    # one element per group carries the group's share
    firsts = [groups.index(g) for g in sorted(set(groups))]
    with torch.no_grad():
        change = net(x)[:, 1] - net(b)[:, 1]
    torch.testing.assert_close(phi[:, firsts].sum(-1), change, rtol=1e-12, atol=1e-12)
    for j, g in enumerate(groups):
        assert torch.equal(phi[:, j], phi[:, groups.index(g)])


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), a=st.floats(-2, 2), c=st.floats(-2, 2))
def test_ablation_and_occlusion_are_linear_in_the_target(seed, a, c):
    """Differences of target values: the map of ``a F_0 + c F_1`` is ``a`` map_0 ``+ c`` map_1."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)).double()
    f, p = tdhook_fn.pure(net)
    x = torch.randn(3, 4, dtype=F64)

    def mixed(td):
        return td["output"][..., 0] * a + td["output"][..., 1] * c

    both = feature_ablation(f, p, x, target=(0, 1), per_target=True)
    torch.testing.assert_close(feature_ablation(f, p, x, target=mixed), a * both[0] + c * both[1])
    windows = occlusion(f, p, x, target=(0, 1), per_target=True, sliding_window_shapes=(2,))
    torch.testing.assert_close(occlusion(f, p, x, target=mixed, sliding_window_shapes=(2,)),
                               a * windows[0] + c * windows[1])


# ------------------------------------------------------------------ errors


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    f, p = tdhook_fn.pure(net)
    return f, p, torch.randn(3, 4)


def test_bad_windows_and_strides_raise(tiny):
    f, p, x = tiny
    with pytest.raises(ValueError, match="larger than one sample"):
        occlusion(f, p, x, target=0, sliding_window_shapes=(5,))
    with pytest.raises(ValueError, match="never be occluded"):
        occlusion(f, p, x, target=0, sliding_window_shapes=(2,), strides=3)
    with pytest.raises(ValueError, match="one size per dim"):
        occlusion(f, p, x, target=0, sliding_window_shapes=(2, 2))
    with pytest.raises(TypeError, match="tuple of ints"):
        occlusion(f, p, x, target=0, sliding_window_shapes=2)


def test_bad_feature_masks_raise(tiny):
    f, p, x = tiny
    with pytest.raises(TypeError, match="integer feature ids"):
        feature_ablation(f, p, x, target=0, feature_mask=torch.zeros(1, 4))
    with pytest.raises(ValueError, match="does not broadcast"):
        feature_ablation(f, p, x, target=0, feature_mask=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="negative ids"):
        shapley_value_sampling(f, p, x, target=0, feature_mask=torch.tensor([[-1, 0, 1, 1]]))


def test_bad_counts_and_batches_raise(tiny):
    f, p, x = tiny
    with pytest.raises(ValueError, match="n_samples must be a positive int"):
        shapley_value_sampling(f, p, x, target=0, n_samples=0)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        feature_ablation(f, p, x, target=0, chunk_size=0)
    with pytest.raises(ValueError, match="at least two"):
        feature_permutation(f, p, x[:1], target=0)


def test_occlusion_masks_built_per_chunk_equal_those_built_at_once(monkeypatch):
    """Windows over large inputs are built chunk by chunk (from their index), small ones all at once."""
    import tdhook_fn.attribution._occlusion as module

    e = build("cnn", F64)
    td = e.inputs((3,))
    call = methods()["occlusion"]
    at_once = call(e.f, e.params, td, chunk_size=5)
    monkeypatch.setattr(module, "_ALL_MASKS", 0)
    assert torch.equal(call(e.f, e.params, td, chunk_size=5)["input"], at_once["input"])


def test_occlusion_spread_dim_by_dim_equals_one_product_with_every_mask(monkeypatch):
    """Small inputs spread the changes by one product with every window's mask, large ones a dim at a time."""
    import tdhook_fn.attribution._occlusion as module

    e = build("cnn", F64)
    td = e.inputs((3,))
    call = methods()["occlusion"]
    dense = call(e.f, e.params, td, chunk_size=5)
    monkeypatch.setattr(module, "_DENSE_SPREAD", 0)
    assert_close_ulps(call(e.f, e.params, td, chunk_size=5), dense, scale=10.0)


def test_calls_from_several_threads_give_each_its_own_maps():
    from concurrent.futures import ThreadPoolExecutor

    e = build("cnn", F64)
    inputs = [e.inputs((3,), seed=s) for s in range(6)]
    alone = [feature_ablation(e.f, e.params, td, 0.1, target=1, chunk_size=4) for td in inputs]
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda td: feature_ablation(e.f, e.params, td, 0.1, target=1, chunk_size=4), inputs))
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(a["input"], b["input"])


def test_baselines_that_require_grad_get_their_gradient():
    """Eager autograd through the maps: ``W[t, j] (x_j - b_j)`` for a linear model, so d(sum)/db is ``-W[t]``."""
    torch.manual_seed(0)
    net = nn.Linear(5, 3).double()
    f, p = tdhook_fn.pure(net)
    x = torch.randn(4, 5, dtype=F64)
    b = torch.zeros(4, 5, dtype=F64, requires_grad=True)
    feature_ablation(f, p, x, b, target=2).sum().backward()
    torch.testing.assert_close(b.grad, -net.weight[2].detach().expand(4, 5))


@pytest.mark.parametrize("name", ["occlusion", "feature_ablation"])
def test_fullgraph_compile_equals_eager(name):
    """Dynamo traces the deterministic methods whole (the random ones draw and compare permutations in Python)."""
    torch._dynamo.reset()
    e = build("cnn", F64)
    td = e.inputs((3,))
    call = methods()[name]
    compiled = torch.compile(lambda x: call(e.f, e.params, x, chunk_size=7), fullgraph=True, backend="eager")
    assert_close_ulps(compiled(td), call(e.f, e.params, td, chunk_size=7), scale=10.0)


@pytest.mark.parametrize("chunk_size", [None, 1, 6, 100])
def test_each_forward_holds_at_most_chunk_size_copies_of_the_batch(chunk_size):
    """Memory is bounded by ``chunk_size``: every forward sees at most ``chunk_size * N`` samples, and every
    perturbation is evaluated once. (By default, test_chunk_rows.py: this narrow model runs every row at once.)"""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(300, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    f, p = tdhook_fn.pure(net)
    sizes = []

    def recording(params, td):
        sizes.append(td.batch_size[0])
        return f(params, td)

    x = torch.randn(5, 300, dtype=F64)
    mask = (torch.arange(300) // 10)[None]  # 30 features: 31 rows with the unablated inputs
    feature_ablation(recording, p, x, target=1, feature_mask=mask, chunk_size=chunk_size)  # (a first call probes)
    sizes.clear()
    ours = feature_ablation(recording, p, x, target=1, feature_mask=mask, chunk_size=chunk_size)
    assert sum(sizes) == 31 * 5
    assert max(sizes) <= (chunk_size or 31) * 5
    assert_close_ulps(ours, feature_ablation(f, p, x, target=1, feature_mask=mask, chunk_size=31), scale=10.0)
