"""The deconvnet's, guided backprop's and guided Grad-CAM's maps by the chain walk (NOTE [gradient rules on a chain])
against the general way's, the same numbers; where the walk declines, the general way runs and raises what it
raises."""

import attr_zoo
import pytest
import torch
from _tolerance import assert_close_ulps
from tensordict import TensorDict
from torch import nn
from zoo import same, snapshot

import tdhook_fn
from tdhook_fn.attribution import _deconvolution, _guided_backprop, _guided_grad_cam, guided_backprop
from tdhook_fn.attribution._deconvolution import deconvolution
from tdhook_fn.attribution._guided_grad_cam import guided_grad_cam


@pytest.fixture(autouse=True)
def _one_thread():
    yield from attr_zoo.one_thread()


def _chains() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    """Chains of every link kind the walk knows, each with one sample's input shape."""
    torch.manual_seed(0)
    return {
        "mlp": (nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), (5,)),
        "activations": (nn.Sequential(nn.Linear(5, 6), nn.LeakyReLU(0.3), nn.Linear(6, 6), nn.Sigmoid(),
                                      nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3)), (5,)),
        "softmax": (nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 4), nn.Softmax(dim=-1)), (5,)),
        "nested, dropout": (nn.Sequential(nn.Sequential(nn.Linear(5, 6), nn.ReLU()), nn.Dropout(0.5),
                                          nn.Sequential(nn.Linear(6, 3))), (5,)),
        "cnn, max pool": (nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 3, 3),
                                        nn.ReLU(), nn.Flatten(), nn.Linear(3 * 2 * 2, 4)), (2, 8, 8)),
        "overlapping pools": (nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, stride=1),
                                            nn.Flatten(), nn.Linear(3 * 4 * 4, 3)), (1, 6, 6)),
        "conv1d, stride, groups": (nn.Sequential(nn.Conv1d(4, 6, 3, stride=2, groups=2), nn.ReLU(),
                                                 nn.Conv1d(6, 4, 2, dilation=2), nn.ReLU(), nn.MaxPool1d(2),
                                                 nn.Flatten(), nn.Linear(4 * 1, 3)), (4, 11)),
        "conv3d": (nn.Sequential(nn.Conv3d(1, 2, 2), nn.ReLU(), nn.MaxPool3d(2), nn.Flatten(), nn.Linear(16, 3)),
                   (1, 5, 5, 5)),
    }


CHAINS = tuple(_chains())


def _case(name: str, dtype: torch.dtype, batch: tuple[int, ...]):
    model, shape = _chains()[name]
    model = model.to(dtype).eval()
    x = torch.randn(*batch, *shape, dtype=dtype)
    f, p = tdhook_fn.pure(model)
    return model, f, p, TensorDict(input=x, batch_size=list(batch))


def _refused(*_args, **_kwargs):
    """What stands in for the general way's taps where a test asserts the walk ran."""
    raise AssertionError("the general way ran")


def _batches_and_dtypes(test):
    """``test`` for one and two batch dims, in float32 and float64."""
    test = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])(test)
    return pytest.mark.parametrize("batch", [(4,), (2, 3)], ids=str)(test)


def _both(model: nn.Module, call):
    """The walk's result, and the general way's (the model off the walk)."""
    return call(), attr_zoo.on_general_path(model, call)


@_batches_and_dtypes
@pytest.mark.parametrize("name", CHAINS)
def test_the_walk_gives_the_general_ways_maps(name, dtype, batch):
    model, f, p, td = _case(name, dtype, batch)
    before = snapshot(model)
    walked, general = _both(model, lambda: deconvolution(f, p, td, target=1))
    assert same(before, snapshot(model))
    assert walked.batch_size == general.batch_size
    assert_close_ulps(walked["input"], general["input"])
    assert walked["input"].grad_fn is None


@pytest.mark.parametrize("name", CHAINS)
def test_per_target_and_label_targets_on_the_walk(name):
    model, f, p, td = _case(name, torch.float64, (4,))
    walked, general = _both(model, lambda: deconvolution(f, p, td, target=(0, 2), per_target=True))
    assert walked.batch_size == torch.Size([2, 4])
    assert_close_ulps(walked["input"], general["input"])
    labels = torch.tensor([2, 0, 1, 1])
    walked, general = _both(model, lambda: deconvolution(f, p, td, target=labels))
    assert_close_ulps(walked["input"], general["input"])


def test_a_tensor_call_on_a_chain_takes_the_walk(monkeypatch):
    """No taps are built where the walk runs; a model off the walk builds them."""
    model, f, p, td = _case("cnn, max pool", torch.float32, (3,))

    monkeypatch.setattr(_deconvolution, "relu_rule_taps", _refused)
    assert deconvolution(f, p, td["input"], target=1).shape == td["input"].shape
    assert deconvolution(f, p, td, target=(0, 1), per_target=True)["input"].shape == (2, *td["input"].shape)
    with pytest.raises(AssertionError, match="the general way ran"):
        attr_zoo.on_general_path(model, lambda: deconvolution(f, p, td, target=1))


