"""Bad input raises a clear error, and the model is bitwise unchanged afterwards."""

import re

import attr_zoo
import pytest
import torch
from attr_zoo import build
from tensordict import TensorDict
from zoo import same, snapshot

import tdhook_fn
from tdhook_fn.attribution import (
    SUPPORTED_METHODS,
    DimsConfig,
    grad_cam,
    guided_backprop,
    integrated_gradients,
    saliency,
)


@pytest.fixture(autouse=True)
def _one_thread():
    yield from attr_zoo.one_thread()


@pytest.fixture
def two():
    """The two-input model with inputs of batch [3]; the model is checked unchanged after the test."""
    e = build("two_input")
    before = snapshot(e.model)
    yield e, e.inputs((3,))
    assert same(before, snapshot(e.model))


def _const(out):
    return TensorDict(const=torch.ones(out.batch_size), batch_size=out.batch_size)


def _argmax(out):
    return TensorDict(cls=out["output"].argmax(-1), batch_size=out.batch_size)


def _detached(out):
    return TensorDict(frozen=out["output"][..., 0].detach(), batch_size=out.batch_size)


def _extra(out):
    return TensorDict(w=2 * out["w"], batch_size=out.batch_size)


# --- integrated_gradients: baselines, method, n_steps, chunk_size ---------------------------------------------


def test_missing_baseline_key_is_a_key_error_naming_it(two):
    e, td = two
    with pytest.raises(KeyError, match="'y'"):
        integrated_gradients(e.f, e.params, td, td.select("x"), target=0)


def test_missing_baseline_key_for_explicit_input_keys(two):
    e, td = two
    with pytest.raises(KeyError, match="'x'"):
        integrated_gradients(e.f, e.params, td, td.select("y"), target=0, input_keys=["x"])


@pytest.mark.parametrize("shape", [(3, 2), (2, 3), (3, 3, 1)], ids=str)
def test_baseline_shape_mismatch_is_a_value_error(two, shape):
    """(One sample's ``[1, 3]`` or ``[3]`` broadcasts, as a tensor baseline does.)"""
    e, td = two
    base = TensorDict(x=torch.zeros(3, 4), y=torch.zeros(shape), batch_size=[])
    with pytest.raises(ValueError, match=re.escape("baselines for input 'y' have shape") + ".*" + re.escape("[3, 3]")):
        integrated_gradients(e.f, e.params, td, base, target=0)


def test_baselines_of_the_wrong_type_are_a_type_error(two):
    e, td = two
    with pytest.raises(TypeError, match="baselines"):
        integrated_gradients(e.f, e.params, td, "zeros", target=0)


@pytest.mark.parametrize("method", ["simpson", "riemann", "Gausslegendre", ""])
def test_unknown_method_lists_the_supported_ones(two, method):
    e, td = two
    with pytest.raises(ValueError, match="unknown integration method") as info:
        integrated_gradients(e.f, e.params, td, 0.0, target=0, method=method)
    for supported in SUPPORTED_METHODS:
        assert supported in str(info.value)


@pytest.mark.parametrize(
    ("method", "n_steps"),
    [
        *((m, 1) for m in SUPPORTED_METHODS if m.startswith("riemann")),
        ("gausslegendre", 0),
        ("riemann_left", -3),
        ("gausslegendre", 2.0),
        ("riemann_middle", True),
        ("gausslegendre", "10"),
    ],
)
def test_too_few_or_non_int_steps_are_a_value_error(two, method, n_steps):
    e, td = two
    with pytest.raises(ValueError, match="n_steps"):
        integrated_gradients(e.f, e.params, td, 0.0, target=0, method=method, n_steps=n_steps)


@pytest.mark.parametrize("chunk_size", [0, -1, 2.0, True, "3"])
def test_bad_chunk_size_is_a_value_error(two, chunk_size):
    e, td = two
    with pytest.raises(ValueError, match="chunk_size"):
        integrated_gradients(e.f, e.params, td, 0.0, target=0, n_steps=4, chunk_size=chunk_size)


def test_unknown_interpolation_is_a_value_error(two):
    e, td = two
    with pytest.raises(ValueError, match="interpolate"):
        integrated_gradients(e.f, e.params, td, 0.0, target=0, layers=["a"], interpolate="activations")


# --- targets ----------------------------------------------------------------------------------------------------


