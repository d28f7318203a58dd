"""gradient_shap against captum 0.9's GradientShap given captum's draws; completeness; chunks, transforms, purity.

captum draws the baseline indices and the path points from numpy's global generator and
the noise from torch's; ``_captum_draws`` replays them in captum's order (indices input
after input, then the noise, then the points) as the ``draws`` TensorDict.
"""

import attr_zoo
import captum.attr as ca
import numpy as np
import pytest
import torch
from _tolerance import assert_close_ulps
from attr_zoo import DTYPES, as_tuple, assert_same, build, captum_inputs, from_captum
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from zoo import Moded, same, snapshot

from tdhook_fn import functional, params
from tdhook_fn.attribution import saliency
from tdhook_fn.attribution._gradient_shap import gradient_shap

pytestmark = [pytest.mark.filterwarnings("ignore:Input Tensor .* did not already require gradients:UserWarning")]

NAMES = ("mlp", "cnn", "transformer", "two_input")
BATCHES = [(3,), (), (2, 3)]


@pytest.fixture(autouse=True)
def _one_thread():
    yield from attr_zoo.one_thread()


def _references(e, n=6, seed=9):
    refs = e.inputs((n,), seed=seed)
    return refs


def _captum_draws(e, batch, refs, k, stdevs, seed=0):
    """captum's draws for one call (one partition of k copies), replayed from the same seeds."""
    np.random.seed(seed)
    torch.manual_seed(seed)
    n = int(np.prod(batch)) if batch else 1
    index = {key: torch.tensor(np.random.choice(refs.batch_size[0], k * n)).reshape(*batch, k) for key in e.in_keys}
    noise = {}
    for key in e.in_keys:
        shape = refs[key].shape[1:]
        noise[key] = (torch.randn(n * k, *shape) * stdevs).reshape(*batch, k, *shape)
    alpha = torch.tensor(np.random.uniform(0.0, 1.0, n * k)).reshape(*batch, k)
    return TensorDict(index=TensorDict(index, batch_size=[*batch, k]), alpha=alpha,
                      noise=TensorDict(noise, batch_size=[*batch, k]), batch_size=[*batch, k])


def _captum(e, td, refs, k, stdevs, target, seed=0):
    np.random.seed(seed)
    torch.manual_seed(seed)
    base = tuple(refs[key] for key in e.in_keys)
    return as_tuple(ca.GradientShap(e.model).attribute(captum_inputs(e, td), base if len(base) > 1 else base[0],
                                                       n_samples=k, stdevs=stdevs, target=target))


@pytest.mark.parametrize("batch", BATCHES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("stdevs", (0.0, 0.2))
@pytest.mark.parametrize("name", NAMES)
def test_gradient_shap_equals_captum_given_its_draws(name, stdevs, dtype, batch):
    e = build(name, dtype)
    td, refs = e.inputs(batch), _references(e)
    before = snapshot(e.model)
    ours = gradient_shap(e.f, e.params, td, refs, target=1, n_samples=5, draws=_captum_draws(e, batch, refs, 5, stdevs))
    assert same(before, snapshot(e.model))
    theirs = _captum(e, td, refs, 5, stdevs, target=1)
    assert ours.batch_size == torch.Size(batch)
    for key, t in zip(e.in_keys, theirs, strict=True):
        assert_same(ours[key], from_captum(t, batch), exact=name != "transformer")


@pytest.mark.parametrize("name", ("mlp", "cnn"))
def test_chunks_give_the_same_maps(name):
    e = build(name)
    td, refs = e.inputs((4,)), _references(e)
    draws = _captum_draws(e, (4,), refs, 7, 0.3)
    whole = gradient_shap(e.f, e.params, td, refs, target=2, n_samples=7, draws=draws)
    for chunk in (1, 3, 7):
        assert_close_ulps(gradient_shap(e.f, e.params, td, refs, target=2, n_samples=7, draws=draws,
                                        chunk_size=chunk)["input"], whole["input"])


def _linear():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 3)).double().eval()
    return net, functional(net), params(net)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), k=st.integers(1, 8), n_refs=st.integers(1, 5))
def test_on_a_linear_model_each_map_sums_to_the_change_from_the_drawn_baselines(seed, k, n_refs):
    """Completeness per draw: a linear model's gradient is constant, so sum(attr) = F(x) - mean_j F(b_j)."""
    net, f, p = _linear()
    g = torch.Generator().manual_seed(seed)
    x, refs = torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randn(n_refs, 5, generator=g,
                                                                             dtype=torch.float64)
    index = torch.randint(n_refs, (4, k), generator=g)
    draws = TensorDict(index=index, alpha=torch.rand(4, k, generator=g, dtype=torch.float64), batch_size=[4, k])
    attr = gradient_shap(f, p, x, refs, target=2, n_samples=k, draws=draws)
    with torch.no_grad():
        change = net(x)[:, 2] - net(refs)[:, 2][index].mean(-1)
    torch.testing.assert_close(attr.sum(-1), change, rtol=1e-12, atol=1e-12)