@pytest.mark.parametrize("how", ("callable target", "cotangents", "input_keys", "in-place relu", "relu subclass"))
def test_where_the_walk_declines_the_general_way_gives_the_same_maps(how):
    model, f, p, td = _case("mlp", torch.float64, (4,))
    expected = deconvolution(f, p, td, target=1)["input"]
    kwargs: dict = {"target": 1}
    if how == "callable target":
        kwargs["target"] = lambda out: out["output"][:, 1]
    elif how == "cotangents":
        kwargs["cotangents"] = lambda values: values.apply(torch.ones_like)
    elif how == "input_keys":
        kwargs["input_keys"] = ["input"]
    else:
        class Relu(nn.ReLU):
            pass

        relu = nn.ReLU(inplace=True) if how == "in-place relu" else Relu()
        swapped = nn.Sequential(*(relu if isinstance(m, nn.ReLU) else m for m in model))
        f = tdhook_fn.functional(swapped)
    assert_close_ulps(deconvolution(f, p, td, **kwargs)["input"], expected)


def test_the_walk_refuses_what_the_general_way_refuses():
    model, f, p, td = _case("mlp", torch.float32, (4,))
    with pytest.raises(NotImplementedError, match="deconvolution"):
        deconvolution(f, p.apply(lambda t: t.detach().requires_grad_()), td, target=1)
    with pytest.raises(NotImplementedError, match="deconvolution"):
        torch.func.grad(lambda x: deconvolution(f, p, x, target=1)["input"].sum())(td)
    with pytest.raises(IndexError):
        deconvolution(f, p, td, target=7)
    x = td["input"].clone().requires_grad_()
    assert deconvolution(f, p, x, target=1).grad_fn is None  # (inputs read as values, as the general way's)


def test_vmap_takes_the_general_way_and_agrees():
    model, f, p, td = _case("cnn, max pool", torch.float64, (3,))
    per_sample = torch.func.vmap(lambda s: deconvolution(f, p, s, target=1))(td)
    assert_close_ulps(per_sample["input"], deconvolution(f, p, td, target=1)["input"])


CONV_CHAINS = ("cnn, max pool", "overlapping pools", "conv1d, stride, groups", "conv3d")


def _spatial_links(model: nn.Module, x: torch.Tensor) -> list[str]:
    """The paths of the chain's links whose output keeps the input's spatial rank (Grad-CAM's layers)."""
    paths, h = [], x[:1]
    for i, module in enumerate(model):
        h = module(h)
        if h.dim() == x.dim():
            paths.append(f"[{i}]")
    return paths


@_batches_and_dtypes
@pytest.mark.parametrize("name", CONV_CHAINS)
def test_guided_grad_cam_on_the_walk_gives_the_general_ways_maps(name, dtype, batch):
    model, f, p, td = _case(name, dtype, batch)
    before = snapshot(model)
    for layer in _spatial_links(model, td["input"].reshape(-1, *td["input"].shape[len(batch):])):
        for target in (1, (0, 2)):
            call = lambda layer=layer, target=target: guided_grad_cam(
                f, p, td, target=target, layer=layer, per_target=isinstance(target, tuple))
            walked, general = _both(model, call)
            assert walked.batch_size == general.batch_size
            assert_close_ulps(walked["input"], general["input"])
    assert same(before, snapshot(model))


def test_guided_grad_cam_takes_the_walk_on_a_chain(monkeypatch):
    model, f, p, td = _case("cnn, max pool", torch.float32, (3,))

    monkeypatch.setattr(_guided_grad_cam, "relu_rule_taps", _refused)
    assert guided_grad_cam(f, p, td["input"], target=1, layer="[3]").shape == td["input"].shape
    for declined in (lambda: guided_grad_cam(f, p, td, target=1, layer="[3]", layer_calls={"[3]": 0}),
                     lambda: guided_grad_cam(f, p, td, target=lambda out: out["output"][:, 1], layer="[3]"),
                     lambda: attr_zoo.on_general_path(model, lambda: guided_grad_cam(f, p, td, target=1,
                                                                                     layer="[3]"))):
        with pytest.raises(AssertionError, match="the general way ran"):
            declined()


SKIPS = {"none (tdhook's default)": (), "linear": (nn.Linear,), "sequential and linear": (nn.Sequential, nn.Linear),
         # (the last linear layer guided, the activation before it not: its weight's rows seed the walk, which
         # must still rectify them, NOTE [seed rows])
         "relu": (nn.ReLU,), "activations": (nn.ReLU, nn.LeakyReLU, nn.Sigmoid, nn.Tanh, nn.Softmax),
         "all but relu": (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d,
                          nn.Flatten, nn.Dropout, nn.Sequential, nn.Sigmoid, nn.Tanh, nn.LeakyReLU, nn.Softmax)}


