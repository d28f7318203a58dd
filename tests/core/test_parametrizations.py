"""Models with ``torch.nn.utils.parametrize`` parametrizations, also inside ``parametrize.cached()``
(NOTE [cached parametrizations])."""

import pytest
import torch
from tensordict import TensorDictBase
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import tdhook_fn


class Symmetric(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.triu() + weight.triu(1).transpose(-1, -2)


def parametrized_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).eval()
    if kind == "weight_norm":
        parametrizations.weight_norm(model[2])
    elif kind == "orthogonal":
        parametrizations.orthogonal(model[0])
    else:
        parametrize.register_parametrization(model[0], "weight", Symmetric())
    return model


def scaled(params: TensorDictBase, factor: float) -> TensorDictBase:
    return params.apply(lambda tensor: tensor * factor)


pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")

KINDS = ["weight_norm", "orthogonal", "custom"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_computes_the_parametrized_weight_from_the_params_given(kind: str) -> None:
    model = parametrized_model(kind)
    x = torch.randn(5, 4)
    other = scaled(tdhook_fn.params(model), 1.5)
    expected = torch.func.functional_call(model, dict(other.flatten_keys(".").items()), (x,))
    torch.testing.assert_close(tdhook_fn.call(model, other, x), expected)
    assert any("original" in ".".join(key) for key in other.keys(True, True))


@pytest.mark.parametrize("kind", KINDS)
def test_calls_inside_cached_each_use_their_own_params(kind: str) -> None:
    model = parametrized_model(kind)
    x = torch.randn(5, 4)
    params = tdhook_fn.params(model)
    expected = [tdhook_fn.call(model, scaled(params, factor), x) for factor in (0.5, 2.0)]
    with parametrize.cached():
        actual = [tdhook_fn.call(model, scaled(params, factor), x) for factor in (0.5, 2.0)]
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_a_call_inside_cached_neither_reads_nor_leaves_the_models_cached_weight() -> None:
    model = parametrized_model("weight_norm")
    x = torch.randn(5, 4)
    own = model(x)
    other = scaled(tdhook_fn.params(model), 3.0)
    expected = tdhook_fn.call(model, other, x)
    with parametrize.cached():
        torch.testing.assert_close(model(x), own)  # the model caches its own weight
        torch.testing.assert_close(tdhook_fn.call(model, other, x), expected)
        torch.testing.assert_close(model(x), own)  # and finds it again after the call
        cached = dict(parametrize._cache)
    assert len(cached) == 1  # the model's entry, kept; none of the call's


def test_vmap_over_weight_sets_inside_cached() -> None:
    model = parametrized_model("weight_norm")
    x = torch.randn(5, 4)
    params = tdhook_fn.params(model)
    ensemble = torch.stack([scaled(params, factor) for factor in (0.5, 1.0, 2.0)])
    run = torch.func.vmap(tdhook_fn.call, (None, 0, None))
    expected = run(model, ensemble, x)
    with parametrize.cached():
        tdhook_fn.call(model, params, x)
        actual = run(model, ensemble, x)
    torch.testing.assert_close(actual, expected)


def test_gradients_through_a_cached_parametrization_reach_the_params() -> None:
    model = parametrized_model("custom")
    x = torch.randn(5, 4)
    params = tdhook_fn.params(model).detach()

    def loss(p: TensorDictBase) -> torch.Tensor:
        return tdhook_fn.call(model, p, x).square().sum()

    expected = torch.func.grad(loss)(params)
    with parametrize.cached():
        actual = torch.func.grad(loss)(params)
    torch.testing.assert_close(actual, expected)
