"""taps=, grad_fns= and target_layers= act on every forward a method runs."""

import attr_zoo
import pytest
import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import DimsConfig, grad_cam, integrated_gradients, saliency


@pytest.fixture(autouse=True)
def _one_thread():
    yield from attr_zoo.one_thread()


@pytest.fixture
def smooth():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double().eval()
    x = TensorDict(input=torch.randn(5, 3, dtype=torch.float64), batch_size=[5])
    base = TensorDict(input=0.2 * torch.randn(5, 3, dtype=torch.float64), batch_size=[5])
    return model, tdhook_fn.functional(model), tdhook_fn.params(model), x, base


TRIPLE = tdhook_fn.intervene("[0]", lambda t: 3 * t)


def _assert_tds_equal(a, b):
    assert set(a.keys()) == set(b.keys())
    for key in a.keys():
        torch.testing.assert_close(a[key], b[key], rtol=1e-12, atol=1e-14, msg=str(key))


def test_taps_argument_equals_taps_on_the_functional_for_saliency_and_grad_cam(smooth):
    _, f, p, x, _ = smooth
    tapped = f.with_taps(TRIPLE)
    _assert_tds_equal(
        saliency(f, p, x, target=1, taps=[TRIPLE], layers=["[2]"]), saliency(tapped, p, x, target=1, layers=["[2]"])
    )
    dims = {"[2]": DimsConfig(None, (0,))}
    _assert_tds_equal(
        grad_cam(f, p, x, target=1, taps=[TRIPLE], layers=dims), grad_cam(tapped, p, x, target=1, layers=dims)
    )
    # and the tap really changes the result
    assert not torch.allclose(saliency(f, p, x, target=1)["input"], saliency(tapped, p, x, target=1)["input"])


def test_taps_argument_equals_taps_on_the_functional_for_input_space_ig(smooth):
    _, f, p, x, base = smooth
    tapped = f.with_taps(TRIPLE)
    _assert_tds_equal(
        integrated_gradients(f, p, x, base, target=1, n_steps=8, taps=[TRIPLE]),
        integrated_gradients(tapped, p, x, base, target=1, n_steps=8),
    )


def test_taps_argument_applies_to_the_convergence_delta(smooth):
    """The delta is sum(attr) - (F(x) - F(b)) for the F that was attributed: the tapped one."""
    _, f, p, x, base = smooth
    tapped = f.with_taps(TRIPLE)
    _, delta = integrated_gradients(f, p, x, base, target=1, n_steps=64, taps=[TRIPLE], return_convergence_delta=True)
    _, expected = integrated_gradients(tapped, p, x, base, target=1, n_steps=64, return_convergence_delta=True)
    assert expected.abs().max() < 1e-10
    torch.testing.assert_close(delta, expected, rtol=0, atol=1e-12)


def test_taps_argument_applies_to_the_layer_ends_of_layer_ig(smooth):
    """interpolate="layers" reads the layer's activations at b and x; a tap upstream changes them."""
    _, f, p, x, base = smooth
    tapped = f.with_taps(TRIPLE)
    _assert_tds_equal(
        integrated_gradients(f, p, x, base, target=1, n_steps=8, layers=["[2]"], taps=[TRIPLE]),
        integrated_gradients(tapped, p, x, base, target=1, n_steps=8, layers=["[2]"]),
    )


def test_target_layers_work_with_the_convergence_delta(smooth):
    model, f, p, x, base = smooth
    hidden = lambda out: TensorDict(h=out["[1]"].sum(-1), batch_size=out.batch_size)
    attrs = integrated_gradients(f, p, x, base, target=hidden, target_layers=["[1]"], n_steps=64)
    with torch.no_grad():
        change = model[:2](x["input"]).sum(-1) - model[:2](base["input"]).sum(-1)
    torch.testing.assert_close(attrs["input"].sum(-1), change, rtol=1e-10, atol=1e-10)  # complete
    _, delta = integrated_gradients(
        f, p, x, base, target=hidden, target_layers=["[1]"], n_steps=64, return_convergence_delta=True
    )
    torch.testing.assert_close(delta, attrs["input"].sum(-1) - change, rtol=0, atol=1e-12)


def test_target_layers_equal_a_truncated_model(smooth):
    model, f, p, x, base = smooth
    hidden = lambda out: TensorDict(h=out["[3]"][..., 1], batch_size=out.batch_size)
    head = model[:4]
    fh, ph = tdhook_fn.functional(head), tdhook_fn.params(head)
    _assert_tds_equal(saliency(f, p, x, target=hidden, target_layers=["[3]"]), saliency(fh, ph, x, target=1))
    _assert_tds_equal(
        integrated_gradients(f, p, x, base, target=hidden, target_layers=["[3]"], n_steps=6),
        integrated_gradients(fh, ph, x, base, target=1, n_steps=6),
    )


def test_grad_fns_scale_the_gradient_through_a_cut(smooth):
    _, f, p, x, base = smooth
    double = {"[2]": lambda g: 2 * g}  # every gradient to the input passes [2]'s output
    plain = saliency(f, p, x, target=0)["input"]
    torch.testing.assert_close(saliency(f, p, x, target=0, grad_fns=double)["input"], 2 * plain, rtol=1e-14, atol=0)
    ig = integrated_gradients(f, p, x, base, target=0, n_steps=5)["input"]
    torch.testing.assert_close(
        integrated_gradients(f, p, x, base, target=0, n_steps=5, grad_fns=double)["input"], 2 * ig, rtol=1e-14, atol=0
    )
    # a grad_fn below the attributed layer does not reach it
    layer = saliency(f, p, x, target=0, layers=["[2]"], grad_fns={"[0]": lambda g: 0 * g})
    assert torch.equal(layer["input"], torch.zeros_like(layer["input"]))
    assert torch.equal(layer["[2]"], saliency(f, p, x, target=0, layers=["[2]"])["[2]"])
