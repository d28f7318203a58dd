"""deconvolution and guided_grad_cam against captum 0.9 (bitwise where the kernels are the same); transforms, purity."""

import attr_zoo
import captum.attr as ca
import pytest
import torch
from _tolerance import assert_close_ulps
from attr_zoo import CONV_NAMES, DTYPES, as_tuple, assert_same, build, captum_inputs, from_captum
from tensordict import TensorDict
from torch import nn
from zoo import same, snapshot

from tdhook_fn import functional, params
from tdhook_fn.attribution import guided_backprop, saliency
from tdhook_fn.attribution._deconvolution import deconvolution, relu_paths
from tdhook_fn.attribution._guided_grad_cam import guided_grad_cam

pytestmark = [
    pytest.mark.filterwarnings("ignore:Input Tensor .* did not already require gradients:UserWarning"),
    pytest.mark.filterwarnings("ignore:Setting backward hooks on ReLU:UserWarning"),
]

BATCHES = [(3,), (), (2, 3)]


@pytest.fixture(autouse=True)
def _one_thread():
    yield from attr_zoo.one_thread()


@pytest.mark.parametrize("way", ("walk", "general"))
@pytest.mark.parametrize("batch", BATCHES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("name", attr_zoo.NAMES)
def test_deconvolution_equals_captum(name, dtype, batch, way):
    """On the chain walk where the model is a chain (NOTE [gradient rules on a chain]), and the general way."""
    e = build(name, dtype)
    td = e.inputs(batch)
    before = snapshot(e.model)
    call = lambda: deconvolution(e.f, e.params, td, target=1)
    ours = call() if way == "walk" else attr_zoo.on_general_path(e.model, call)
    assert same(before, snapshot(e.model))
    theirs = as_tuple(ca.Deconvolution(e.model).attribute(captum_inputs(e, td), target=1))
    # (the walk's convolutions take their adjoint by another kernel than autograd's: a few ulps apart)
    exact = name != "transformer" and (way == "general" or name not in CONV_NAMES)
    for key, t in zip(e.in_keys, theirs, strict=True):
        assert_same(ours[key], from_captum(t, batch), exact=exact)


def _relu_net(inplace: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(inplace=inplace), nn.Conv2d(3, 2, 3),
                         nn.ReLU(inplace=inplace), nn.Flatten(), nn.Linear(18, 4)).eval()


@pytest.mark.parametrize("inplace", (False, True))
def test_deconvolution_passes_the_positive_gradient_through_relus_in_place_or_not(inplace):
    net = _relu_net(inplace)
    x = torch.randn(4, 1, 5, 5)
    ours = deconvolution(functional(net), params(net), x, target=2)
    assert_same(ours, ca.Deconvolution(net).attribute(x.clone(), target=2), exact=inplace)  # (in place: no walk)
    plain = saliency(functional(net), params(net), x, target=2)
    assert not torch.equal(ours, plain)


def test_relu_paths_are_the_relu_modules_in_order():
    class Twice(nn.ReLU):
        pass

    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.Linear(2, 2), Twice()), nn.Tanh())
    assert relu_paths(net) == ["1", "2.1"]


def test_deconvolution_per_target_and_vmap_compose_and_grad_refuses():
    e = build("cnn", torch.float64)
    td = e.inputs((3,))
    both = deconvolution(e.f, e.params, td, target=(0, 2), per_target=True)
    for i, t in enumerate((0, 2)):
        assert_close_ulps(both["input"][i], deconvolution(e.f, e.params, td, target=t)["input"])
    per_sample = torch.func.vmap(lambda s: deconvolution(e.f, e.params, s, target=1))(td)
    assert_close_ulps(per_sample["input"], deconvolution(e.f, e.params, td, target=1)["input"])
    with pytest.raises(NotImplementedError, match="cannot be differentiated"):  # (a replaced derivative)
        torch.func.grad(lambda p: deconvolution(e.f, p, td, target=1)["input"].square().sum())(e.params)


def test_deconvolution_writes_nothing():
    e = build("two_input")
    td = e.inputs((3,))
    inputs, p, before = td.clone(), e.params.clone(), snapshot(e.model)
    deconvolution(e.f, e.params, td, target=0)
    assert (td == inputs).all() and (e.params == p).all() and same(before, snapshot(e.model))


