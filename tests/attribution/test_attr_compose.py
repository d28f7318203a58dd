"""Methods compose with torch.func: vmap per sample, grad w.r.t. params, vmap over an ensemble."""

import attr_zoo
import pytest
import torch
from _tolerance import assert_close_ulps
from attr_zoo import CONV_NAMES, NAMES, build
from tensordict import TensorDict
from torch import nn
from torch.func import grad, vmap

import tdhook_fn
from tdhook_fn.attribution import (
    DimsConfig,
    grad_cam,
    guided_backprop,
    integrated_gradients,
    quadrature,
    saliency,
)

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")


@pytest.fixture(autouse=True)
def _one_thread():
    yield from attr_zoo.one_thread()


def _methods(e):
    """name -> (attribution of inputs [and baselines], whether it returns (attrs, delta))."""
    f, p = e.f, e.params
    layer = next(iter(e.layers))
    skip = e.non_relu_classes()
    methods = {
        "saliency": lambda td, b: saliency(f, p, td, target=1, abs=True),
        "input_x_gradient": lambda td, b: saliency(f, p, td, target=1, multiply_by_inputs=True),
        "layer_saliency": lambda td, b: saliency(f, p, td, target=0, layers=[layer]),
        "per_target_saliency": lambda td, b: saliency(f, p, td, target=(0, 2), per_target=True),
        "guided_backprop": lambda td, b: guided_backprop(f, p, td, target=1, classes_to_skip=skip),
        "ig": lambda td, b: integrated_gradients(f, p, td, b, target=2, n_steps=4, return_convergence_delta=True),
        "per_target_ig": lambda td, b: integrated_gradients(
            f, p, td, b, target=(0, 1), n_steps=3, per_target=True, return_convergence_delta=True
        ),
        "layer_ig": lambda td, b: integrated_gradients(
            f, p, td, b, target=1, n_steps=4, layers=[layer], return_convergence_delta=True
        ),
        "ig_chunked": lambda td, b: integrated_gradients(f, p, td, b, target=1, n_steps=5, chunk_size=2),
    }
    if e.conv_layers:
        dims = DimsConfig(tuple(range(1, len(e.shapes[0]))), (0,))
        methods["grad_cam"] = lambda td, b: grad_cam(f, p, td, target=1, layers=dict.fromkeys(e.conv_layers, dims))
        methods["per_target_grad_cam"] = lambda td, b: grad_cam(
            f, p, td, target=(1, 2), per_target=True, layers=dict.fromkeys(e.conv_layers, dims)
        )
    return methods


def _split(result):
    return result if isinstance(result, tuple) else (result, None)


def _total(attrs):
    """What a convergence delta sums: its rounding is relative to this, not to the delta."""
    return float(sum(t.abs().sum() for t in attrs.values(True, True)))


@pytest.mark.parametrize("name", NAMES)
def test_vmap_per_sample_equals_the_batched_call(name):
    """Up to a few ulps: under vmap the model sees other batch shapes, hence other kernels.

    The transformer chains more reductions (attention, layer norm): 2.5 ulps measured.
    """
    e = build(name, torch.float64)
    td, base = e.inputs((4,)), e.baselines((4,))
    ulps = 8 if name == "transformer" else 4
    for method, call in _methods(e).items():
        batched, batched_delta = _split(call(td, base))
        mapped, mapped_delta = _split(vmap(call)(td, base))
        per_target = method.startswith("per_target")
        if per_target:  # vmap puts the sample dim first: [N, T, ...] -> [T, N, ...]
            mapped = mapped.apply(lambda t: t.movedim(1, 0), batch_size=[mapped.batch_size[1], 4])
            mapped_delta = None if mapped_delta is None else mapped_delta.movedim(1, 0)
        assert_close_ulps(mapped, batched, ulps=ulps, msg=method)
        if batched_delta is not None:
            assert_close_ulps(mapped_delta, batched_delta, ulps=ulps, scale=_total(batched), msg=method)


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_vmap_over_the_outer_dim_of_a_two_dim_batch(name):
    e = build(name, torch.float64)
    td, base = e.inputs((2, 3)), e.baselines((2, 3))
    for method, call in _methods(e).items():
        if method.startswith("per_target"):
            continue
        batched, _ = _split(call(td, base))
        mapped, _ = _split(vmap(call)(td, base))
        assert_close_ulps(mapped, batched, msg=method)  # a few ulps, as above


# --- grad w.r.t. params against torch.autograd with create_graph=True -----------------------------------------------


def _smooth():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double().eval()


