"""Layer conductance, neuron conductance and internal influence: captum 0.9, properties, composition, errors."""

import copy
import math

import attr_zoo
import captum.attr as ca
import pytest
import torch
from _tolerance import assert_close_ulps
from attr_zoo import DTYPES, as_tuple, assert_same, build, captum_inputs, from_captum
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torch import nn
from torch.func import grad, vmap
from zoo import same, snapshot, tiny_gpt2

import tdhook_fn
from tdhook_fn.attribution._internal_influence import internal_influence
from tdhook_fn.attribution._layer_conductance import layer_conductance
from tdhook_fn.attribution._neuron_conductance import neuron_conductance

pytestmark = [
    pytest.mark.filterwarnings("ignore:Input Tensor .* did not already require gradients:UserWarning"),
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
    pytest.mark.filterwarnings("ignore:The neuron_selector provided is a callable:UserWarning"),
]

BATCHES = [(3,), (), (2, 3)]
DT_IDS = ["f32", "f64"]
NAMES = ("mlp", "conv1d", "cnn", "two_input", "transformer")
# layers captum can take a neuron gradient of with respect to every input (two_input's "a" never sees "y")
NEURON_LAYERS = {"mlp": ("[0]", "[3]"), "conv1d": ("[0]", "[2]"), "cnn": ("[0]", "[3]"), "two_input": ("act",),
                 "transformer": ("encoder.linear1", "encoder")}
SELECTORS = {
    "mlp": [(2,), 1, (slice(0, 3),), lambda a: a[:, 0] * a[:, 1]],
    "conv1d": [(1, 2), (slice(None), 1)],
    "cnn": [(1, 2, 2), (0, slice(None), 1)],
    "two_input": [(4,), lambda a: a[:, 1:3].sum(1)],
    "transformer": [(1, 3), lambda a: (a[:, 0, :4] ** 2).sum(-1)],
}


@pytest.fixture(autouse=True)
def _one_thread():
    yield from attr_zoo.one_thread()


def _close(ours, theirs, dtype, *, weighted):
    """Differences (layer conductance) use no weights: a few ulps. Weighted sums use captum's float32 weights."""
    assert_same(ours, theirs, exact=False, integrated=weighted and dtype == torch.float64)


# --- captum 0.9 ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", BATCHES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_layer_conductance_equals_captum(name, dtype, batch):
    e = build(name, dtype)
    td, base = e.inputs(batch), e.baselines(batch)
    before = snapshot(e.model)
    for path, module in e.layers.items():
        for method, n_steps in (("gausslegendre", 6), ("riemann_trapezoid", 5)):
            ours, delta = layer_conductance(e.f, e.params, td, base, target=1, layers=[path], n_steps=n_steps,
                                            method=method, return_convergence_delta=True)
            theirs, their_delta = ca.LayerConductance(e.model, module).attribute(
                captum_inputs(e, td), captum_inputs(e, base), target=1, n_steps=n_steps, method=method,
                return_convergence_delta=True)
            assert list(ours.keys()) == [path]
            assert ours.batch_size == torch.Size(batch)
            _close(ours[path], from_captum(theirs, batch), dtype, weighted=False)
            assert_close_ulps(delta, from_captum(their_delta, batch), scale=float(theirs.detach().abs().sum()))
    assert same(before, snapshot(e.model))