@pytest.mark.parametrize("skip", list(SKIPS), ids=str)
@pytest.mark.parametrize("name", CHAINS)
def test_guided_backprop_on_the_walk_gives_the_general_ways_maps(name, skip):
    """Every module's input rectified but the skipped ones', an enclosing Sequential's at its first link too."""
    model, f, p, td = _case(name, torch.float64, (2, 3))
    before = snapshot(model)
    for kwargs in ({"target": 1}, {"target": (0, 2), "per_target": True}, {"target": 1, "multiply_by_inputs": True}):
        call = lambda kwargs=kwargs: guided_backprop(f, p, td, classes_to_skip=SKIPS[skip], **kwargs)
        walked, general = _both(model, call)
        assert walked.batch_size == general.batch_size
        assert_close_ulps(walked["input"], general["input"])
    assert same(before, snapshot(model))


def test_an_enclosing_sequential_rectifies_its_first_link():
    """The Sequential [0] is tapped at its input (tdhook taps every submodule), though its first link is skipped."""
    model, f, p, td = _case("nested, dropout", torch.float64, (4,))
    only_linear = guided_backprop(f, p, td, target=1, classes_to_skip=(nn.Linear,))["input"]
    also_sequential = guided_backprop(f, p, td, target=1, classes_to_skip=(nn.Linear, nn.Sequential))["input"]
    assert (only_linear >= 0).all() and (also_sequential < 0).any()


def test_an_empty_sequential_is_rectified_at_its_input_on_the_general_way():
    """An empty ``Sequential`` is no link of the walk but a module tdhook taps: the walk declines where it is guided."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(), nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3)).double().eval()
    f, p = tdhook_fn.pure(model)
    x = torch.randn(4, 5, dtype=torch.float64)
    guides = [tdhook_fn.map_grad(path, torch.relu, site="input")
              for path in tdhook_fn.attribution.module_paths(model, (nn.Linear,))]
    by_taps = tdhook_fn.attribution.saliency(f, p, x, target=1, taps=guides)
    torch.testing.assert_close(guided_backprop(f, p, x, target=1, classes_to_skip=(nn.Linear,)), by_taps,
                               rtol=0, atol=0)
    assert (by_taps >= 0).all()


def test_guided_backprop_takes_the_walk_on_a_chain(monkeypatch):
    model, f, p, td = _case("cnn, max pool", torch.float32, (3,))

    monkeypatch.setattr(_guided_backprop, "guide_taps", _refused)
    assert guided_backprop(f, p, td["input"], target=1).shape == td["input"].shape
    for declined in (lambda: guided_backprop(f, p, td, target=1, layers=["[1]"]),
                     lambda: guided_backprop(f, p, td, target=1, cotangents=lambda v: v.apply(torch.ones_like)),
                     lambda: attr_zoo.on_general_path(model, lambda: guided_backprop(f, p, td, target=1))):
        with pytest.raises(AssertionError, match="the general way ran"):
            declined()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_params_of_another_dtype_raise_as_on_the_general_way(dtype):
    """The last linear layer, skipped by the walk (its weight's rows seed it), still runs where it would raise."""
    from tdhook_fn.attribution import deeplift

    torch.manual_seed(0)
    for model, x, layer in ((nn.Sequential(nn.ReLU(), nn.Linear(5, 4)), torch.randn(3, 5, dtype=dtype), None),
                            (nn.Sequential(nn.MaxPool2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(18, 4)),
                             torch.randn(3, 2, 6, 6, dtype=dtype), "[0]")):
        f, p = tdhook_fn.pure(model.eval())
        calls = [lambda: deconvolution(f, p, x, target=1), lambda: guided_backprop(f, p, x, target=1),
                 lambda: deeplift(f, p, x, target=1)]
        if layer is not None:
            calls.append(lambda: guided_grad_cam(f, p, x, target=1, layer=layer))
        for call in calls:
            with pytest.raises(RuntimeError, match="dtype"):
                call()
            with pytest.raises(RuntimeError, match="dtype"):
                attr_zoo.on_general_path(model, call)


def test_a_non_finite_weight_of_another_class_leaves_the_walks_map_finite():
    """The walk seeds from the target's row of the last weight: another class's inf is not read (autograd's one-hot
    product would spread NaN), so the map is the one of the same model with that weight finite."""
    model, f, p, td = _case("mlp", torch.float64, (4,))
    expected = deconvolution(f, p, td, target=1)["input"]
    p = p.clone()
    p["4", "weight"][0, 0] = float("inf")
    walked = deconvolution(f, p, td, target=1)["input"]
    assert_close_ulps(walked, expected)
    assert attr_zoo.on_general_path(model, lambda: deconvolution(f, p, td, target=1))["input"].isnan().all()
