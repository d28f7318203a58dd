"""smoothgrad against captum 0.9's NoiseTunnel, seeded alike; its axioms, chunks, transforms and purity.

captum draws its noise with ``torch.normal`` from the global generator, in float32, per
chunk of ``nt_samples_batch_size`` copies and input after input; seeding torch alike and
drawing float32 noise (``noise_dtype``) gives the same noisy inputs (NOTE [noise draws]).
"""

import functools

import attr_zoo
import captum.attr as ca
import pytest
import torch
from _tolerance import assert_close_ulps
from attr_zoo import DTYPES, as_tuple, assert_same, build, captum_inputs, from_captum
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from zoo import Moded, same, snapshot

from tdhook_fn.attribution import integrated_gradients, saliency
from tdhook_fn.attribution._smoothgrad import smoothgrad

pytestmark = [
    pytest.mark.filterwarnings("ignore:Input Tensor .* did not already require gradients:UserWarning"),
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
]

NAMES = ("mlp", "cnn", "transformer", "two_input")
BATCHES = [(3,), (), (2, 3)]
NT_TYPES = ("smoothgrad", "smoothgrad_sq", "vargrad")
ABS_SALIENCY = functools.partial(saliency, abs=True)


@pytest.fixture(autouse=True)
def _one_thread():
    yield from attr_zoo.one_thread()


def _seeded(seed, fn, *args, **kwargs):
    torch.manual_seed(seed)
    return fn(*args, **kwargs)


@pytest.mark.parametrize("batch", BATCHES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("nt_type", NT_TYPES)
@pytest.mark.parametrize("name", NAMES)
def test_smoothgrad_equals_captum_noise_tunnel_saliency(name, nt_type, dtype, batch):
    e = build(name, dtype)
    td = e.inputs(batch)
    before = snapshot(e.model)
    ours = _seeded(5, smoothgrad, e.f, e.params, td, target=1, nt_type=nt_type, nt_samples=6, stdevs=0.3,
                   attribution=ABS_SALIENCY, noise_dtype=torch.float32)
    assert same(before, snapshot(e.model))
    theirs = as_tuple(_seeded(5, ca.NoiseTunnel(ca.Saliency(e.model)).attribute, captum_inputs(e, td),
                              nt_type=nt_type, nt_samples=6, stdevs=0.3, target=1))
    assert ours.batch_size == torch.Size(batch)
    for key, t in zip(e.in_keys, theirs, strict=True):
        assert_same(ours[key], from_captum(t, batch), exact=name != "transformer")


@pytest.mark.parametrize("name", ("mlp", "cnn"))
def test_chunks_equal_captum_nt_samples_batch_size(name):
    """7 copies in chunks of 3 (3 + 3 + 1): the noise drawn chunk by chunk, as captum's partitions."""
    e = build(name)
    td = e.inputs((4,))
    for nt_type in NT_TYPES:
        ours = _seeded(1, smoothgrad, e.f, e.params, td, target=2, nt_type=nt_type, nt_samples=7, stdevs=0.5,
                       chunk_size=3)
        theirs = _seeded(1, ca.NoiseTunnel(ca.Saliency(e.model)).attribute, captum_inputs(e, td), nt_type=nt_type,
                         nt_samples=7, stdevs=0.5, target=2, nt_samples_batch_size=3, abs=False)
        assert_same(ours["input"], theirs, exact=True)


def test_stdevs_per_input_equal_captum_tuple():
    e = build("two_input")
    td = e.inputs((3,))
    ours = _seeded(2, smoothgrad, e.f, e.params, td, target=0, nt_samples=4, stdevs=(0.1, 0.7))
    mapped = _seeded(2, smoothgrad, e.f, e.params, td, target=0, nt_samples=4, stdevs={"y": 0.7, "x": 0.1})
    theirs = _seeded(2, ca.NoiseTunnel(ca.Saliency(e.model)).attribute, captum_inputs(e, td), nt_samples=4,
                     stdevs=(0.1, 0.7), target=0, abs=False)
    for key, t in zip(e.in_keys, theirs, strict=True):
        assert_same(ours[key], t, exact=True)
        assert_same(mapped[key], t, exact=True)


@pytest.mark.parametrize("name", ("mlp", "cnn", "transformer"))
def test_input_x_gradient_inside_equals_captum(name):
    e = build(name, torch.float64)
    td = e.inputs((3,))
    ours = _seeded(3, smoothgrad, e.f, e.params, td, target=1, nt_type="vargrad", nt_samples=5, stdevs=0.2,
                   attribution=functools.partial(saliency, multiply_by_inputs=True), noise_dtype=torch.float32)
    theirs = _seeded(3, ca.NoiseTunnel(ca.InputXGradient(e.model)).attribute, captum_inputs(e, td),
                     nt_type="vargrad", nt_samples=5, stdevs=0.2, target=1)
    assert_same(ours["input"], theirs, exact=name != "transformer")


@pytest.mark.parametrize("name", ("mlp", "cnn", "transformer"))
def test_integrated_gradients_inside_equals_captum(name):
    """Every noisy copy's integrated gradients (baselines repeated, not noised) in one batched call."""
    e = build(name, torch.float64)
    td, base = e.inputs((3,)), e.baselines((3,))
    ours = _seeded(4, smoothgrad, e.f, e.params, td, base, target=0, nt_samples=4, stdevs=0.2, chunk_size=3,
                   attribution=functools.partial(integrated_gradients, n_steps=8), noise_dtype=torch.float32)
    theirs = _seeded(4, ca.NoiseTunnel(ca.IntegratedGradients(e.model)).attribute, captum_inputs(e, td),
                     nt_samples=4, stdevs=0.2, target=0, nt_samples_batch_size=3, baselines=captum_inputs(e, base),
                     n_steps=8)
    assert_same(ours["input"], theirs, exact=False, integrated=True)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 6), batch=st.sampled_from([(), (2,), (2, 3)]))