@pytest.mark.parametrize("batch", BATCHES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_internal_influence_equals_captum(name, dtype, batch):
    e = build(name, dtype)
    td, base = e.inputs(batch), e.baselines(batch)
    for path, module in e.layers.items():
        for method, n_steps in (("gausslegendre", 6), ("riemann_middle", 5)):
            ours = internal_influence(e.f, e.params, td, base, target=2, layers=[path], n_steps=n_steps,
                                      method=method)
            theirs = ca.InternalInfluence(e.model, module).attribute(
                captum_inputs(e, td), captum_inputs(e, base), target=2, n_steps=n_steps, method=method)
            assert list(ours.keys()) == [path]
            _close(ours[path], from_captum(theirs, batch), dtype, weighted=True)


@pytest.mark.parametrize("batch", [(3,), (2, 3)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_neuron_conductance_equals_captum(name, dtype, batch):
    e = build(name, dtype)
    td, base = e.inputs(batch), e.baselines(batch)
    for path in NEURON_LAYERS[name]:
        module = tdhook_fn.resolve_path(e.model, path)
        for selector in SELECTORS[name]:
            for method, n_steps in (("riemann_trapezoid", 5), ("gausslegendre", 4)):
                ours = neuron_conductance(e.f, e.params, td, base, target=0, layer=path, neuron_selector=selector,
                                          n_steps=n_steps, method=method)
                theirs = as_tuple(ca.NeuronConductance(e.model, module).attribute(
                    captum_inputs(e, td), selector, captum_inputs(e, base), target=0, n_steps=n_steps,
                    method=method))
                assert set(ours.keys()) == set(e.in_keys)
                for key, t in zip(e.in_keys, theirs, strict=True):
                    _close(ours[key], from_captum(t, batch), dtype, weighted=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_neuron_conductance_without_multiplying_equals_captum(dtype):
    e = build("cnn", dtype)
    td, base = e.inputs((3,)), e.baselines((3,))
    ours = neuron_conductance(e.f, e.params, td, base, target=3, layer="[3]", neuron_selector=(1, 0, 2),
                              multiply_by_inputs=False)
    theirs = ca.NeuronConductance(e.model, e.model[3], multiply_by_inputs=False).attribute(
        captum_inputs(e, td), (1, 0, 2), captum_inputs(e, base), target=3)
    _close(ours["input"], theirs, dtype, weighted=True)


def test_captum_style_tensor_calls_give_tensors():
    e = build("mlp", torch.float64)
    x = e.inputs((4,))["input"]
    pred = e.model(x).argmax(-1)
    ours = layer_conductance(e.f, e.params, x, target=pred, layers=["[2]"])
    theirs = ca.LayerConductance(e.model, e.model[2]).attribute(x.clone(), target=pred)
    assert isinstance(ours, torch.Tensor)
    assert_same(ours, theirs, exact=False)
    ours = neuron_conductance(e.f, e.params, x, target=pred, layer="[2]", neuron_selector=3)
    theirs = ca.NeuronConductance(e.model, e.model[2]).attribute(x.clone(), 3, target=pred)
    assert_same(ours, theirs, exact=False, integrated=True)
    ours = internal_influence(e.f, e.params, x, target=pred, layers=["[2]"])
    theirs = ca.InternalInfluence(e.model, e.model[2]).attribute(x.clone(), target=pred)
    assert_same(ours, theirs, exact=False, integrated=True)


# --- chunks, several targets, several layers ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_chunks_give_the_unchunked_result(name):
    e = build(name, torch.float64)
    td, base = e.inputs((3,)), e.baselines((3,))
    path = next(iter(e.layers))
    layer = NEURON_LAYERS[name][0]
    calls = {
        "layer_conductance": lambda c: layer_conductance(e.f, e.params, td, base, target=1, layers=[path],
                                                         n_steps=7, chunk_size=c),
        "internal_influence": lambda c: internal_influence(e.f, e.params, td, base, target=1, layers=[path],
                                                           n_steps=7, chunk_size=c),
        "neuron_conductance": lambda c: neuron_conductance(e.f, e.params, td, base, target=1, layer=layer,
                                                           neuron_selector=SELECTORS[name][0], n_steps=7,
                                                           chunk_size=c),
    }
    for method, call in calls.items():
        whole = call(None)
        for size in (1, 2, 3, 7, 50):
            assert_close_ulps(call(size), whole, ulps=8, msg=f"{method} chunk_size={size}")


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_per_target_maps_equal_one_call_per_target(name):
    e = build(name, torch.float64)
    td, base = e.inputs((2, 3)), e.baselines((2, 3))
    path = next(iter(e.layers))
    layer = NEURON_LAYERS[name][-1]
    calls = {
        "layer_conductance": lambda **k: layer_conductance(e.f, e.params, td, base, layers=[path], n_steps=5,
                                                           chunk_size=2, **k),
        "internal_influence": lambda **k: internal_influence(e.f, e.params, td, base, layers=[path], n_steps=5,
                                                             **k),
        "neuron_conductance": lambda **k: neuron_conductance(e.f, e.params, td, base, layer=layer, n_steps=5,
                                                             neuron_selector=SELECTORS[name][0], chunk_size=3, **k),
    }
    for method, call in calls.items():
        maps = call(target=(0, 2), per_target=True)
        assert maps.batch_size == torch.Size([2, 2, 3]), method
        for t, target in enumerate((0, 2)):
            assert_close_ulps(maps[t], call(target=target), msg=f"{method} target {target}")


def test_several_layers_in_one_call_equal_one_call_each():
    e = build("mlp", torch.float64)
    td, base = e.inputs((4,)), e.baselines((4,))
    for method in (layer_conductance, internal_influence):
        both = method(e.f, e.params, td, base, target=1, layers=["[0]", "[3]"], n_steps=6)
        for path in ("[0]", "[3]"):
            alone = method(e.f, e.params, td, base, target=1, layers=[path], n_steps=6)
            assert_close_ulps(both[path], alone[path])


def test_inputs_not_attributed_are_passed_unchanged():
    """input_keys=['x']: y stays at its value (captum's additional_forward_args)."""
    e = build("two_input", torch.float64)
    td, base = e.inputs((3,)), e.baselines((3,))
    ours = layer_conductance(e.f, e.params, td, base, target=1, layers=["act"], input_keys=["x"], n_steps=6)
    theirs = ca.LayerConductance(e.model, e.model.act).attribute(
        td["x"].clone(), base["x"].clone(), target=1, additional_forward_args=(td["y"].clone(),), n_steps=6)
    assert_same(ours["act"], theirs, exact=False)
    ours = neuron_conductance(e.f, e.params, td, base, target=1, layer="act", neuron_selector=2, input_keys="x")
    theirs = ca.NeuronConductance(e.model, e.model.act).attribute(
        td["x"].clone(), 2, base["x"].clone(), target=1, additional_forward_args=(td["y"].clone(),))
    assert list(ours.keys()) == ["x"]
    assert_same(ours["x"], theirs, exact=False, integrated=True)


# --- properties ----------------------------------------------------------------------------------------------------


PROPERTY = settings(max_examples=20, deadline=None)


def _values(draw, shape):
    n = math.prod(shape)
    values = draw(st.lists(st.floats(-3.0, 3.0, allow_nan=False, allow_infinity=False), min_size=n, max_size=n))
    return torch.tensor(values, dtype=torch.float64).reshape(shape)


@st.composite
def _paths(draw):
    batch = draw(st.sampled_from([(), (2,), (2, 3)]))
    x, b = _values(draw, (*batch, 4)), _values(draw, (*batch, 4))
    return TensorDict(input=x, batch_size=list(batch)), TensorDict(input=b, batch_size=list(batch))


def _tanh_mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double().eval()


def _change(f, p, td, base, target):
    flat = lambda d: d.reshape(-1)
    out = f(p, flat(td))["output"][:, target] - f(p, flat(base))["output"][:, target]
    return out.reshape(td.batch_size)


@PROPERTY
@given(_paths(), st.integers(0, 2), st.integers(0, 3), st.integers(1, 12))
def test_layer_conductance_sums_to_the_change_where_the_rest_is_linear(ends, target, seed, n_steps):
    """Completeness: behind the last Tanh the model is linear, so dF/dy is constant and the differences telescope."""
    td, base = ends
    model = _tanh_mlp(seed)
    f, p = tdhook_fn.pure(model)
    attr, delta = layer_conductance(f, p, td, base, target=target, layers=["[3]"], n_steps=n_steps,
                                    method="riemann_trapezoid", return_convergence_delta=True)
    change = _change(f, p, td, base, target)
    total = attr["[3]"].sum(-1)
    torch.testing.assert_close(total, change, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(delta, torch.zeros_like(delta), rtol=0, atol=1e-12)


@PROPERTY
@given(_paths(), st.integers(0, 2), st.integers(0, 3))
def test_layer_conductance_converges_to_the_change_for_any_layer(ends, target, seed):
    """Completeness in the limit: at 400 trapezoid steps the sum over a hidden layer misses the change by O(1/n)."""
    td, base = ends
    model = _tanh_mlp(seed)
    f, p = tdhook_fn.pure(model)
    attr, delta = layer_conductance(f, p, td, base, target=target, layers=["[1]"], n_steps=400,
                                    method="riemann_trapezoid", return_convergence_delta=True)
    change = _change(f, p, td, base, target)
    scale = (td["input"] - base["input"]).abs().sum(-1).max().item() + 1.0
    assert delta.abs().max().item() < 0.05 * scale
    torch.testing.assert_close(attr["[1]"].sum(-1) - change, delta, rtol=0, atol=1e-12)


@PROPERTY
@given(_paths(), st.integers(0, 2), st.integers(0, 5), st.integers(2, 10))
def test_neuron_conductance_through_a_linear_first_layer_sums_to_its_layer_conductance(ends, target, unit, n_steps):
    """For y = Wx + c the neuron's gradient is constant: its conductance summed over the inputs is the left Riemann
    sum of dF/dy * dy along the path, which layer conductance with the trapezoid's nodes takes by differences."""
    td, base = ends
    model = _tanh_mlp(unit)
    f, p = tdhook_fn.pure(model)
    by_inputs = neuron_conductance(f, p, td, base, target=target, layer="[0]", neuron_selector=unit,
                                   n_steps=n_steps, method="riemann_left")["input"].sum(-1)
    by_layer = layer_conductance(f, p, td, base, target=target, layers=["[0]"], n_steps=n_steps,
                                 method="riemann_trapezoid")["[0]"][..., unit]
    # the two rules' float32 nodes (linspace(0, 1, n + 1) and linspace(0, 1 - 1/n, n)) may differ by an ulp
    torch.testing.assert_close(by_inputs, by_layer, rtol=1e-6, atol=1e-6)


def test_internal_influence_behind_a_linear_head_is_its_weight_row():
    model = _tanh_mlp(0)
    f, p = tdhook_fn.pure(model)
    x = TensorDict(input=torch.randn(5, 4, dtype=torch.float64), batch_size=[5])
    attr = internal_influence(f, p, x, target=2, layers=["[3]"], n_steps=7)
    torch.testing.assert_close(attr["[3]"], model[4].weight[2].detach().expand(5, 5), rtol=1e-14, atol=1e-14)


# --- composition ---------------------------------------------------------------------------------------------------


def _calls(e):
    f, p = e.f, e.params
    path = next(iter(e.layers))
    layer = NEURON_LAYERS[e.name][0]
    return {
        "layer_conductance": lambda td, b: layer_conductance(f, p, td, b, target=1, layers=[path], n_steps=5,
                                                             return_convergence_delta=True),
        "internal_influence": lambda td, b: internal_influence(f, p, td, b, target=1, layers=[path], n_steps=5),
        "neuron_conductance": lambda td, b: neuron_conductance(f, p, td, b, target=1, layer=layer, n_steps=5,
                                                               neuron_selector=SELECTORS[e.name][0]),
    }


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_vmap_per_sample_equals_the_batched_call(name):
    e = build(name, torch.float64)
    td, base = e.inputs((4,)), e.baselines((4,))
    ulps = 8 if name == "transformer" else 4
    for method, call in _calls(e).items():
        batched, mapped = call(td, base), vmap(call)(td, base)
        if isinstance(batched, tuple):
            scale = sum(float(t.abs().sum()) for t in batched[0].values(True, True))
            assert_close_ulps(mapped[1], batched[1], ulps=ulps, scale=scale, msg=method)
            batched, mapped = batched[0], mapped[0]
        assert_close_ulps(mapped, batched, ulps=ulps, msg=method)


def _smooth():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double().eval()


@pytest.mark.parametrize("method", ["layer_conductance", "internal_influence", "neuron_conductance"])
def test_grad_wrt_params_equals_autograd_through_params_that_require_grad(method):
    """torch.func.grad (functorch's pullbacks) against plain autograd through leaves that require grad."""
    model = _smooth()
    f, p = tdhook_fn.pure(model)
    td = TensorDict(input=torch.randn(5, 4, dtype=torch.float64), batch_size=[5])
    weights = torch.randn(5, 6, dtype=torch.float64)

    def loss(params):
        if method == "layer_conductance":
            out = layer_conductance(f, params, td, 0.5, target=1, layers=["[1]"], n_steps=4)["[1]"]
        elif method == "internal_influence":
            out = internal_influence(f, params, td, 0.5, target=1, layers=["[1]"], n_steps=4)["[1]"]
        else:
            out = neuron_conductance(f, params, td, 0.5, target=1, layer="[2]", neuron_selector=3, n_steps=4)["input"]
        return (out.sin() * weights[:, : out.shape[-1]]).sum()

    ours = grad(loss)(p)
    leaves = p.apply(lambda t: t.clone().requires_grad_())
    reference = torch.autograd.grad(loss(leaves), list(leaves.values(True, True)), allow_unused=True,
                                    materialize_grads=True)  # no conductance reads the head's bias
    for (key, _), expected in zip(leaves.items(True, True), reference, strict=True):
        torch.testing.assert_close(ours.get(key), expected, rtol=1e-10, atol=1e-12, msg=str(key))


def test_nothing_is_written():
    e = build("cnn", torch.float64)
    td, base = e.inputs((3,)), e.baselines((3,))
    kept = (td.clone(), base.clone(), e.params.clone())
    params = e.params
    before = snapshot(e.model)
    layer_conductance(e.f, params, td, base, target=1, layers=["[0]"], n_steps=3)
    neuron_conductance(e.f, params, td, base, target=1, layer="[0]", neuron_selector=(0, 1, 1), n_steps=3)
    internal_influence(e.f, params, td, base, target=1, layers=["[0]"], n_steps=3)
    assert same(before, snapshot(e.model))
    for now, then in zip((td, base, params), kept, strict=True):
        assert (now == then).all()


# --- bad input (the messages: tests/test_error_catalogue.py, CONDUCTANCE_ROWS) --------------------------------


def test_token_ids_are_refused_on_the_path_by_every_method():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2))
    f, p = tdhook_fn.pure(model)
    ids = torch.randint(0, 10, (2, 3))
    with pytest.raises(TypeError, match="cannot move along a path"):
        layer_conductance(f, p, ids, 0, target=0, layers=["[2]"])
    with pytest.raises(TypeError, match="cannot move along a path"):
        neuron_conductance(f, p, ids, 0, target=0, layer="[2]", neuron_selector=0)
    with pytest.raises(TypeError, match="cannot move along a path"):
        internal_influence(f, p, ids, 0, target=0, layers=["[2]"])



# --- a Hugging Face transformer (random init, no download) ---------------------------------------------------------


def test_gpt2_with_an_attention_mask_equals_captum():
    """inputs_embeds move along the path; the attention mask is passed unchanged (captum: additional_forward_args)."""
    transformers = pytest.importorskip("transformers")
    model = tiny_gpt2(transformers).double()
    f = tdhook_fn.functional(model, in_keys={"inputs_embeds": "inputs_embeds", "attention_mask": "attention_mask"},
                             out_keys=["logits"])
    p = tdhook_fn.params(model)
    embeds = torch.randn(2, 6, 16, dtype=torch.float64)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    td = TensorDict(inputs_embeds=embeds, attention_mask=mask, batch_size=[2])
    last = lambda out: TensorDict(logits=out["logits"][..., -1, 3], batch_size=out.batch_size)
    forward = lambda e, m: model(inputs_embeds=e, attention_mask=m).logits[:, -1, 3]
    keys = ["inputs_embeds"]

    ours = layer_conductance(f, p, td, 0.0, target=last, layers=["transformer.h.0.mlp"], input_keys=keys, n_steps=8)
    theirs = ca.LayerConductance(forward, model.transformer.h[0].mlp).attribute(
        embeds.clone(), additional_forward_args=(mask,), n_steps=8)
    torch.testing.assert_close(ours["transformer.h.0.mlp"], theirs, rtol=1e-9, atol=1e-12)

    ours = neuron_conductance(f, p, td, 0.0, target=last, layer="transformer.h.1.mlp.c_fc", neuron_selector=(5, 7),
                              input_keys=keys, n_steps=8)
    theirs = ca.NeuronConductance(forward, model.transformer.h[1].mlp.c_fc).attribute(
        embeds.clone(), (5, 7), additional_forward_args=(mask,), n_steps=8)
    assert_same(ours["inputs_embeds"], theirs, exact=False, integrated=True)

    ours = internal_influence(f, p, td, 0.0, target=last, layers=["transformer.h.1.mlp"], input_keys=keys,
                              n_steps=8)
    theirs = ca.InternalInfluence(forward, model.transformer.h[1].mlp).attribute(
        embeds.clone(), additional_forward_args=(mask,), n_steps=8)
    assert_same(ours["transformer.h.1.mlp"], theirs, exact=False, integrated=True)


# --- torch.compile -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["layer_conductance", "neuron_conductance", "internal_influence"])
def test_fullgraph_compile_equals_eager_without_retrace(method):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)).eval()
    f, p = tdhook_fn.pure(net)
    fn = {
        "layer_conductance": lambda p, td: layer_conductance(
            f, p, td, 0.0, target=(0, 1), per_target=True, n_steps=4, layers=["[1]"], chunk_size=3)["[1]"],
        "neuron_conductance": lambda p, td: neuron_conductance(
            f, p, td, 0.0, target=(0, 1), per_target=True, n_steps=4, layer="[1]",
            neuron_selector=(1, slice(None), 2))["input"],
        "internal_influence": lambda p, td: internal_influence(f, p, td, 0.0, target=1, n_steps=4, layers=["[1]"])[
            "[1]"],
    }[method]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    for seed in (1, 2):  # new values, same shapes: no re-trace
        x = TensorDict(input=torch.randn(2, 1, 6, 6, generator=torch.Generator().manual_seed(seed)), batch_size=[2])
        torch.testing.assert_close(compiled(p, x), fn(p, x))
    assert int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) == 1


