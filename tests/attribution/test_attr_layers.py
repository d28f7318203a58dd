"""Layer attribution semantics against hand-written references built from saliency."""

import attr_zoo
import pytest
import torch
from attr_zoo import NAMES, assert_same, build
from tensordict import TensorDict

import tdhook_fn
from tdhook_fn.attribution import DimsConfig, grad_cam, integrated_gradients, quadrature, saliency

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")


@pytest.fixture(autouse=True)
def _one_thread():
    yield from attr_zoo.one_thread()


def _activation(e, td, path):
    """The activation at ``path``, read by a capture tap on the flattened batch."""
    flat = td.reshape(-1)
    act = e.f.with_taps(tdhook_fn.capture(path, key="act"))(e.params, flat)["act"]
    return act.reshape(*td.batch_size, *act.shape[1:])


def _path_average(e, td, base, path, method, n_steps, target):
    """``sum_k w_k * dF/d(layer)`` at the input-space path points ``b + a_k (x - b)``."""
    alphas, weights = quadrature(method, n_steps)
    total = None
    for a, w in zip(alphas, weights, strict=True):
        point = td.clone()
        for key in e.in_keys:
            point.set(key, base[key] + a * (td[key] - base[key]))
        g = saliency(e.f, e.params, point, target=target, layers=[path])[path] * w
        total = g if total is None else total + g
    return total


@pytest.mark.parametrize("name", NAMES)
def test_interpolate_inputs_integrates_layer_gradients_along_the_input_path(name):
    e = build(name, torch.float64)
    td, base = e.inputs((3,)), e.baselines((3,))
    path = next(iter(e.layers))
    ours = integrated_gradients(
        e.f,
        e.params,
        td,
        base,
        target=2,
        n_steps=6,
        method="riemann_right",
        layers=[path],
        interpolate="inputs",
        multiply_by_inputs=False,
    )
    assert set(ours.keys()) == {path, *e.in_keys}
    expected = _path_average(e, td, base, path, "riemann_right", 6, 2)
    torch.testing.assert_close(ours[path], expected, rtol=1e-12, atol=1e-14)
    plain = integrated_gradients(
        e.f, e.params, td, base, target=2, n_steps=6, method="riemann_right", multiply_by_inputs=False
    )
    for key in e.in_keys:
        torch.testing.assert_close(ours[key], plain[key], rtol=1e-12, atol=1e-14)


def test_interpolate_inputs_with_multiply_by_inputs_multiplies_only_the_inputs():
    """Documented: with ``interpolate="inputs"`` "layer results are not multiplied"; the
    default ``multiply_by_inputs=True`` must give IG for the inputs and the path-averaged
    gradient for the layers."""
    e = build("mlp", torch.float64)
    td, base = e.inputs((3,)), e.baselines((3,))
    ours = integrated_gradients(e.f, e.params, td, base, target=1, n_steps=5, layers=["[0]"], interpolate="inputs")
    plain = integrated_gradients(e.f, e.params, td, base, target=1, n_steps=5)
    torch.testing.assert_close(ours["input"], plain["input"], rtol=1e-12, atol=1e-14)
    expected = _path_average(e, td, base, "[0]", "gausslegendre", 5, 1)
    torch.testing.assert_close(ours["[0]"], expected, rtol=1e-12, atol=1e-14)


# layers every path from the inputs to the output goes through (no residual, no second input)
CUTS = {"mlp": "[0]", "conv1d": "[0]", "cnn": "[0]", "two_input": "act", "transformer": "encoder"}
# cuts followed only by linear maps: the integrand is constant along the layer-space path
LINEAR_AFTER = {"mlp": "[3]", "cnn": "[3]", "two_input": "act", "transformer": "encoder"}


@pytest.mark.parametrize("name", sorted(LINEAR_AFTER))
def test_layer_integrated_gradients_is_exact_when_the_rest_of_the_model_is_linear(name):
    e = build(name, torch.float64)
    td, base = e.inputs((2, 3)), e.baselines((2, 3))
    for method in ("gausslegendre", "riemann_left", "riemann_middle"):  # weights summing to 1
        _, delta = integrated_gradients(
            e.f,
            e.params,
            td,
            base,
            target=0,
            n_steps=3,
            method=method,
            layers=[LINEAR_AFTER[name]],
            return_convergence_delta=True,
        )
        assert delta.shape == torch.Size([2, 3])
        assert delta.abs().max() < 1e-12, (method, delta)


