"""Every method against its captum 0.9 counterpart, on the zoo, for batches [3], [] and [2, 3].

captum needs a flat batch: ``[2, 3]`` is compared against captum on the flattened batch of 6
reshaped back, ``[]`` against captum on a batch of one, squeezed.
"""

import attr_zoo
import captum.attr as ca
import pytest
import torch
from _tolerance import assert_close_ulps
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
from zoo import same, snapshot

from tdhook_fn.attribution import (
    SUPPORTED_METHODS,
    DimsConfig,
    grad_cam,
    guided_backprop,
    integrated_gradients,
    saliency,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:Input Tensor .* did not already require gradients:UserWarning"),
    pytest.mark.filterwarnings("ignore:Setting backward hooks on ReLU:UserWarning"),
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
]

BATCHES = [(3,), (), (2, 3)]
DT_IDS = ["f32", "f64"]


@pytest.fixture(autouse=True)
def _one_thread():
    yield from attr_zoo.one_thread()


def _exact(name: str) -> bool:
    # the transformer's attention kernels differ from captum's run by an ulp here and there
    return name != "transformer"


@pytest.mark.parametrize("batch", BATCHES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_saliency_abs_equals_captum_saliency(name, dtype, batch):
    e = build(name, dtype)
    td = e.inputs(batch)
    before = snapshot(e.model)
    ours = saliency(e.f, e.params, td, target=1, abs=True)
    assert same(before, snapshot(e.model))
    theirs = as_tuple(ca.Saliency(e.model).attribute(captum_inputs(e, td), target=1, abs=True))
    assert set(ours.keys()) == set(e.in_keys)
    assert ours.batch_size == torch.Size(batch)
    for key, t in zip(e.in_keys, theirs, strict=True):
        assert_same(ours[key], from_captum(t, batch), exact=_exact(name))


@pytest.mark.parametrize("batch", BATCHES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_input_x_gradient_equals_captum(name, dtype, batch):
    e = build(name, dtype)
    td = e.inputs(batch)
    ours = saliency(e.f, e.params, td, target=2, multiply_by_inputs=True)
    theirs = as_tuple(ca.InputXGradient(e.model).attribute(captum_inputs(e, td), target=2))
    for key, t in zip(e.in_keys, theirs, strict=True):
        assert_same(ours[key], from_captum(t, batch), exact=_exact(name))


@pytest.mark.parametrize("batch", BATCHES, ids=str)
@pytest.mark.parametrize("method", SUPPORTED_METHODS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_integrated_gradients_and_delta_equal_captum(name, dtype, method, batch):
    e = build(name, dtype)
    td, base = e.inputs(batch), e.baselines(batch)
    ig = ca.IntegratedGradients(e.model)
    for n_steps in (1, 4, 16) if method == "gausslegendre" else (2, 5, 16):
        ours, delta = integrated_gradients(
            e.f, e.params, td, base, target=0, n_steps=n_steps, method=method, return_convergence_delta=True
        )
        theirs, their_delta = ig.attribute(
            captum_inputs(e, td),
            captum_inputs(e, base),
            target=0,
            n_steps=n_steps,
            method=method,
            return_convergence_delta=True,
        )
        theirs = as_tuple(theirs)
        assert set(ours.keys()) == set(e.in_keys)
        for key, t in zip(e.in_keys, theirs, strict=True):
            assert_same(ours[key], from_captum(t, batch), exact=False, integrated=True)
        assert delta.shape == torch.Size(batch)
        _assert_delta(delta, from_captum(their_delta, batch), theirs)
        # and the delta is what it claims to be: sum of attributions minus the change of the target
        with torch.no_grad():
            change = e.model(*as_tuple(captum_inputs(e, td)))[:, 0] - e.model(*as_tuple(captum_inputs(e, base)))[:, 0]
        total = sum(ours[k].flatten(len(batch)).sum(-1) for k in e.in_keys)
        torch.testing.assert_close(delta, total - from_captum(change, batch))


@pytest.mark.parametrize("method", [m for m in SUPPORTED_METHODS if m.startswith("riemann")])
@pytest.mark.parametrize("name", NAMES)
def test_float64_riemann_with_float32_exact_weights_equals_captum_to_a_few_ulps(name, method):
    """With n_steps a power of two, captum's float32 step weights are exact: no 1e-8 gap.

    What is left is the order of the sum over steps (captum's ``torch.sum``, our fold):
    at most 1.5 ulps of the map's largest value measured.
    """
    e = build(name, torch.float64)
    batch = (2, 3)
    td, base = e.inputs(batch), e.baselines(batch)
    for n_steps in (2, 4, 16):
        ours = integrated_gradients(e.f, e.params, td, base, target=2, n_steps=n_steps, method=method)
        theirs = as_tuple(
            ca.IntegratedGradients(e.model).attribute(
                captum_inputs(e, td), captum_inputs(e, base), target=2, n_steps=n_steps, method=method
            )
        )
        for key, t in zip(e.in_keys, theirs, strict=True):
            assert_close_ulps(ours[key], from_captum(t, batch))


def _assert_delta(ours: torch.Tensor, theirs: torch.Tensor, their_attrs: tuple[torch.Tensor, ...]) -> None:
    if ours.dtype == torch.float64:
        # captum's float32 step weights move each attribution by ~6e-8 relative
        scale = sum(a.abs().sum() for a in their_attrs)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7 * float(scale) + 1e-12)
    else:
        torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("way", ("walk", "general"))
@pytest.mark.parametrize("batch", BATCHES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_guided_backprop_skipping_non_relu_equals_captum(name, dtype, batch, way):
    """On the chain walk where the model is a chain (its convolutions' adjoints a few ulps from autograd's kernel),
    and the general way."""
    e = build(name, dtype)
    td = e.inputs(batch)
    skip = e.non_relu_classes()
    assert torch.nn.ReLU not in skip and len(skip) > 0
    call = lambda: guided_backprop(e.f, e.params, td, target=1, classes_to_skip=skip)
    ours = call() if way == "walk" else attr_zoo.on_general_path(e.model, call)
    theirs = as_tuple(ca.GuidedBackprop(e.model).attribute(captum_inputs(e, td), target=1))
    exact = _exact(name) and (way == "general" or name not in CONV_NAMES)
    for key, t in zip(e.in_keys, theirs, strict=True):
        assert_same(ours[key], from_captum(t, batch), exact=exact)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_guided_backprop_differs_from_saliency(name, dtype):
    """Guides really act: a ReLU net's guided map is not its plain gradient."""
    e = build(name, dtype)
    td = e.inputs((3,))
    guided = guided_backprop(e.f, e.params, td, target=1, classes_to_skip=e.non_relu_classes())["input"]
    plain = saliency(e.f, e.params, td, target=1)["input"]
    assert not torch.equal(guided, plain)


@pytest.mark.parametrize("batch", BATCHES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", CONV_NAMES)
def test_grad_cam_on_conv_layers_equals_captum_layer_grad_cam(name, dtype, batch):
    e = build(name, dtype)
    td = e.inputs(batch)
    spatial = tuple(range(1, len(e.shapes[0])))  # (1,) for Conv1d, (1, 2) for Conv2d
    for path, module in e.conv_layers.items():
        ours = grad_cam(e.f, e.params, td, target=3 if name == "cnn" else 2, layers={path: DimsConfig(spatial, (0,))})
        theirs = ca.LayerGradCam(e.model, module).attribute(captum_inputs(e, td), target=3 if name == "cnn" else 2)
        assert theirs.shape[1] == 1
        assert list(ours.keys()) == [path]
        assert_same(ours[path], from_captum(theirs.squeeze(1), batch), exact=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_grad_cam_on_a_linear_layer_equals_captum(dtype):
    e = build("mlp", dtype)
    td = e.inputs((3,))
    ours = grad_cam(e.f, e.params, td, target=0, layers={"[2]": DimsConfig(None, (0,))})
    theirs = ca.LayerGradCam(e.model, e.model[2]).attribute(captum_inputs(e, td), target=0)
    assert_same(ours["[2]"], theirs.squeeze(1), exact=True)


@pytest.mark.parametrize("batch", BATCHES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_layer_integrated_gradients_equals_captum(name, dtype, batch):
    e = build(name, dtype)
    td, base = e.inputs(batch), e.baselines(batch)
    for path, module in e.layers.items():
        for method, n_steps in (("gausslegendre", 6), ("riemann_trapezoid", 5)):
            ours, delta = integrated_gradients(
                e.f,
                e.params,
                td,
                base,
                target=1,
                layers=[path],
                interpolate="layers",
                n_steps=n_steps,
                method=method,
                return_convergence_delta=True,
            )
            theirs, their_delta = ca.LayerIntegratedGradients(e.model, module).attribute(
                captum_inputs(e, td),
                captum_inputs(e, base),
                target=1,
                n_steps=n_steps,
                method=method,
                return_convergence_delta=True,
            )
            assert list(ours.keys()) == [path]  # inputs are not attributed in layer space
            assert_same(ours[path], from_captum(theirs, batch), exact=False, integrated=True)
            _assert_delta(delta, from_captum(their_delta, batch), (theirs,))


@pytest.mark.parametrize("batch", BATCHES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_layer_gradient_x_activation_equals_captum(name, dtype, batch):
    e = build(name, dtype)
    td = e.inputs(batch)
    for path, module in e.layers.items():
        ours = saliency(e.f, e.params, td, target=2, layers=[path], multiply_by_inputs=True, use_inputs=False)
        theirs = ca.LayerGradientXActivation(e.model, module).attribute(captum_inputs(e, td), target=2)
        assert list(ours.keys()) == [path]
        assert_same(ours[path], from_captum(theirs, batch), exact=_exact(name))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_layer_gradient_equals_captum_layer_gradient_x_activation_without_multiplying(name, dtype):
    e = build(name, dtype)
    td = e.inputs((3,))
    for path, module in e.layers.items():
        ours = saliency(e.f, e.params, td, target=0, layers=[path])
        theirs = ca.LayerGradientXActivation(e.model, module, multiply_by_inputs=False).attribute(
            captum_inputs(e, td), target=0
        )
        assert set(ours.keys()) == {*e.in_keys, path}  # inputs attributed too by default
        assert_same(ours[path], theirs, exact=_exact(name))
        plain = saliency(e.f, e.params, td, target=0)
        for key in e.in_keys:
            assert_same(ours[key], plain[key], exact=_exact(name))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_attributing_one_of_two_inputs_equals_captum_with_additional_forward_args(dtype):
    e = build("two_input", dtype)
    td, base = e.inputs((3,)), e.baselines((3,))
    y = td["y"].clone()
    ours = integrated_gradients(e.f, e.params, td, base, target=1, n_steps=5, input_keys=["x"])
    theirs = ca.IntegratedGradients(e.model).attribute(
        td["x"].clone(), base["x"].clone(), target=1, n_steps=5, additional_forward_args=(y,)
    )
    assert list(ours.keys()) == ["x"]
    assert_same(ours["x"], theirs, exact=False, integrated=True)
    ours = saliency(e.f, e.params, td, target=1, input_keys=["y"], multiply_by_inputs=True)
    theirs = ca.InputXGradient(lambda y_, x_: e.model(x_, y_)).attribute(
        y, target=1, additional_forward_args=(td["x"],)
    )
    assert list(ours.keys()) == ["y"]
    assert_same(ours["y"], theirs, exact=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_a_number_baseline_equals_captum_scalar_baselines(name, dtype):
    e = build(name, dtype)
    td = e.inputs((2, 3))
    for value in (0.0, 0.5):
        ours = integrated_gradients(e.f, e.params, td, value, target=2, n_steps=5, method="riemann_middle")
        theirs = as_tuple(
            ca.IntegratedGradients(e.model).attribute(
                captum_inputs(e, td),
                (value,) * len(e.in_keys) if len(e.in_keys) > 1 else value,
                target=2,
                n_steps=5,
                method="riemann_middle",
            )
        )
        for key, t in zip(e.in_keys, theirs, strict=True):
            assert_same(ours[key], from_captum(t, (2, 3)), exact=False, integrated=True)