def test_bfloat16_keeps_its_dtype_and_sums_the_steps_in_float32():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    results = {}
    for dtype in (torch.bfloat16, torch.float32):
        f, p = tdhook_fn.pure(net.to(dtype))
        td = TensorDict(input=x.to(dtype), batch_size=[5])
        results[dtype] = (
            layer_conductance(f, p, td, target=1, layers=["[1]"], n_steps=200)["[1]"],
            neuron_conductance(f, p, td, target=1, layer="[1]", neuron_selector=2, n_steps=200)["input"],
            internal_influence(f, p, td, target=1, layers=["[1]"], n_steps=200)["[1]"],
        )
    for half, full in zip(results[torch.bfloat16], results[torch.float32], strict=True):
        assert half.dtype == torch.bfloat16
        # bf16 activations carry 3 significant digits; 200 steps added in bf16 would lose most of them
        torch.testing.assert_close(half.float(), full, rtol=0.02, atol=0.02 * float(full.abs().max()))


# --- modules that run twice, threads -------------------------------------------------------------------------------


class _Twice(nn.Module):
    """One Linear run twice (weight tying); ``unshared=True`` gives each run its own copy of it."""

    def __init__(self, unshared: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(4, 4)
        self.second = copy.deepcopy(self.inner) if unshared else self.inner
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.second(torch.tanh(self.inner(x)))))


