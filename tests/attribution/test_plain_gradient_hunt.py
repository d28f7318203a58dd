"""Calls where the plain gradient's chain walk once gave other numbers than the engine's general path, or a map
where that path raises (NOTE [plain gradients on a chain], NOTE [autograd's linear pullback])."""

import attr_zoo
import pytest
import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import integrated_gradients, saliency


@pytest.fixture(autouse=True)
def _one_thread():
    yield from attr_zoo.one_thread()


_walks = attr_zoo.plain_walks


def _same_both_ways(model: nn.Module, call) -> None:
    torch.testing.assert_close(call(), attr_zoo.on_general_path(model, call), rtol=0, atol=0)


def _model(*modules: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    return nn.Sequential(*modules).to(dtype).eval()


@pytest.mark.parametrize("first", ["linear", "relu then linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_a_transposed_input_is_pulled_back_as_autograd_does(first, dtype, monkeypatch):
    """A column-major input makes autograd pull the linear layer back by ``(W^T g^T)^T``, which rounds otherwise
    than ``g W``: the walk takes autograd's product."""
    torch.manual_seed(0)
    head = [nn.ReLU()] if first == "relu then linear" else []
    model = _model(*head, nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3), dtype=dtype)
    f, p = tdhook_fn.pure(model)
    td = TensorDict(input=torch.randn(5, 8, dtype=dtype).t(), batch_size=[8])
    taken = _walks(monkeypatch)
    for call in (lambda: saliency(f, p, td, target=1),
                 lambda: integrated_gradients(f, p, td, 0.0, n_steps=3, target=torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]))):
        walked = call()
        general = attr_zoo.on_general_path(model, call)
        torch.testing.assert_close(walked, general, rtol=0, atol=0)
    assert taken[0]


def test_a_width_one_layer_at_batch_one_is_pulled_back_as_autograd_does(monkeypatch):
    """A ``[1, 1]`` activation is column-major too (strides ``(1, 1)``): autograd's other product, at batch 1."""
    torch.manual_seed(95)
    model = _model(nn.Linear(5, 1), nn.Tanh(), nn.Linear(1, 2), nn.Tanh(), nn.LeakyReLU(-0.5), nn.Linear(2, 7),
                   dtype=torch.float64)
    f, p = tdhook_fn.pure(model)
    taken = _walks(monkeypatch)
    for _ in range(20):
        td = TensorDict(input=torch.randn(1, 5, dtype=torch.float64) * 10, batch_size=[1])
        walked = saliency(f, p, td, target=0)["input"]
        assert taken[-1]
        torch.testing.assert_close(walked, attr_zoo.on_general_path(model, lambda: saliency(f, p, td, target=0))[
            "input"], rtol=0, atol=0)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("layout", ["features transposed", "batch transposed"])
def test_a_non_contiguous_input_of_a_linear_layer_on_more_dims_takes_the_engines_way(layout, bias, monkeypatch):
    """autograd's linear layer on a non-contiguous 3-d input is a batched product, another kernel: the walk
    declines."""
    torch.manual_seed(1)
    model = _model(nn.Linear(5, 8, bias=bias), nn.ReLU(), nn.Flatten(), nn.Linear(24, 3))
    f, p = tdhook_fn.pure(model)
    transposed = layout == "features transposed"
    x = torch.randn(8, 5, 3).transpose(1, 2) if transposed else torch.randn(3, 8, 5).transpose(0, 1)
    td = TensorDict(input=x, batch_size=[8])
    taken = _walks(monkeypatch)
    walked = saliency(f, p, td, target=1)
    assert taken == [False]
    torch.testing.assert_close(walked, attr_zoo.on_general_path(model, lambda: saliency(f, p, td, target=1)),
                               rtol=0, atol=0)