def test_without_noise_the_types_are_the_gradient_its_square_and_zero(seed, n, batch):
    e = build("mlp", torch.float64)
    td = e.inputs(batch, seed=seed)
    grad = saliency(e.f, e.params, td, target=1)["input"]
    maps = {t: smoothgrad(e.f, e.params, td, target=1, nt_type=t, nt_samples=n, stdevs=0.0)["input"]
            for t in NT_TYPES}
    assert_close_ulps(maps["smoothgrad"], grad)
    assert_close_ulps(maps["smoothgrad_sq"], grad * grad)
    torch.testing.assert_close(maps["vargrad"], torch.zeros_like(grad), atol=1e-12, rtol=0)


def test_vargrad_is_smoothgrad_sq_minus_the_square_of_smoothgrad_and_nonnegative():
    e = build("cnn", torch.float64)
    td = e.inputs((3,))
    maps = {t: smoothgrad(e.f, e.params, td, target=1, nt_type=t, nt_samples=9, stdevs=0.4,
                          generator=torch.Generator().manual_seed(0))["input"] for t in NT_TYPES}
    assert_close_ulps(maps["vargrad"], maps["smoothgrad_sq"] - maps["smoothgrad"] ** 2, scale=1.0)
    assert bool((maps["vargrad"] > -1e-12).all())


def test_generator_makes_the_call_reproducible_and_leaves_the_global_state():
    e = build("mlp")
    td = e.inputs((3,))
    state = torch.get_rng_state()
    one = smoothgrad(e.f, e.params, td, target=1, stdevs=0.5, generator=torch.Generator().manual_seed(7))
    two = smoothgrad(e.f, e.params, td, target=1, stdevs=0.5, generator=torch.Generator().manual_seed(7))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(one["input"], two["input"])
    other = smoothgrad(e.f, e.params, td, target=1, stdevs=0.5, generator=torch.Generator().manual_seed(8))
    assert not torch.equal(one["input"], other["input"])


def test_per_target_equals_one_call_per_target():
    e = build("cnn")
    td = e.inputs((2,))
    both = smoothgrad(e.f, e.params, td, target=(0, 3), per_target=True, nt_type="smoothgrad_sq", stdevs=0.3,
                      generator=torch.Generator().manual_seed(1))
    assert both.batch_size == torch.Size([2, 2])
    for i, t in enumerate((0, 3)):
        one = smoothgrad(e.f, e.params, td, target=t, nt_type="smoothgrad_sq", stdevs=0.3,
                         generator=torch.Generator().manual_seed(1))
        assert_close_ulps(both["input"][i], one["input"])


def test_a_tensor_target_is_repeated_for_the_copies():
    e = build("mlp")
    x = e.inputs((4,))["input"]
    labels = torch.tensor([0, 2, 1, 2])
    ours = _seeded(0, smoothgrad, e.f, e.params, x, target=labels, stdevs=0.2)
    theirs = _seeded(0, ca.NoiseTunnel(ca.Saliency(e.model)).attribute, x.clone(), target=labels, stdevs=0.2,
                     abs=False)
    assert_same(ours, theirs, exact=True)


def test_vmap_per_sample_equals_the_batched_call_without_noise_and_draws_per_sample_with_it():
    e = build("cnn")
    td = e.inputs((3,))
    batched = smoothgrad(e.f, e.params, td, target=1, stdevs=0.0, nt_samples=3)
    per_sample = torch.func.vmap(lambda s: smoothgrad(e.f, e.params, s, target=1, stdevs=0.0, nt_samples=3))(td)
    assert_close_ulps(per_sample["input"], batched["input"])
    noisy = torch.func.vmap(lambda s: smoothgrad(e.f, e.params, s, target=1, stdevs=0.3), randomness="different")(td)
    assert noisy["input"].shape == td["input"].shape
    assert bool(noisy["input"].isfinite().all())