@pytest.mark.parametrize("run", [0, 1])
def test_a_module_run_twice_is_attributed_at_the_run_layer_calls_names(run):
    shared, unshared = _Twice().double().eval(), _Twice(unshared=True).double().eval()
    td = TensorDict(input=torch.randn(3, 4, dtype=torch.float64), batch_size=[3])
    f, p = tdhook_fn.pure(shared)
    g, q = tdhook_fn.pure(unshared)
    with pytest.raises(ValueError, match="runs 2 times"):
        layer_conductance(f, p, td, target=1, layers=["inner"], n_steps=4)
    as_path = ["inner", "second"][run]
    for method in (layer_conductance, internal_influence):
        ours = method(f, p, td, 0.5, target=1, layers=["inner"], layer_calls={"inner": run}, n_steps=6)
        expected = method(g, q, td, 0.5, target=1, layers=[as_path], n_steps=6)
        assert_close_ulps(ours["inner"], expected[as_path])
    ours = neuron_conductance(f, p, td, 0.5, target=1, layer="inner", layer_call=run, neuron_selector=2, n_steps=6)
    expected = neuron_conductance(g, q, td, 0.5, target=1, layer=as_path, neuron_selector=2, n_steps=6)
    assert_close_ulps(ours, expected)


def test_threads_sharing_one_model_get_their_own_results():
    from concurrent.futures import ThreadPoolExecutor

    e = build("cnn", torch.float64)
    inputs = [e.inputs((2,), seed=s) for s in range(6)]
    call = lambda td: (layer_conductance(e.f, e.params, td, target=1, layers=["[0]"], n_steps=5)["[0]"],
                       neuron_conductance(e.f, e.params, td, target=1, layer="[0]", neuron_selector=(1, 2, 2),
                                          n_steps=5)["input"])
    alone = [call(td) for td in inputs]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(call, inputs))
    for (a, b), (c, d) in zip(alone, together, strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)