@pytest.mark.parametrize("which", ["inputs", "params"])
def test_inference_tensors_raise_as_the_engine_does(which, monkeypatch):
    """autograd refuses inference tensors (made under ``torch.inference_mode()``), so the engine raises: the walk,
    which needs no autograd, declines rather than give a map."""
    torch.manual_seed(2)
    model = _model(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    f, p = tdhook_fn.pure(model)
    x = torch.randn(4, 5)
    with torch.inference_mode():
        if which == "inputs":
            x = x.clone()
        else:
            p = p.clone()
    td = TensorDict(input=x, batch_size=[4])
    taken = _walks(monkeypatch)
    with pytest.raises(RuntimeError, match="[Ii]nference") as walked:
        saliency(f, p, td, target=1)
    assert taken == [False]
    with pytest.raises(RuntimeError) as general:
        attr_zoo.on_general_path(model, lambda: saliency(f, p, td, target=1))
    assert str(walked.value) == str(general.value)


@pytest.mark.parametrize("method", ["saliency", "deeplift", "guided_backprop", "deconvolution"])
@pytest.mark.parametrize("form", ["tensordict", "tensor"])
def test_an_empty_chain_takes_the_general_way(method, form):
    """A chain of no module (the model an empty ``Sequential`` in a ``Sequential``: the identity) raised an
    IndexError in every chain walk, reading the last link for its seed rows (NOTE [seed rows])."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Sequential())
    f, p = tdhook_fn.pure(model)
    x = torch.randn(4, 5)
    given = TensorDict(input=x, batch_size=[4]) if form == "tensordict" else x
    extra = (0.0,) if method == "deeplift" else ()
    call = getattr(tdhook_fn.attribution, method)
    walked = call(f, p, given, *extra, target=1)
    general = attr_zoo.on_general_path(model, lambda: call(f, p, given, *extra, target=1))
    torch.testing.assert_close(walked, general, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["guided_backprop", "deconvolution"])
def test_the_rule_walks_pull_a_transposed_input_back_as_autograd_does(method):
    """The gradient-rule walks share the linear layers' pullback (NOTE [gradient rules on a chain]): autograd's
    product on a column-major input too."""
    torch.manual_seed(0)
    model = _model(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    f, p = tdhook_fn.pure(model)
    td = TensorDict(input=torch.randn(5, 8).t(), batch_size=[8])
    _same_both_ways(model, lambda: getattr(tdhook_fn.attribution, method)(f, p, td, target=1))


@pytest.mark.parametrize("method", ["saliency", "guided_backprop", "deconvolution"])
def test_a_leaky_relu_whose_slope_is_a_tensor_takes_the_general_way(method):
    """``F.leaky_relu`` reads a 0-d tensor slope as its number, ``leaky_relu_backward`` refuses it: the walk raised
    a schema error where the general path gives the map."""
    torch.manual_seed(4)
    model = _model(nn.Linear(5, 6), nn.LeakyReLU(torch.tensor(0.1)), nn.Linear(6, 3))
    f, p = tdhook_fn.pure(model)
    td = TensorDict(input=torch.randn(4, 5), batch_size=[4])
    _same_both_ways(model, lambda: getattr(tdhook_fn.attribution, method)(f, p, td, target=1))


@pytest.mark.parametrize("method", ["saliency", "guided_backprop", "deconvolution"])
def test_a_softmax_whose_dim_is_a_bool_raises_as_the_model_does(method):
    """``dim=True`` equals 1, the last dim of a 2-d input, but the softmax refuses a bool: the walk gave a map."""
    torch.manual_seed(5)
    model = _model(nn.Linear(5, 6), nn.Softmax(dim=-1), nn.Linear(6, 3))
    model[1].dim = True
    f, p = tdhook_fn.pure(model)
    td = TensorDict(input=torch.randn(4, 5), batch_size=[4])
    call = getattr(tdhook_fn.attribution, method)
    with pytest.raises(TypeError, match="dim") as walked:
        call(f, p, td, target=1)
    with pytest.raises(TypeError) as general:
        attr_zoo.on_general_path(model, lambda: call(f, p, td, target=1))
    assert str(walked.value) == str(general.value)


_LRP = {"rules": tdhook_fn.attribution.EpsilonPlus()}  # (lrp's own walk declines there as well)


@pytest.mark.parametrize("method", ["saliency", "integrated_gradients", "guided_backprop", "deconvolution", "deeplift",
                                    "lrp"])
def test_autocast_takes_the_general_way(method):
    """Under ``torch.autocast`` the forward runs in bfloat16 and autograd casts the maps back to the inputs'
    float32: the walks gave bfloat16 maps of other numbers."""
    torch.manual_seed(6)
    model = _model(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.Sigmoid(), nn.Linear(8, 3))
    f, p = tdhook_fn.pure(model)
    td = TensorDict(input=torch.randn(4, 5), batch_size=[4])
    extra = (0.0,) if method in ("integrated_gradients", "deeplift") else ()
    call = getattr(tdhook_fn.attribution, method)

    def autocast():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return call(f, p, td, *extra, target=1, **(_LRP if method == "lrp" else {}))

    walked = autocast()
    general = attr_zoo.on_general_path(model, autocast)
    assert walked["input"].dtype == general["input"].dtype == torch.float32
    torch.testing.assert_close(walked, general, rtol=0, atol=0)


def _in_context(context: str, call):
    """``call()`` under one of autograd's global modes (NOTE [a chain walked by hand]: the walks decline there)."""
    if context == "anomaly mode":
        with torch.autograd.detect_anomaly(check_nan=True):
            return call()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 2, lambda t: t):  # (a backward reads 2x)
        return call()