@pytest.mark.parametrize("way", ("walk", "general"))
@pytest.mark.parametrize("mode", ("nearest", "linear-ish"))
@pytest.mark.parametrize("batch", BATCHES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("name", CONV_NAMES)
def test_guided_grad_cam_equals_captum(name, dtype, batch, mode, way):
    """On the chain walk (NOTE [gradient rules on a chain]: its convolutions' adjoints a few ulps from autograd's
    kernel), and the general way, bitwise."""
    e = build(name, dtype)
    td = e.inputs(batch)
    interpolate = mode if mode == "nearest" else ("linear" if name == "conv1d" else "bilinear")
    for path, module in [*e.conv_layers.items(), ("[1]", e.model[1])]:
        before = snapshot(e.model)
        call = lambda path=path: guided_grad_cam(e.f, e.params, td, target=2, layer=path,
                                                  interpolate_mode=interpolate)
        ours = call() if way == "walk" else attr_zoo.on_general_path(e.model, call)
        assert same(before, snapshot(e.model))
        theirs = ca.GuidedGradCam(e.model, module).attribute(captum_inputs(e, td), target=2,
                                                               interpolate_mode=interpolate)
        assert_same(ours["input"], from_captum(theirs, batch), exact=way == "general")


def test_guided_grad_cam_is_guided_backprop_times_the_relud_cam():
    e = build("cnn", torch.float64)
    td = e.inputs((3,))
    ours = guided_grad_cam(e.f, e.params, td, target=1, layer="[1]")["input"]  # [1]'s map is 5x5: no resizing
    guided = guided_backprop(e.f, e.params, td, target=1, classes_to_skip=e.non_relu_classes())["input"]
    cam = ca.LayerGradCam(e.model, e.model[1]).attribute(td["input"].clone(), target=1, relu_attributions=True)
    assert_close_ulps(ours, guided * cam)


def test_guided_grad_cam_per_target_and_vmap():
    e = build("cnn")
    td = e.inputs((3,))
    both = guided_grad_cam(e.f, e.params, td, target=(0, 3), layer="[2]", per_target=True)
    assert both.batch_size == torch.Size([2, 3])
    for i, t in enumerate((0, 3)):
        assert_close_ulps(both["input"][i], guided_grad_cam(e.f, e.params, td, target=t, layer="[2]")["input"])
    per_sample = torch.func.vmap(lambda s: guided_grad_cam(e.f, e.params, s, target=1, layer="[2]"))(td)
    assert_close_ulps(per_sample["input"], guided_grad_cam(e.f, e.params, td, target=1, layer="[2]")["input"])


def test_guided_grad_cam_refuses_a_layer_without_the_inputs_spatial_dims():
    e = build("cnn")
    with pytest.raises(ValueError, match="spatial"):
        guided_grad_cam(e.f, e.params, e.inputs((2,)), target=1, layer="[5]")
    m = build("mlp")
    with pytest.raises(ValueError, match="spatial"):
        guided_grad_cam(m.f, m.params, m.inputs((2,)), target=1, layer="[0]")


def test_guided_grad_cam_writes_nothing():
    e = build("cnn")
    td = TensorDict(input=e.inputs((2,))["input"], batch_size=[2])
    inputs, p = td.clone(), e.params.clone()
    guided_grad_cam(e.f, e.params, td, target=1, layer="[0]")
    assert (td == inputs).all() and (e.params == p).all()


def test_deconvolution_and_gradient_shap_compile_with_fullgraph_and_equal_eager():
    """The deconvolution's own taps, and gradient_shap's indexing of the drawn baselines, trace in one graph.

    (smoothgrad and guided_grad_cam compile too; left out here for the suite's time, about 8 s each.)
    """
    from tdhook_fn.attribution._gradient_shap import gradient_shap

    e = build("cnn")
    td, refs = e.inputs((2,)), e.inputs((4,), seed=3)
    draws = TensorDict(index=torch.randint(4, (2, 5)), alpha=torch.rand(2, 5), batch_size=[2, 5])
    methods = {
        "deconvolution": lambda p, x: deconvolution(e.f, p, x, target=1)["input"],
        "gradient_shap": lambda p, x: gradient_shap(e.f, p, x, refs, target=1, draws=draws)["input"],
    }
    for name, fn in methods.items():
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(e.params, td), fn(e.params, td), msg=name)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in e.model.modules())


def test_threads_sharing_one_model_get_their_own_maps():
    """Each call's taps (and the deconvolution's stack of ReLU inputs) are its own."""
    from concurrent.futures import ThreadPoolExecutor

    from tdhook_fn.attribution._smoothgrad import smoothgrad

    e = build("cnn")
    inputs = [e.inputs((3,), seed=s) for s in range(6)]
    calls = [lambda td: deconvolution(e.f, e.params, td, target=1)["input"],
             lambda td: guided_grad_cam(e.f, e.params, td, target=2, layer="[0]")["input"],
             lambda td: saliency(e.f, e.params, td, target=1)["input"],
             lambda td: smoothgrad(e.f, e.params, td, target=1, stdevs=0.2,
                                   generator=torch.Generator().manual_seed(0))["input"]]
    jobs = [(c, td) for c in calls for td in inputs] * 3
    expected = [c(td) for c, td in jobs]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda job: job[0](job[1]), jobs))
    for g, x in zip(got, expected, strict=True):
        torch.testing.assert_close(g, x, rtol=0, atol=0)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in e.model.modules())


@pytest.mark.parametrize("between", [False, True], ids=["relu-relu", "relu-dropout-relu"])
def test_two_relus_in_a_row_clip_the_gradient_once(between):
    """The deconvnet's map of ``Linear, ReLU, ReLU, Linear`` is ``relu(W2[t]) @ W1`` (captum 0.9's hooks miss it:
    documented)."""
    torch.manual_seed(0)
    middle = [nn.ReLU(), nn.Dropout(0.2), nn.ReLU()] if between else [nn.ReLU(), nn.ReLU()]
    model = nn.Sequential(nn.Linear(6, 10), *middle, nn.Linear(10, 4)).double().eval()
    x, target = torch.randn(5, 6, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 1])
    maps = deconvolution(functional(model), params(model), TensorDict(input=x, batch_size=[5]), target=target)
    first, last = model[0].weight, model[-1].weight
    torch.testing.assert_close(maps["input"], torch.relu(last[target].detach()) @ first.detach())