@pytest.mark.parametrize("name", sorted(CUTS))
def test_layer_integrated_gradients_converges_to_completeness_through_a_cut(name):
    """interpolate="layers" moves the activation from its value at b to its value at x:
    through a cut of the graph the attributions tend to F(x) - F(b)."""
    e = build(name, torch.float64)
    td, base = e.inputs((3,)), e.baselines((3,))
    deltas = [
        integrated_gradients(
            e.f, e.params, td, base, target=0, n_steps=n, layers=[CUTS[name]], return_convergence_delta=True
        )[1]
        .abs()
        .max()
        for n in (4, 256)
    ]
    assert deltas[1] < 1e-3
    assert deltas[1] <= deltas[0] + 1e-12


@pytest.mark.parametrize("name", ["conv1d", "cnn"])
def test_grad_cam_dims_against_layer_gradients(name):
    e = build(name, torch.float64)
    td = e.inputs((2, 3))
    path = next(iter(e.conv_layers))
    grads = saliency(e.f, e.params, td, target=1, layers=[path], use_inputs=False)[path]  # [2, 3, C, *S]
    act = _activation(e, td, path)
    spatial = tuple(range(1, len(e.shapes[0])))
    sample_dims = tuple(d + 2 for d in spatial)  # within-sample dims after the [2, 3] batch
    configs = {
        "captum": (DimsConfig(spatial, (0,)), (grads.mean(sample_dims, keepdim=True) * act).sum(2)),
        "absolute": (DimsConfig(spatial, (0,)), (grads.abs().mean(sample_dims, keepdim=True) * act).sum(2)),
        "no_pooling": (DimsConfig(None, (0,)), (grads * act).sum(2)),
        "no_sum": (DimsConfig(spatial, None), grads.mean(sample_dims, keepdim=True) * act),
        "negative_dims": (
            DimsConfig(tuple(d - len(e.shapes[0]) for d in spatial), (-len(e.shapes[0]),)),
            (grads.mean(sample_dims, keepdim=True) * act).sum(2),
        ),
    }
    for label, (dims, expected) in configs.items():
        ours = grad_cam(e.f, e.params, td, target=1, layers={path: dims}, absolute=label == "absolute")[path]
        torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-12, msg=label)


@pytest.mark.parametrize("name", NAMES)
def test_layer_saliency_multiplies_by_the_activation(name):
    e = build(name, torch.float64)
    td = e.inputs((3,))
    for path in e.layers:
        grads = saliency(e.f, e.params, td, target=1, layers=[path])
        times = saliency(e.f, e.params, td, target=1, layers=[path], multiply_by_inputs=True)
        for key in e.in_keys:
            assert torch.equal(times[key], grads[key] * td[key])
        # the capture runs without autograd, where the transformer may take its fused kernels
        assert_same(times[path], grads[path] * _activation(e, td, path), exact=name != "transformer")


class _Branches(torch.nn.Module):
    """Two parallel branches summed: neither feeds the other."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = torch.nn.Linear(3, 4), torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.a(x)) + torch.tanh(self.b(x)))


def test_layer_space_ig_refuses_layers_in_series_and_one_module_twice() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    f, p = tdhook_fn.pure(net)
    td = TensorDict(input=torch.randn(5, 3, dtype=torch.float64), batch_size=[5])
    with pytest.raises(ValueError, match=r"layer '\[2\]' depends on another"):
        integrated_gradients(f, p, td, 0.0, target=0, layers=["[0]", "[2]"], interpolate="layers")
    with pytest.raises(ValueError, match=r"name one module twice \('0'\)"):
        integrated_gradients(f, p, td, 0.0, target=0, layers=["[0]", "0"], interpolate="layers")
    branches = _Branches().double()
    f, p = tdhook_fn.pure(branches)
    both = integrated_gradients(f, p, td, 0.0, target=0, layers=["a", "b"], interpolate="layers")
    for path in ("a", "b"):  # independent layers: each as if alone, up to the other's interpolation
        alone = integrated_gradients(f, p, td, 0.0, target=0, layers=[path], interpolate="layers")
        assert both[path].abs().sum() > 0 and alone[path].abs().sum() > 0