def test_grad_with_respect_to_params_composes():
    """A seeded smoothgrad is a function of the params: torch.func.grad equals eager autograd through it."""
    e = build("mlp", torch.float64)
    td = e.inputs((3,))

    def loss(p):
        return smoothgrad(e.f, p, td, target=1, stdevs=0.3, generator=torch.Generator().manual_seed(0))["input"].sum()

    functional = torch.func.grad(loss)(e.params)
    leaves = e.params.clone().apply(lambda t: t.requires_grad_())
    eager = torch.autograd.grad(loss(leaves), list(leaves.values(True, True)), allow_unused=True)
    eager = [torch.zeros_like(v) if g is None else g for v, g in zip(leaves.values(True, True), eager, strict=True)]
    for key, g in zip(leaves.keys(True, True), eager, strict=True):
        assert_close_ulps(functional[key], g, scale=1.0)
    assert any(bool(g.abs().sum() > 0) for g in eager)


def test_nothing_is_written():
    e = build("two_input")
    td = e.inputs((3,))
    inputs, params, before = td.clone(), e.params.clone(), snapshot(e.model)
    smoothgrad(e.f, e.params, td, target=1, stdevs=0.3)
    assert (td == inputs).all() and (e.params == params).all()
    assert same(before, snapshot(e.model))


def test_extra_keys_such_as_labels_reach_the_target_for_every_copy():
    e = build("mlp")
    td = TensorDict(input=e.inputs((4,))["input"], label=torch.tensor([0, 1, 2, 1]), batch_size=[4])

    def by_label(out):
        return out["output"].gather(-1, out["label"].unsqueeze(-1)).squeeze(-1)

    ours = smoothgrad(e.f, e.params, td, target=by_label, stdevs=0.0)["input"]
    assert_close_ulps(ours, saliency(e.f, e.params, td.select("input"), target=td["label"])["input"])


@pytest.mark.parametrize("name", ("mlp", "cnn"))
def test_layer_gradients_inside_equal_captum_noise_tunnel_of_a_layer_method(name):
    """Noise on the inputs, maps at a layer: the inner method's layers come through keyed by path."""
    e = build(name, torch.float64)
    td = e.inputs((3,))
    path, module = next(iter(e.layers.items()))
    inner = functools.partial(saliency, layers=[path], use_inputs=False)
    ours = _seeded(6, smoothgrad, e.f, e.params, td, target=1, nt_type="smoothgrad_sq", nt_samples=4, stdevs=0.3,
                   attribution=inner, noise_dtype=torch.float32)
    tunnel = ca.NoiseTunnel(ca.LayerGradientXActivation(e.model, module, multiply_by_inputs=False))
    theirs = _seeded(6, tunnel.attribute, captum_inputs(e, td), nt_type="smoothgrad_sq", nt_samples=4, stdevs=0.3,
                     target=1)
    assert list(ours.keys()) == [path]
    assert_close_ulps(ours[path], theirs)


def test_chunk_size_bounds_the_copies_per_call():
    """Every call of the inner method sees at most chunk_size copies of each sample (memory bounded by it)."""
    e = build("mlp")
    td = e.inputs((4,))
    seen = []

    def recording(f, params, inputs, **kwargs):
        seen.append(tuple(inputs.batch_size))
        return saliency(f, params, inputs, **kwargs)

    smoothgrad(e.f, e.params, td, target=1, nt_samples=7, chunk_size=3, attribution=recording)
    assert seen == [(4, 3), (4, 3), (4, 1)]


def test_a_non_tensor_input_reaches_the_forward_of_every_copy():
    """The copies go to the engine flattened (NOTE [flat copies]); a string kwarg goes with them."""
    from tensordict import NonTensorData

    import tdhook_fn

    torch.manual_seed(0)
    net = Moded()
    f, p = tdhook_fn.pure(net, in_keys={"input": "x", "mode": "mode"})
    x = torch.randn(3, 2)
    td = TensorDict(input=x, batch_size=[3])
    td["mode"] = NonTensorData("tanh")
    ours = _seeded(2, smoothgrad, f, p, td, target=0, input_keys=["input"], nt_samples=4, stdevs=0.3)["input"]
    theirs = _seeded(2, ca.NoiseTunnel(ca.Saliency(lambda v: net(v, mode="tanh"))).attribute, x.clone(),
                     nt_samples=4, stdevs=0.3, target=0, abs=False)
    torch.testing.assert_close(ours, theirs)


def test_an_input_key_spelled_as_a_tuple_is_noised():
    e = build("mlp")
    td = e.inputs((3,))
    plain = _seeded(3, smoothgrad, e.f, e.params, td, target=1, stdevs=0.5)["input"]
    spelled = _seeded(3, smoothgrad, e.f, e.params, td, target=1, stdevs=0.5, input_keys=[("input",)])["input"]
    assert_close_ulps(spelled, plain)
    assert not torch.allclose(plain, saliency(e.f, e.params, td, target=1)["input"])