def _every_method(e, td, target, **kwargs):
    return {
        "saliency": lambda: saliency(e.f, e.params, td, target=target, **kwargs),
        "layer_saliency": lambda: saliency(e.f, e.params, td, target=target, layers=["a"], use_inputs=False, **kwargs),
        "ig": lambda: integrated_gradients(e.f, e.params, td, 0.0, target=target, n_steps=3, **kwargs),
        "ig_delta": lambda: integrated_gradients(
            e.f, e.params, td, 0.0, target=target, n_steps=3, return_convergence_delta=True, **kwargs
        ),
        "layer_ig": lambda: integrated_gradients(
            e.f, e.params, td, 0.0, target=target, n_steps=3, layers=["a"], **kwargs
        ),
        "grad_cam": lambda: grad_cam(e.f, e.params, td, target=target, layers={"a": DimsConfig(None, (0,))}, **kwargs),
        "guided_backprop": lambda: guided_backprop(e.f, e.params, td, target=target, **kwargs),
    }


@pytest.mark.parametrize(
    ("target", "key"),
    [(_const, "const"), (_argmax, "cls"), (_detached, "frozen")],
    ids=["constant", "integer", "detached"],
)
@pytest.mark.parametrize("per_target", [False, True])
def test_a_target_not_depending_on_the_inputs_is_a_value_error_naming_it(two, target, key, per_target):
    e, td = two
    for call in _every_method(e, td, target, per_target=per_target).values():
        with pytest.raises(ValueError, match=f"target '{key}' does not depend"):
            call()


def test_a_target_reading_only_an_extra_input_key_is_a_value_error(two):
    e, td = two
    td = td.clone()
    td.set("w", torch.rand(3))  # a float key that is not an in_key: not attributed, so constant
    with pytest.raises(ValueError, match="target 'w' does not depend"):
        saliency(e.f, e.params, td, target=_extra)


@pytest.mark.parametrize("target", [True, (), (0, "1"), 1.5, "output"], ids=repr)
def test_a_malformed_target_is_a_type_error(two, target):
    e, td = two
    with pytest.raises(TypeError, match="target"):
        saliency(e.f, e.params, td, target=target)


def test_a_target_returning_neither_a_tensordict_nor_a_tensor_is_a_type_error(two):
    e, td = two  # a plain tensor is one target key (tests/attribution/test_captum_style_inputs.py)
    with pytest.raises(TypeError, match="must return a TensorDict"):
        saliency(e.f, e.params, td, target=lambda out: [out["output"][..., 0]])


def test_per_target_with_unequal_target_counts_is_a_value_error(two):
    e, td = two
    uneven = lambda out: TensorDict(a=out["output"][..., :2], b=out["output"], batch_size=out.batch_size)
    with pytest.raises(ValueError, match="same number of targets"):
        saliency(e.f, e.params, td, target=uneven, per_target=True)
    # summed, the same targets are fine
    summed = saliency(e.f, e.params, td, target=uneven)
    assert set(summed.keys()) == {"x", "y"}


def test_an_int_target_needs_a_single_output():
    e = build("mlp")
    before = snapshot(e.model)
    tapped = e.f.with_taps(tdhook_fn.capture("[1]", key="hidden"))  # a second output leaf
    assert set(tapped(e.params, e.inputs((3,))).keys()) == {"output", "hidden"}
    with pytest.raises(ValueError, match="single output"):
        saliency(tapped, e.params, e.inputs((3,)), target=0)
    assert same(before, snapshot(e.model))


# --- f and paths ------------------------------------------------------------------------------------------------


def test_layer_attribution_needs_a_functional(two):
    e, td = two
    plain = lambda p, d: e.f(p, d)
    with pytest.raises(TypeError, match="Functional"):
        saliency(plain, e.params, td, target=0, layers=["a"])
    with pytest.raises(TypeError, match="Functional"):
        integrated_gradients(plain, e.params, td, 0.0, target=0, layers=["a"])
    with pytest.raises(TypeError, match="Functional"):
        guided_backprop(plain, e.params, td, target=0)
    # without layers a plain pure function is fine
    assert torch.equal(saliency(plain, e.params, td, target=0)["x"], saliency(e.f, e.params, td, target=0)["x"])


