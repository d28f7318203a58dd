"""Maps from a backward whose derivatives are replaced (guided backprop, deconvolution, guided
Grad-CAM, ``grad_fns`` and `map_grad` taps) cannot be differentiated: they raise rather than lie.

A replaced derivative (``relu`` of the gradient at a ReLU, a ``map_grad`` function) sits in
the graph where the module's own derivative was; a second derivative of the map passes
through the same node and gets the replacement again, where the module's value path needs
its own derivative. So ``torch.func.grad`` of such a map, or ``autograd.grad`` of one that
carried a graph, would give a plausible, wrong number (shown below against finite
differences of the map). As for LRP and DeepLift: inputs that require grad are read as
values, params that require grad and outer functorch transforms other than vmap raise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import (
    DimsConfig,
    deconvolution,
    grad_cam,
    guided_backprop,
    guided_grad_cam,
    integrated_gradients,
    saliency,
)

D = torch.float64


def _net() -> nn.Sequential:
    torch.manual_seed(0)  # a smooth activation below the ReLU: second derivatives pass the replaced nodes
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.Tanh(), nn.Conv2d(3, 3, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(3 * 4 * 4, 2)).to(D)


def _halve(g: torch.Tensor) -> torch.Tensor:
    return 0.5 * g


RELU_AT_TANH = {"[1]": torch.relu}


Method = Callable[[Any, Any, Any], Any]
METHODS: dict[str, Method] = {
    "guided_backprop": lambda f, p, x: guided_backprop(f, p, x, target=0),
    "deconvolution": lambda f, p, x: deconvolution(f, p, x, target=0),
    "guided_grad_cam": lambda f, p, x: guided_grad_cam(f, p, x, target=0, layer="[2]"),
    "saliency grad_fns": lambda f, p, x: saliency(f, p, x, target=0, grad_fns={"[1]": torch.relu}),
    "saliency map_grad": lambda f, p, x: saliency(f, p, x, target=0, taps=[tdhook_fn.map_grad("[1]", _halve)]),
    "input x gradient grad_fns": lambda f, p, x: saliency(f, p, x, target=0, multiply_by_inputs=True,
                                                          grad_fns={"[1]": torch.relu}),
    "guided_backprop x inputs": lambda f, p, x: guided_backprop(f, p, x, target=0, multiply_by_inputs=True),
    "ig grad_fns": lambda f, p, x: integrated_gradients(f, p, x, 0.0, target=0, n_steps=3, grad_fns=RELU_AT_TANH),
    "layer ig grad_fns": lambda f, p, x: integrated_gradients(f, p, x, 0.0, target=0, n_steps=3, layers=["[2]"],
                                                              grad_fns=RELU_AT_TANH),
    "grad_cam grad_fns": lambda f, p, x: grad_cam(f, p, x, target=0, layers={"[2]": DimsConfig((1, 2), (0,))},
                                                  grad_fns=RELU_AT_TANH),
}


def _first(maps: TensorDict) -> torch.Tensor:
    return next(iter(maps.values(True, True)))


def _setup() -> tuple[Any, TensorDict, TensorDict]:
    net = _net()
    f, p = tdhook_fn.pure(net)
    torch.manual_seed(1)
    return f, p, TensorDict(input=torch.randn(2, 1, 8, 8, dtype=D), batch_size=[2])


@pytest.mark.parametrize("name", list(METHODS))
def test_an_outer_functorch_derivative_raises(name: str) -> None:
    f, p, x = _setup()
    method = METHODS[name]
    score = lambda q, td: _first(method(f, q, td)).square().sum()
    with pytest.raises(NotImplementedError, match="cannot be differentiated"):
        torch.func.grad(score)(p, x)
    with pytest.raises(NotImplementedError, match="cannot be differentiated"):
        torch.func.grad(score, argnums=1)(p, x)
    per_sample = torch.func.vmap(lambda td: method(f, p, td))(x)  # vmap alone is fine
    torch.testing.assert_close(_first(per_sample), _first(method(f, p, x)), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", list(METHODS))
def test_inputs_that_require_grad_are_read_as_values(name: str) -> None:
    f, p, x = _setup()
    method = METHODS[name]
    needs_grad = x.apply(lambda t: t.clone().requires_grad_())
    maps = _first(method(f, p, needs_grad))
    assert not maps.requires_grad and maps.grad_fn is None
    torch.testing.assert_close(maps, _first(method(f, p, x)), rtol=0, atol=0)


@pytest.mark.parametrize("name", list(METHODS))
def test_params_or_closed_over_tensors_that_require_grad_raise(name: str) -> None:
    f, p, x = _setup()
    method = METHODS[name]
    live = TensorDict.from_module(f.model)
    assert any(t.requires_grad for t in live.values(True, True))
    with pytest.raises(NotImplementedError, match="params require grad"):
        method(f, live, x)
    with torch.no_grad():  # (no graph can be built: the maps are computed as values)
        torch.testing.assert_close(_first(method(f, live, x)), _first(method(f, p, x)), rtol=0, atol=0)


def test_a_closed_over_tensor_that_requires_grad_raises() -> None:
    f, p, x = _setup()
    scale = torch.tensor(2.0, dtype=D, requires_grad=True)
    with pytest.raises(NotImplementedError, match="closed-over tensor"):
        guided_backprop(f, p, x, target=lambda out: out["output"][..., 0] * scale)


def test_the_refused_derivative_was_wrong() -> None:
    """Why: autograd's derivative of a guided-backprop map (inputs' graph kept) is off its finite differences."""
    f, p, x = _setup()
    hooked = tdhook_fn.map_grad("[1]", torch.relu, site="input")  # guided backprop's rule at the Tanh

    def first_order(xx: torch.Tensor) -> torch.Tensor:  # the modified gradient, its graph kept (create_graph)
        leaf = xx.clone().requires_grad_()
        out, _ = tdhook_fn.call_with_taps(f.model, p, [hooked], leaf)
        (g,) = torch.autograd.grad(out[:, 0].sum(), leaf, create_graph=True)
        return g

    base = x["input"].clone().requires_grad_()
    weights = torch.randn_like(base)
    (second,) = torch.autograd.grad((first_order(base) * weights).sum(), base)
    direction, eps = torch.randn_like(base), 1e-6
    numeric = ((first_order(base.detach() + eps * direction) - first_order(base.detach() - eps * direction))
               * weights).sum() / (2 * eps)
    assert abs((second * direction).sum() - numeric) > 1e-3 * abs(numeric)


def test_baselines_that_require_grad_are_read_as_values() -> None:
    f, p, x = _setup()
    base = torch.full((2, 1, 8, 8), 0.1, dtype=D, requires_grad=True)
    maps = integrated_gradients(f, p, x, base, target=0, n_steps=3, grad_fns=RELU_AT_TANH)["input"]
    assert not maps.requires_grad
    expected = integrated_gradients(f, p, x, base.detach(), target=0, n_steps=3, grad_fns=RELU_AT_TANH)["input"]
    torch.testing.assert_close(maps, expected, rtol=0, atol=0)