@pytest.mark.parametrize("method", ["saliency", "guided_backprop", "deconvolution", "lrp"])
@pytest.mark.parametrize("context", ["anomaly mode", "saved tensor hooks"])
def test_autograds_global_modes_take_the_general_way(context, method):
    """Anomaly mode raises where a backward returns NaN, saved-tensor hooks may change what a backward reads: the
    walks, which run no backward, gave a map of their own."""
    torch.manual_seed(7)
    model = _model(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Sigmoid(), nn.Linear(8, 3))
    f, p = tdhook_fn.pure(model)
    x = torch.randn(4, 5)
    x[0, 0] = float("nan") if context == "anomaly mode" else x[0, 0]
    td = TensorDict(input=x, batch_size=[4])
    call = getattr(tdhook_fn.attribution, method)
    outcomes = []
    def in_context():
        return _in_context(context, lambda: call(f, p, td, target=1, **(_LRP if method == "lrp" else {})))

    for run in (in_context, lambda: attr_zoo.on_general_path(model, in_context)):
        try:
            outcomes.append(run())
        except RuntimeError as error:
            outcomes.append(str(error))
    if context == "anomaly mode":
        assert isinstance(outcomes[1], str) and "nan" in outcomes[1]
        assert outcomes[0] == outcomes[1]
    else:
        torch.testing.assert_close(outcomes[0], outcomes[1], rtol=0, atol=0)


def test_a_dual_input_keeps_its_tangent(monkeypatch):
    """Under forward AD the walk's ops, which run under no_grad, carried the dual input's tangent into the map,
    where the engine's map is what its VJP gives: the walk declines."""
    torch.manual_seed(8)
    model = _model(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3), dtype=torch.float64)
    f, p = tdhook_fn.pure(model)
    x, direction = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    fwad = torch.autograd.forward_ad

    def tangent():
        with fwad.dual_level():
            td = TensorDict(input=fwad.make_dual(x, direction), batch_size=[4])
            return fwad.unpack_dual(saliency(f, p, td, target=1)["input"]).tangent

    taken = _walks(monkeypatch)
    walked = tangent()
    general = attr_zoo.on_general_path(model, tangent)
    assert taken[0] is False and (walked is None) == (general is None)
    if general is not None:
        torch.testing.assert_close(walked, general, rtol=0, atol=0)