def test_on_average_the_maps_sum_to_the_expected_change():
    """GradientSHAP's expectation: E[sum(attr)] = F(x) - E_b F(b) holds on average for a smooth model."""
    e = build("transformer", torch.float64)
    td, refs = e.inputs((3,)), 0.5 * _references(e, n=4)
    attr = gradient_shap(e.f, e.params, td, refs, target=0, n_samples=4000, chunk_size=1000,
                         generator=torch.Generator().manual_seed(0))["input"]
    with torch.no_grad():
        change = e.model(td["input"])[:, 0] - e.model(refs["input"])[:, 0].mean()
    total = attr.flatten(1).sum(-1)
    torch.testing.assert_close(total, change, rtol=0.05, atol=0.01 * float(change.abs().max()))


def test_one_baseline_and_the_point_at_the_input_is_input_x_gradient_minus_baseline():
    e = build("cnn", torch.float64)
    td = e.inputs((3,))
    refs = TensorDict(input=torch.zeros(1, *td["input"].shape[1:], dtype=torch.float64), batch_size=[1])
    draws = TensorDict(index=torch.zeros(3, 2, dtype=torch.long), alpha=torch.ones(3, 2, dtype=torch.float64),
                       batch_size=[3, 2])
    ours = gradient_shap(e.f, e.params, td, refs, target=1, n_samples=2, draws=draws)
    assert_close_ulps(ours["input"], saliency(e.f, e.params, td, target=1, multiply_by_inputs=True)["input"])
    plain = gradient_shap(e.f, e.params, td, refs, target=1, n_samples=2, draws=draws, multiply_by_inputs=False)
    assert_close_ulps(plain["input"], saliency(e.f, e.params, td, target=1)["input"])


def test_per_target_equals_one_call_per_target():
    e = build("mlp")
    td, refs = e.inputs((3,)), _references(e)
    draws = _captum_draws(e, (3,), refs, 4, 0.1)
    both = gradient_shap(e.f, e.params, td, refs, target=(0, 2), n_samples=4, draws=draws, per_target=True)
    assert both.batch_size == torch.Size([2, 3])
    for i, t in enumerate((0, 2)):
        one = gradient_shap(e.f, e.params, td, refs, target=t, n_samples=4, draws=draws)
        assert_close_ulps(both["input"][i], one["input"])


def test_generator_draws_reproducibly_and_vmap_per_sample_equals_the_batch_given_the_draws():
    e = build("cnn")
    td, refs = e.inputs((3,)), _references(e)
    one = gradient_shap(e.f, e.params, td, refs, target=1, stdevs=0.1, generator=torch.Generator().manual_seed(3))
    two = gradient_shap(e.f, e.params, td, refs, target=1, stdevs=0.1, generator=torch.Generator().manual_seed(3))
    assert torch.equal(one["input"], two["input"])
    draws = _captum_draws(e, (3,), refs, 5, 0.1)
    batched = gradient_shap(e.f, e.params, td, refs, target=1, draws=draws)
    per_sample = torch.func.vmap(lambda s, d: gradient_shap(e.f, e.params, s, refs, target=1, draws=d))(td, draws)
    assert_close_ulps(per_sample["input"], batched["input"])


def test_nothing_is_written():
    e = build("two_input")
    td, refs = e.inputs((3,)), _references(e)
    inputs, p, r, before = td.clone(), e.params.clone(), refs.clone(), snapshot(e.model)
    gradient_shap(e.f, e.params, td, refs, target=1, stdevs=0.2)
    assert (td == inputs).all() and (e.params == p).all() and (refs == r).all()
    assert same(before, snapshot(e.model))


def test_a_tensor_of_references_and_a_tensor_target_work_captum_style():
    e = build("mlp")
    x, refs = e.inputs((4,))["input"], _references(e)["input"]
    labels = torch.tensor([0, 2, 1, 2])
    draws = _captum_draws(e, (4,), TensorDict(input=refs, batch_size=[len(refs)]), 5, 0.0)
    ours = gradient_shap(e.f, e.params, x, refs, target=labels, draws=draws)
    np.random.seed(0)
    torch.manual_seed(0)
    theirs = ca.GradientShap(e.model).attribute(x.clone(), refs, target=labels)
    assert_same(ours, theirs, exact=True)


