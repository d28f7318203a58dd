"""Regressions found by an adversarial hunt for silent wrong numbers in the attribution methods."""

from __future__ import annotations

import attr_zoo
import pytest
import torch
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import deeplift, deeplift_shap, layer_deeplift

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _half_cnn(dtype: torch.dtype) -> nn.Sequential:
    """A ReLU straight into a max pooling: where both rows are negative, the pooling's ``Δx`` is exactly 0."""
    torch.manual_seed(2)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 4)).eval().to(dtype)


CALLS = {
    "deeplift": lambda f, p, x: deeplift(f, p, x, target=1),
    "deeplift_shap": lambda f, p, x: deeplift_shap(f, p, x, 0.5 * x[:2], target=1),
    "layer_deeplift": lambda f, p, x: layer_deeplift(f, p, x, target=1, layers=["[1]"]),
}


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("path", ["walk", "general"])
def test_deeplift_in_float16_takes_the_plain_gradient_where_dx_is_zero(name, path):
    """NOTE [eps in half precision]: eps (1e-10) compared in float16 is 0, and 0 / 0 made the whole map NaN."""
    torch.manual_seed(0)
    x = torch.randn(3, 2, 8, 8)
    maps = {}
    for dtype in (torch.float16, torch.float32):
        model = _half_cnn(dtype)
        f, p = tdhook_fn.pure(model)
        call = lambda f=f, p=p, dtype=dtype: CALLS[name](f, p, x.to(dtype))
        maps[dtype] = call() if path == "walk" else attr_zoo.on_general_path(model, call)
    half, single = maps[torch.float16], maps[torch.float32]
    assert half.dtype == torch.float16 and half.isfinite().all()
    scale = single.abs().max().item()
    torch.testing.assert_close(half.float(), single, rtol=0.0, atol=2e-2 * scale)


@pytest.mark.parametrize("path", ["walk", "general"])
def test_deeplift_in_float16_of_an_input_equal_to_its_baseline_is_zero(path):
    """An input feature at its baseline feeds a Tanh a Δx of 0: its attribution is 0, not NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Tanh(), nn.Linear(4, 3)).half().eval()
    f, p = tdhook_fn.pure(model)
    x = torch.randn(2, 4).half()
    x[:, 0] = 0
    call = lambda: deeplift(f, p, x, target=1)
    out = call() if path == "walk" else attr_zoo.on_general_path(model, call)
    assert out.isfinite().all() and (out[:, 0] == 0).all()


@pytest.mark.parametrize("name", ["layer_conductance", "internal_influence", "neuron_conductance"])
def test_layer_gradients_under_inference_mode_raise_naming_it(name):
    """torch's own error (inference tensors and version counters) was the message; now the method's, as saliency's."""
    from tdhook_fn import attribution

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3)).eval()
    f, p = tdhook_fn.pure(model)
    x = torch.randn(4, 5)
    kwargs = ({"layer": "[1]", "neuron_selector": (1,)} if name == "neuron_conductance" else {"layers": ["[1]"]})
    with torch.inference_mode(), pytest.raises(ValueError, match=rf"{name}.*inference_mode\(\) is active"):
        getattr(attribution, name)(f, p, x, target=1, n_steps=3, **kwargs)


def _bias_registered_first(module: nn.Module) -> nn.Module:
    """``del m.weight; m.weight = Parameter(...)``: the same module, its parameters now in the order (bias, weight)."""
    weight = module.weight
    del module.weight
    module.weight = nn.Parameter(weight.detach().clone())
    return module


@pytest.mark.parametrize("where", ["[0]", "[2]", "[4]"])
@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv"])
def test_a_layer_whose_bias_is_registered_first_gives_the_same_maps(where, conv):
    """The chain walks read a link's tensors in slot order as (weight, bias): a layer registered the other way
    round crashed them with unrelated errors (or could pass its bias as the weight); it now takes the general path."""
    import copy

    from tdhook_fn.attribution import EpsilonPlus, deconvolution, guided_backprop, guided_grad_cam, lrp

    torch.manual_seed(0)
    if conv:
        model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Conv2d(3, 3, 3), nn.ReLU(), nn.Flatten(),
                              nn.Linear(3 * 2 * 2, 3)).double().eval()
        x = torch.randn(4, 2, 6, 6, dtype=torch.float64)
        if where == "[4]":
            where = "[5]"
    else:
        model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3)).double().eval()
        x = torch.randn(4, 6, dtype=torch.float64)
    swapped = copy.deepcopy(model)
    _bias_registered_first(swapped[int(where[1])])
    assert next(iter(swapped[int(where[1])]._parameters)) == "bias"
    calls = {
        "deconvolution": lambda f, p: deconvolution(f, p, x, target=1),
        "guided_backprop": lambda f, p: guided_backprop(f, p, x, target=1),
        "deeplift": lambda f, p: deeplift(f, p, x, 0.1, target=1),
        "deeplift_shap": lambda f, p: deeplift_shap(f, p, x, 0.5 * x[:2], target=1),
        "layer_deeplift": lambda f, p: layer_deeplift(f, p, x, target=1, layers=["[1]"]),
        "lrp": lambda f, p: lrp(f, p, x, target=1, rules=EpsilonPlus()),
    }
    if conv:
        calls["guided_grad_cam"] = lambda f, p: guided_grad_cam(f, p, x, target=1, layer="[2]")
    for name, call in calls.items():
        expected = call(*tdhook_fn.pure(model))
        torch.testing.assert_close(call(*tdhook_fn.pure(swapped)), expected, rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.parametrize("per_target", [False, True], ids=["one target", "per target"])
@pytest.mark.parametrize("method", ["deeplift", "layer_deeplift", "deeplift_shap"])
def test_an_empty_batch_gives_empty_maps_both_ways(method, per_target):
    """An empty batch gave a value on the chain walk and an opaque error on the general path (deeplift and
    layer_deeplift: the shared reference took a first row there was not), or the other way round (deeplift_shap:
    the pairs walk broadcast zero inputs against the references)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    f, p = tdhook_fn.pure(model)
    x = torch.randn(0, 3)
    target = {"target": (0, 1), "per_target": True} if per_target else {"target": 0}
    call = {"deeplift": lambda: deeplift(f, p, x, **target),
            "layer_deeplift": lambda: layer_deeplift(f, p, x, layers=["1"], **target),
            "deeplift_shap": lambda: deeplift_shap(f, p, x, torch.randn(3, 3), **target)}[method]
    walked, general = call(), attr_zoo.on_general_path(model, call)
    shape = (*((2,) if per_target else ()), 0, 4 if method == "layer_deeplift" else 3)
    for maps in (walked, general):
        got = maps if isinstance(maps, torch.Tensor) else maps["1"]
        assert tuple(got.shape) == shape