@pytest.mark.parametrize("path", ["nope", "a.weight.x", "head[0]", "__class__"])
def test_an_unknown_layer_path_is_a_value_error(two, path):
    e, td = two
    for call in (
        lambda: saliency(e.f, e.params, td, target=0, layers=[path]),
        lambda: integrated_gradients(e.f, e.params, td, 0.0, target=0, layers=[path]),
        lambda: grad_cam(e.f, e.params, td, target=0, layers={path: DimsConfig()}),
        lambda: saliency(e.f, e.params, td, target=0, target_layers=[path]),
    ):
        with pytest.raises(ValueError, match="path"):
            call()


def test_the_model_runs_normally_after_errors(two):
    e, td = two
    reference = saliency(e.f, e.params, td, target=1, layers=["a"])
    for bad in (
        lambda: saliency(e.f, e.params, td, target=_const, layers=["a"]),
        lambda: saliency(e.f, e.params, td, target=0, layers=["nope"]),
    ):
        with pytest.raises(ValueError):
            bad()
    again = saliency(e.f, e.params, td, target=1, layers=["a"])
    for key in reference.keys():
        assert torch.equal(again[key], reference[key])
    with torch.no_grad():
        assert torch.equal(e.model(td["x"], td["y"]), e.f(e.params, td)["output"])


def test_module_paths_refuses_a_name_it_cannot_quote() -> None:
    from tdhook_fn.attribution import module_paths

    model = torch.nn.Sequential()
    model.add_module("a>b", torch.nn.ReLU())
    with pytest.raises(ValueError, match=r"the submodule 'a>b' has no path form .*holds '>'.*rename the module"):
        module_paths(model)


class _PositionalEmbedding(torch.nn.Module):
    """Adds an embedding of the positions, shared by the samples: its activation has no batch dim."""

    def __init__(self):
        super().__init__()
        self.positions = torch.nn.Embedding(8, 4)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(x + self.positions(torch.arange(x.shape[1]))).sum(-2)


@pytest.mark.parametrize("method", ["saliency", "integrated_gradients"])
def test_a_layer_without_the_batch_dim_is_named(method):
    torch.manual_seed(0)
    f, p = tdhook_fn.pure(_PositionalEmbedding())
    x = TensorDict(input=torch.randn(6, 5, 4), batch_size=[6])
    call = {"saliency": lambda: saliency(f, p, x, target=1, layers=["positions"]),
            "integrated_gradients": lambda: integrated_gradients(f, p, x, 0.0, target=1, layers=["positions"])}[method]
    with pytest.raises(ValueError, match=r"layer 'positions' outputs shape \[5, 4\], whose first dim is not the batch"):
        call()
    assert saliency(f, p, x, target=1, layers=["head"])["head"].shape == (6, 5, 2)  # after it joins the batch


@pytest.mark.parametrize("method", ["saliency", "integrated_gradients"])
def test_a_method_under_inference_mode_says_autograd_is_off(method) -> None:
    """The target had no gradient, and the error did not say why."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    f, p = tdhook_fn.pure(net)
    x = TensorDict(input=torch.randn(5, 3), batch_size=[5])
    call = getattr(tdhook_fn.attribution, method)
    args = (0.0,) if method == "integrated_gradients" else ()
    expected = call(f, p, x, *args, target=0)["input"]
    with torch.inference_mode(), pytest.raises(ValueError, match=r"does not depend .*autograd is off: torch.inference"):
        call(f, p, x, *args, target=0)
    with torch.no_grad():  # (the methods enable grad for their own forward)
        torch.testing.assert_close(call(f, p, x, *args, target=0)["input"], expected)


class _TupleBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))), x


class _OnATupleBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.t, self.c = _TupleBlock(), torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.c(self.t(x)[0])


@pytest.mark.parametrize("method", ["layer_deeplift", "lrp"])
def test_a_method_on_lrps_rules_says_its_own_name(method):
    """layer DeepLift runs on LRP's rules: its errors named lrp."""
    model = _OnATupleBlock()
    f, p = tdhook_fn.functional(model, in_keys=["x"], out_keys=["y"]), tdhook_fn.params(model)
    td = TensorDict(x=torch.randn(3, 4), batch_size=[3])
    call = {"layer_deeplift": lambda: tdhook_fn.attribution.layer_deeplift(f, p, td, target=0, layers=["t"]),
            "lrp": lambda: tdhook_fn.attribution.lrp(f, p, td, target=0, layers=["t"], use_inputs=False,
                                                     rules={}, warn_on_missing_rule=False)}[method]
    with pytest.raises(TypeError, match=rf"^{method}: layer 't' outputs a tuple"):
        call()
