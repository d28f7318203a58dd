"""Targets: per_target against a captum loop, tuple sums, callable targets, label(key)."""

import attr_zoo
import captum.attr as ca
import pytest
import torch
from attr_zoo import (
    CONV_NAMES,
    DTYPES,
    NAMES,
    as_tuple,
    assert_same,
    build,
    captum_inputs,
    from_captum,
)
from tensordict import TensorDict

import tdhook_fn
from tdhook_fn.attribution import DimsConfig, grad_cam, integrated_gradients, saliency

pytestmark = [
    pytest.mark.filterwarnings("ignore:Input Tensor .* did not already require gradients:UserWarning"),
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
]

DT_IDS = ["f32", "f64"]
TARGETS = (0, 2)


@pytest.fixture(autouse=True)
def _one_thread():
    yield from attr_zoo.one_thread()


def _spatial(e):
    return DimsConfig(tuple(range(1, len(e.shapes[0]))), (0,))


# --- per_target=True is a captum loop over the targets, stacked on a leading T dim -------------------------------


@pytest.mark.parametrize("batch", [(3,), (2, 3)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_per_target_saliency_equals_a_captum_loop(name, dtype, batch):
    e = build(name, dtype)
    td = e.inputs(batch)
    ours = saliency(e.f, e.params, td, target=TARGETS, per_target=True)
    assert ours.batch_size == torch.Size([len(TARGETS), *batch])
    sal = ca.Saliency(e.model)
    loop = [as_tuple(sal.attribute(captum_inputs(e, td), target=t, abs=False)) for t in TARGETS]
    for i, key in enumerate(e.in_keys):
        stacked = torch.stack([from_captum(per[i], batch) for per in loop])
        assert_same(ours[key], stacked, exact=name != "transformer")


@pytest.mark.parametrize("batch", [(3,), (2, 3)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_per_target_integrated_gradients_and_delta_equal_a_captum_loop(name, dtype, batch):
    e = build(name, dtype)
    td, base = e.inputs(batch), e.baselines(batch)
    ours, delta = integrated_gradients(
        e.f,
        e.params,
        td,
        base,
        target=TARGETS,
        per_target=True,
        n_steps=5,
        method="riemann_middle",
        return_convergence_delta=True,
    )
    assert ours.batch_size == torch.Size([len(TARGETS), *batch])
    assert delta.shape == torch.Size([len(TARGETS), *batch])
    ig = ca.IntegratedGradients(e.model)
    loop = [
        ig.attribute(
            captum_inputs(e, td),
            captum_inputs(e, base),
            target=t,
            n_steps=5,
            method="riemann_middle",
            return_convergence_delta=True,
        )
        for t in TARGETS
    ]
    for i, key in enumerate(e.in_keys):
        stacked = torch.stack([from_captum(as_tuple(attrs)[i], batch) for attrs, _ in loop])
        assert_same(ours[key], stacked, exact=False, integrated=True)
    their_delta = torch.stack([from_captum(d, batch) for _, d in loop])
    scale = max(sum(a.abs().sum() for a in as_tuple(attrs)) for attrs, _ in loop)
    atol = 1e-7 * float(scale) if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(delta, their_delta, rtol=0, atol=atol)


@pytest.mark.parametrize("batch", [(3,), (2, 3)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", CONV_NAMES)
def test_per_target_grad_cam_equals_a_captum_loop(name, dtype, batch):
    e = build(name, dtype)
    td = e.inputs(batch)
    path, module = next(iter(e.conv_layers.items()))
    ours = grad_cam(e.f, e.params, td, target=TARGETS, per_target=True, layers={path: _spatial(e)})
    cam = ca.LayerGradCam(e.model, module)
    stacked = torch.stack(
        [from_captum(cam.attribute(captum_inputs(e, td), target=t).squeeze(1), batch) for t in TARGETS]
    )
    assert_same(ours[path], stacked, exact=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_per_target_layer_methods_equal_captum_loops(name, dtype):
    e = build(name, dtype)
    batch = (2, 3)
    td, base = e.inputs(batch), e.baselines(batch)
    for path, module in e.layers.items():
        ours = saliency(
            e.f, e.params, td, target=TARGETS, per_target=True, layers=[path], multiply_by_inputs=True, use_inputs=False
        )
        gxa = ca.LayerGradientXActivation(e.model, module)
        stacked = torch.stack([from_captum(gxa.attribute(captum_inputs(e, td), target=t), batch) for t in TARGETS])
        assert_same(ours[path], stacked, exact=name != "transformer")
        ours, delta = integrated_gradients(
            e.f,
            e.params,
            td,
            base,
            target=TARGETS,
            per_target=True,
            layers=[path],
            n_steps=5,
            return_convergence_delta=True,
        )
        lig = ca.LayerIntegratedGradients(e.model, module)
        loop = [
            lig.attribute(
                captum_inputs(e, td), captum_inputs(e, base), target=t, n_steps=5, return_convergence_delta=True
            )
            for t in TARGETS
        ]
        assert_same(ours[path], torch.stack([from_captum(a, batch) for a, _ in loop]), exact=False, integrated=True)
        assert delta.shape == torch.Size([len(TARGETS), *batch])
        atol = 1e-7 * float(max(a.abs().sum() for a, _ in loop)) if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(delta, torch.stack([from_captum(d, batch) for _, d in loop]), rtol=0, atol=atol)


# --- per_target=False with a tuple: the sum of the per-target maps ------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_tuple_target_is_the_sum_of_per_target_maps(name, dtype):
    e = build(name, dtype)
    td, base = e.inputs((2, 3)), e.baselines((2, 3))
    layer = next(iter(e.layers))
    calls = {
        "saliency": lambda **kw: saliency(e.f, e.params, td, layers=[layer], **kw),
        "input_x_gradient": lambda **kw: saliency(e.f, e.params, td, multiply_by_inputs=True, **kw),
        "ig": lambda **kw: integrated_gradients(e.f, e.params, td, base, n_steps=4, **kw),
        "layer_ig": lambda **kw: integrated_gradients(e.f, e.params, td, base, n_steps=4, layers=[layer], **kw),
    }
    if e.conv_layers:
        cam_layers = {p: _spatial(e) for p in e.conv_layers}
        calls["grad_cam"] = lambda **kw: grad_cam(e.f, e.params, td, layers=cam_layers, **kw)
    for method, call in calls.items():
        summed = call(target=TARGETS)
        split = call(target=TARGETS, per_target=True)
        assert split.batch_size[0] == len(TARGETS), method
        assert set(summed.keys()) == set(split.keys()), method
        for key in summed.keys():
            torch.testing.assert_close(summed[key], split[key].sum(0), msg=f"{method} {key}")
        # and each per-target map is the single-target call
        for i, t in enumerate(TARGETS):
            single = call(target=t)
            for key in summed.keys():
                torch.testing.assert_close(split[key][i], single[key], msg=f"{method} {key} {t}")


# --- callable targets, as tdhook's init_attr_targets, against captum on a wrapped forward ------------------------


def _score(td):
    out = td["output"]
    return TensorDict(score=2.0 * out[..., 0] - out[..., 2] ** 2, batch_size=td.batch_size)


@pytest.mark.parametrize("batch", [(3,), (), (2, 3)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_callable_target_equals_captum_on_the_wrapped_forward(name, dtype, batch):
    e = build(name, dtype)
    td, base = e.inputs(batch), e.baselines(batch)

    def forward(*xs):
        out = e.model(*xs)
        return 2.0 * out[:, 0] - out[:, 2] ** 2

    ours = saliency(e.f, e.params, td, target=_score)
    theirs = as_tuple(ca.Saliency(forward).attribute(captum_inputs(e, td), abs=False))
    for key, t in zip(e.in_keys, theirs, strict=True):
        assert_same(ours[key], from_captum(t, batch), exact=name != "transformer")
    ours = integrated_gradients(e.f, e.params, td, base, target=_score, n_steps=6)
    theirs = as_tuple(
        ca.IntegratedGradients(forward).attribute(captum_inputs(e, td), captum_inputs(e, base), n_steps=6)
    )
    for key, t in zip(e.in_keys, theirs, strict=True):
        assert_same(ours[key], from_captum(t, batch), exact=False, integrated=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_callable_target_reading_a_target_layer_equals_captum_on_the_truncated_model(dtype):
    e = build("mlp", dtype)
    td = e.inputs((2, 3))
    target = lambda out: TensorDict(h=out["[3]"].sum(-1), batch_size=out.batch_size)
    ours = saliency(e.f, e.params, td, target=target, target_layers=["[3]"])
    theirs = ca.Saliency(lambda x: e.model[:4](x).sum(-1)).attribute(captum_inputs(e, td), abs=False)
    assert_same(ours["input"], from_captum(theirs, (2, 3)), exact=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", ["mlp", "two_input"])
def test_several_target_keys_are_summed(name, dtype):
    e = build(name, dtype)
    td = e.inputs((3,))
    both = lambda out: TensorDict(a=out["output"][..., 0], b=out["output"][..., 1].exp(), batch_size=out.batch_size)
    only_a = lambda out: TensorDict(a=out["output"][..., 0], batch_size=out.batch_size)
    only_b = lambda out: TensorDict(b=out["output"][..., 1].exp(), batch_size=out.batch_size)
    summed = saliency(e.f, e.params, td, target=both)
    for key in e.in_keys:
        expected = saliency(e.f, e.params, td, target=only_a)[key] + saliency(e.f, e.params, td, target=only_b)[key]
        torch.testing.assert_close(summed[key], expected)


# --- label(key): per-sample classes from an extra input key ("y" is an input of two_input) --------------------------


def _with_labels(e, batch):
    td = e.inputs(batch)
    labels = torch.arange(td.numel()).remainder(e.n_classes).reshape(batch).flip(-1) if batch else torch.tensor(2)
    td.set("label", labels)
    flat = labels.reshape(-1)
    return td, flat


@pytest.mark.parametrize("batch", [(3,), (), (2, 3)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_label_target_equals_captum_per_sample_targets(name, dtype, batch):
    e = build(name, dtype)
    td, flat = _with_labels(e, batch)
    assert len(set(flat.tolist())) > 1 or not batch
    target = tdhook_fn.label("label")
    captum_target = flat.tolist()
    ours = saliency(e.f, e.params, td, target=target)
    assert set(ours.keys()) == set(e.in_keys)  # the labels are not attributed
    theirs = as_tuple(ca.Saliency(e.model).attribute(captum_inputs(e, td), target=captum_target, abs=False))
    for key, t in zip(e.in_keys, theirs, strict=True):
        assert_same(ours[key], from_captum(t, batch), exact=name != "transformer")
    base = e.baselines(batch)
    ours, delta = integrated_gradients(e.f, e.params, td, base, target=target, n_steps=5, return_convergence_delta=True)
    theirs, their_delta = ca.IntegratedGradients(e.model).attribute(
        captum_inputs(e, td), captum_inputs(e, base), target=captum_target, n_steps=5, return_convergence_delta=True
    )
    for key, t in zip(e.in_keys, as_tuple(theirs), strict=True):
        assert_same(ours[key], from_captum(t, batch), exact=False, integrated=True)
    atol = 1e-7 * float(sum(a.abs().sum() for a in as_tuple(theirs))) if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(delta, from_captum(their_delta, batch), rtol=0, atol=atol)
    if e.conv_layers:
        path, module = next(iter(e.conv_layers.items()))
        ours = grad_cam(e.f, e.params, td, target=target, layers={path: _spatial(e)})
        theirs = ca.LayerGradCam(e.model, module).attribute(captum_inputs(e, td), target=captum_target)
        assert_same(ours[path], from_captum(theirs.squeeze(1), batch), exact=True)


@pytest.mark.parametrize("name", NAMES)
def test_label_target_per_target_has_one_target(name):
    e = build(name)
    td, _ = _with_labels(e, (2, 3))
    plain = saliency(e.f, e.params, td, target=tdhook_fn.label("label"))
    split = saliency(e.f, e.params, td, target=tdhook_fn.label("label"), per_target=True)
    assert split.batch_size == torch.Size([1, 2, 3])
    for key in e.in_keys:
        assert torch.equal(split[key][0], plain[key])


def test_label_target_equals_the_int_target_when_all_labels_agree():
    e = build("cnn", torch.float64)
    td = e.inputs((2, 3))
    labelled = td.clone()
    labelled.set("label", torch.full((2, 3), 3))
    assert torch.equal(
        saliency(e.f, e.params, labelled, target=tdhook_fn.label("label"))["input"],
        saliency(e.f, e.params, td, target=3)["input"],
    )


@pytest.mark.parametrize("extra", ["label", "weight"])
def test_int_and_tuple_targets_ignore_extra_input_keys(extra):
    """An extra key in the inputs (labels, sample weights) is no model output: ``f`` returns
    only ``"output"``, so ``target=1`` must still select ``output[..., 1]``."""
    e = build("mlp", torch.float64)
    td, base = e.inputs((3,)), e.baselines((3,))
    labelled = td.clone()
    labelled.set(extra, torch.tensor([0, 2, 1]) if extra == "label" else torch.rand(3, dtype=torch.float64))
    assert list(e.f(e.params, labelled).keys()) == ["output"]
    for target in (1, (0, 2)):
        assert torch.equal(
            saliency(e.f, e.params, labelled, target=target)["input"],
            saliency(e.f, e.params, td, target=target)["input"],
        )
        attrs, delta = integrated_gradients(
            e.f, e.params, labelled, base, target=target, n_steps=4, return_convergence_delta=True
        )
        expected, expected_delta = integrated_gradients(
            e.f, e.params, td, base, target=target, n_steps=4, return_convergence_delta=True
        )
        assert torch.equal(attrs["input"], expected["input"])
        assert torch.equal(delta, expected_delta)


# --- a target's values are per sample, in a TensorDict as in a tensor ---------------------------------------------


def _small_cnn():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(2 * 4 * 4, 3)).eval()
    return tdhook_fn.functional(net), tdhook_fn.params(net), TensorDict(input=torch.randn(4, 1, 6, 6), batch_size=[4])


def _calls():
    from tdhook_fn.attribution import Epsilon, Ignore, Pass, guided_backprop, lrp

    rules = {torch.nn.Linear: Epsilon(1e-9), torch.nn.Conv2d: Epsilon(1e-9), torch.nn.ReLU: Pass(),
             torch.nn.Flatten: Ignore()}
    return {
        "saliency": lambda f, p, x, t: saliency(f, p, x, target=t),
        "integrated_gradients": lambda f, p, x, t: integrated_gradients(f, p, x, 0.0, target=t, n_steps=4),
        "ig-chunked": lambda f, p, x, t: integrated_gradients(f, p, x, 0.0, target=t, n_steps=4, chunk_size=2),
        "ig-per-target": lambda f, p, x, t: integrated_gradients(f, p, x, 0.0, target=t, n_steps=4, per_target=True),
        "grad_cam": lambda f, p, x, t: grad_cam(f, p, x, target=t, layers={"[1]": DimsConfig((1, 2), (0,))}),
        "guided_backprop": lambda f, p, x, t: guided_backprop(f, p, x, target=t),
        "lrp": lambda f, p, x, t: lrp(f, p, x, target=t, rules=rules),
    }


@pytest.mark.parametrize("method", list(_calls()))
def test_a_target_tensordict_of_another_batch_is_refused(method):
    """Values for two of four samples gave zero maps for the others (in IG: path points read as samples)."""
    call = _calls()[method]
    f, p, x = _small_cnn()
    fewer = lambda out: TensorDict(o=out["output"][:2, :2], batch_size=[2])
    with pytest.raises(ValueError, match=r"target returned a TensorDict \(batch size \[2\]\) holding 'o' of shape "
                                         r"\[2, .*; its leading dims must be the batch"):
        call(f, p, x, fewer)
    with pytest.raises(ValueError, match="leading dims must be the batch"):  # as a plain tensor is refused
        call(f, p, x, lambda out: out["output"][:2, :2])
    # per-sample values under another batch size are read per sample: the same maps as with the batch
    batch_free = lambda out: TensorDict(o=out["output"][..., :2], batch_size=[])
    batched = lambda out: TensorDict(o=out["output"][..., :2], batch_size=out.batch_size)
    ours, expected = call(f, p, x, batch_free), call(f, p, x, batched)
    for key in expected.keys(True, True):
        torch.testing.assert_close(ours[key], expected[key])