def _autograd_reference(model, loss_of_input_grads):
    """d loss / d params, where loss reads d(target)/d(input) built with create_graph=True."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in model.named_parameters()}
    loss = loss_of_input_grads(lambda x: torch.func.functional_call(model, leaves, (x,)))
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return {k: torch.zeros_like(v) if g is None else g for (k, v), g in zip(leaves.items(), grads, strict=True)}


def _assert_params_grad(ours, reference):
    assert set(ours.keys(True, True)) == {tuple(k.split(".")) for k in reference}
    for k, ref in reference.items():
        torch.testing.assert_close(ours.get(tuple(k.split("."))), ref, rtol=1e-10, atol=1e-12)


def test_grad_of_saliency_wrt_params_equals_autograd_double_backward():
    model = _smooth()
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    x = torch.randn(5, 4, dtype=torch.float64)
    td = TensorDict(input=x, batch_size=[5])
    weights = torch.randn(5, 4, dtype=torch.float64)

    def ours_loss(params):
        return (saliency(f, params, td, target=1)["input"] * weights).sin().sum()

    def reference(forward):
        xx = x.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(forward(xx)[:, 1].sum(), xx, create_graph=True)
        return (g * weights).sin().sum()

    _assert_params_grad(grad(ours_loss)(p), _autograd_reference(model, reference))

    # the same through input x gradient and per-target maps
    def ours_ixg(params):
        split = saliency(f, params, td, target=(0, 2), per_target=True, multiply_by_inputs=True)["input"]
        return (split[0] ** 2).sum() - split[1].sum()

    def reference_ixg(forward):
        xx = x.clone().requires_grad_(True)
        out = forward(xx)
        (g0,) = torch.autograd.grad(out[:, 0].sum(), xx, create_graph=True)
        (g2,) = torch.autograd.grad(out[:, 2].sum(), xx, create_graph=True)
        return ((g0 * x) ** 2).sum() - (g2 * x).sum()

    _assert_params_grad(grad(ours_ixg)(p), _autograd_reference(model, reference_ixg))


@pytest.mark.parametrize("method", ["gausslegendre", "riemann_left"])
def test_grad_of_integrated_gradients_wrt_params_equals_autograd_double_backward(method):
    model = _smooth()
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    x = torch.randn(3, 4, dtype=torch.float64)
    b = 0.5 * torch.randn(3, 4, dtype=torch.float64)
    td, base = TensorDict(input=x, batch_size=[3]), TensorDict(input=b, batch_size=[3])
    alphas, weights = quadrature(method, 6)

    def ours_loss(params):
        attrs = integrated_gradients(f, params, td, base, target=2, n_steps=6, method=method, chunk_size=4)
        return (attrs["input"] ** 2).sum()

    def reference(forward):
        total = 0
        for a, w in zip(alphas, weights, strict=True):
            point = (b + a * (x - b)).requires_grad_(True)
            (g,) = torch.autograd.grad(forward(point)[:, 2].sum(), point, create_graph=True)
            total = total + w * g
        return ((total * (x - b)) ** 2).sum()

    _assert_params_grad(grad(ours_loss)(p), _autograd_reference(model, reference))


def test_grad_wrt_params_matches_finite_differences():
    model = _smooth()
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    td = TensorDict(input=torch.randn(3, 4, dtype=torch.float64), batch_size=[3])

    def loss(params):
        return (integrated_gradients(f, params, td, 0.0, target=0, n_steps=5)["input"] ** 2).sum()

    g = grad(loss)(p)
    direction = p.apply(lambda t: torch.randn_like(t))
    eps = 1e-6
    plus = loss(p.apply(lambda t, d: t + eps * d, direction))
    minus = loss(p.apply(lambda t, d: t - eps * d, direction))
    directional = sum((g.get(k) * direction.get(k)).sum() for k in g.keys(True, True))
    torch.testing.assert_close(directional, (plus - minus) / (2 * eps), rtol=1e-6, atol=1e-9)


# --- vmap over a stacked ensemble of params ------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_vmap_over_stacked_params_equals_a_loop(name):
    e = build(name, torch.float64)
    td, base = e.inputs((3,)), e.baselines((3,))
    members = [e.params.apply(lambda t, i=i: t * (1.0 + 0.2 * i)) for i in range(3)]
    stacked = torch.stack(members)
    assert stacked.batch_size == torch.Size([3])
    layer = next(iter(e.layers))
    calls = {
        "saliency": lambda p: saliency(e.f, p, td, target=1, layers=[layer]),
        "per_target": lambda p: saliency(e.f, p, td, target=(0, 2), per_target=True),
        "ig": lambda p: integrated_gradients(e.f, p, td, base, target=0, n_steps=3),
        "layer_ig": lambda p: integrated_gradients(e.f, p, td, base, target=0, n_steps=3, layers=[layer]),
        "guided_backprop": lambda p: guided_backprop(e.f, p, td, target=1, classes_to_skip=e.non_relu_classes()),
    }
    if name in CONV_NAMES:
        dims = DimsConfig(tuple(range(1, len(e.shapes[0]))), (0,))
        calls["grad_cam"] = lambda p: grad_cam(e.f, p, td, target=2, layers=dict.fromkeys(e.conv_layers, dims))
    for method, call in calls.items():
        ensemble = vmap(call)(stacked)
        loop = [call(m) for m in members]
        for key in loop[0].keys():
            # batched matmuls may round differently from the per-member ones: a few ulps
            assert_close_ulps(ensemble[key], torch.stack([r[key] for r in loop]), msg=f"{method} {key}")
        # the members really differ, so the comparison is not vacuous
        key = next(iter(loop[0].keys()))
        assert not torch.allclose(loop[0][key], loop[1][key])
