"""``input_keys`` given as one str names one input, as ``functional``'s ``in_keys`` does (not its characters)."""

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import Epsilon, convergence_delta, guided_backprop, integrated_gradients, lrp, saliency


def _two_inputs():
    torch.manual_seed(0)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 2)

        def forward(self, x, y):
            return self.a(x) * self.b(y)

    model = Two().eval()
    f = tdhook_fn.functional(model, ["first", "second"], ["output"])
    inputs = TensorDict(first=torch.randn(4, 3), second=torch.randn(4, 3), batch_size=[4])
    return f, tdhook_fn.params(model), inputs


def _lrp(*args, **kwargs):
    return lrp(*args, rules={nn.Linear: Epsilon()}, warn_on_missing_rule=False, **kwargs)


@pytest.mark.parametrize("method", [saliency, guided_backprop, _lrp])
def test_a_str_input_keys_is_one_key(method):
    f, params, inputs = _two_inputs()
    one = method(f, params, inputs, target=0, input_keys="first")
    listed = method(f, params, inputs, target=0, input_keys=["first"])
    assert list(one.keys()) == ["first"]
    torch.testing.assert_close(one["first"], listed["first"], rtol=0, atol=0)


def test_a_str_input_keys_is_one_key_for_integrated_gradients_and_its_delta():
    f, params, inputs = _two_inputs()
    one = integrated_gradients(f, params, inputs, 0.0, target=1, input_keys="second", n_steps=8)
    listed = integrated_gradients(f, params, inputs, 0.0, target=1, input_keys=["second"], n_steps=8)
    assert list(one.keys()) == ["second"]
    torch.testing.assert_close(one["second"], listed["second"], rtol=0, atol=0)
    delta = convergence_delta(f, params, inputs, 0.0, one, target=1, input_keys="second")
    listed_delta = convergence_delta(f, params, inputs, 0.0, listed, target=1, input_keys=["second"])
    torch.testing.assert_close(delta, listed_delta)