def test_per_target_convergence_delta_is_each_targets_delta():
    e = build("mlp", torch.float64)
    td, base = e.inputs((4,)), e.baselines((4,))
    maps, deltas = layer_conductance(e.f, e.params, td, base, target=(0, 2), per_target=True, layers=["[3]"],
                                     n_steps=6, return_convergence_delta=True)
    assert deltas.shape == (2, 4)
    for t, target in enumerate((0, 2)):
        alone, delta = layer_conductance(e.f, e.params, td, base, target=target, layers=["[3]"], n_steps=6,
                                         return_convergence_delta=True)
        assert_close_ulps(maps[t], alone)
        assert_close_ulps(deltas[t], delta, scale=float(alone["[3]"].abs().sum()))


def test_two_layers_with_one_activation_each_get_their_own_map():
    """A block and its last module give one activation: autograd may hand both perturbations one gradient
    buffer, which layer conductance must not write for the first layer before the second reads it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Sequential(nn.Linear(5, 5), nn.Tanh()), nn.Linear(5, 3)).eval()
    f, p = tdhook_fn.pure(model)
    td = TensorDict(input=torch.randn(3, 4), batch_size=[3])
    both = layer_conductance(f, p, td, target=1, layers=["[1]", "[1][1]"], n_steps=8)
    for path in ("[1]", "[1][1]"):
        alone = layer_conductance(f, p, td, target=1, layers=[path], n_steps=8)[path]
        assert_close_ulps(both[path], alone)


@pytest.mark.parametrize("method", ["layer_conductance", "neuron_conductance"])
def test_a_layer_written_in_place_by_the_next_module_is_read_as_it_was(method):
    """Eager, the activation is kept without a copy (NOTE [activations read without a copy]) unless a later module
    writes it in place, as ReLU(inplace=True) does here: then it is read as the layer gave it, not as written."""
    torch.manual_seed(0)
    layers = [nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.ReLU(inplace=True), nn.Linear(6, 3)]
    writing = nn.Sequential(*layers).eval()
    plain = copy.deepcopy(writing)
    plain[3] = nn.ReLU()
    td = TensorDict(input=torch.randn(5, 4), batch_size=[5])
    maps = []
    for model in (writing, plain):
        f, p = tdhook_fn.pure(model)
        if method == "layer_conductance":
            maps.append(layer_conductance(f, p, td, target=1, layers=["[2]"], n_steps=6)["[2]"])
        else:
            maps.append(neuron_conductance(f, p, td, target=1, layer="[2]", neuron_selector=(2,), n_steps=6)["input"])
    assert_close_ulps(maps[0], maps[1])
    assert bool(maps[0].abs().sum() > 0)