@pytest.mark.parametrize("name", ("mlp", "cnn", "two_input"))
def test_convergence_delta_per_draw_equals_captums(name):
    e = build(name, torch.float64)
    td, refs = e.inputs((3,)), _references(e)
    attrs, delta = gradient_shap(e.f, e.params, td, refs, target=2, n_samples=4, chunk_size=3,
                                 draws=_captum_draws(e, (3,), refs, 4, 0.1), return_convergence_delta=True)
    np.random.seed(0)
    torch.manual_seed(0)
    base = tuple(refs[key] for key in e.in_keys)
    theirs, their_delta = ca.GradientShap(e.model).attribute(
        captum_inputs(e, td), base if len(base) > 1 else base[0], n_samples=4, stdevs=0.1, target=2,
        return_convergence_delta=True)
    assert delta.shape == (3, 4)
    assert_close_ulps(delta.reshape(-1), their_delta.to(delta.dtype), scale=float(delta.abs().max()) + 1.0)
    for key, t in zip(e.in_keys, as_tuple(theirs), strict=True):
        assert_same(attrs[key], t, exact=False)


def test_convergence_delta_is_zero_for_a_linear_model_per_target():
    net, f, p = _linear()
    x, refs = torch.randn(4, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    _, delta = gradient_shap(f, p, x, refs, target=(0, 2), per_target=True, n_samples=6, return_convergence_delta=True,
                             generator=torch.Generator().manual_seed(0))
    assert delta.shape == (2, 4, 6)
    torch.testing.assert_close(delta, torch.zeros_like(delta), atol=1e-12, rtol=0)


class _Tanh(torch.nn.Module):
    def __init__(self, inner: Moded) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x, mode="tanh")


def test_a_non_tensor_input_reaches_the_forward_of_every_draw():
    """The draws go to the engine flattened (NOTE [flat copies]); a string kwarg goes with them."""
    from tensordict import NonTensorData

    import tdhook_fn

    torch.manual_seed(0)
    net = Moded()
    f, p = tdhook_fn.pure(net, in_keys={"input": "x", "mode": "mode"})
    td = TensorDict(input=torch.randn(3, 2), batch_size=[3])
    td["mode"] = NonTensorData("tanh")
    refs = TensorDict(input=torch.randn(4, 2), batch_size=[4])
    ours = gradient_shap(f, p, td, refs, target=0, input_keys=["input"], n_samples=6, stdevs=0.1,
                         generator=torch.Generator().manual_seed(1))["input"]
    g, q = tdhook_fn.pure(_Tanh(net))
    theirs = gradient_shap(g, q, td.select("input"), refs, target=0, n_samples=6, stdevs=0.1,
                           generator=torch.Generator().manual_seed(1))["input"]
    assert_close_ulps(ours, theirs)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_path_points_of_a_large_call_are_captums_bitwise(dtype):
    # (20,480 points, a smooth model: the vectorised kernels, where a fused multiply-add would round the points
    # differently from captum's ``a * x + (1 - a) * b``; the zoo's small calls run the scalar tail only)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10)).to(dtype)
    x, refs, n, k = torch.randn(16, 64, dtype=dtype), torch.randn(6, 64, dtype=dtype), 16, 20
    np.random.seed(2)
    torch.manual_seed(2)
    index = torch.tensor(np.random.choice(len(refs), k * n)).view(n, k)
    torch.randn(n * k, 64)  # (captum's zero noise)
    alpha = torch.tensor(np.random.uniform(0.0, 1.0, n * k)).view(n, k)
    ours = gradient_shap(functional(model), params(model), x, refs, target=3, n_samples=k,
                         draws=TensorDict(index=index, alpha=alpha, batch_size=[n, k]))
    np.random.seed(2)
    torch.manual_seed(2)
    theirs = ca.GradientShap(model).attribute(x.clone(), refs, n_samples=k, target=3)
    assert torch.equal(ours, theirs)


def test_draws_with_noise_not_keyed_like_the_inputs_name_the_entry():
    net = torch.nn.Linear(3, 2)
    f, p = functional(net), params(net)
    x = TensorDict(input=torch.randn(4, 3), batch_size=[4])
    refs = TensorDict(input=torch.randn(6, 3), batch_size=[6])
    draws = TensorDict(index=torch.zeros(4, 2, dtype=torch.long), alpha=torch.rand(4, 2),
                       noise=torch.zeros(4, 2, 3), batch_size=[4, 2])
    with pytest.raises(TypeError, match=r"draws 'noise' must be a TensorDict keyed like the attributed inputs"):
        gradient_shap(f, p, x, refs, target=0, n_samples=2, draws=draws)
    draws["noise"] = TensorDict(input=torch.zeros(4, 2, 3), batch_size=[4, 2])
    expected = gradient_shap(f, p, x, refs, target=0, n_samples=2, draws=draws.exclude("noise"))
    torch.testing.assert_close(gradient_shap(f, p, x, refs, target=0, n_samples=2, draws=draws), expected)
