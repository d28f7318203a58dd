"""A module that runs more than once in one forward: gradient and activation from one chosen run."""

import pytest
import torch
from captum.attr import LayerGradientXActivation
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import DimsConfig, grad_cam, integrated_gradients, saliency


class Twice(nn.Module):
    """``head(lin(act(lin(x))))``: ``lin`` and ``act`` run twice, ``act`` on different shapes the second time."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.Tanh()
        self.head = nn.Linear(4, 3)
        self.down = nn.Linear(4, 2)

    def forward(self, x):
        h = self.act(self.lin(x))
        return self.head(self.lin(h)) + self.act(self.down(h)).sum(-1, keepdim=True)


@pytest.fixture
def setup():
    torch.manual_seed(0)
    model = Twice().double().eval()
    x = torch.randn(5, 4, dtype=torch.float64)
    return model, tdhook_fn.functional(model), tdhook_fn.params(model), x, TensorDict(input=x, batch_size=[5])


def test_unchosen_repeated_layer_raises(setup):
    _, f, p, _, td = setup
    for call in (
        lambda: saliency(f, p, td, target=0, layers=["lin"]),
        lambda: integrated_gradients(f, p, td, 0.0, target=0, layers=["lin"]),
        lambda: grad_cam(f, p, td, target=0, layers={"lin": DimsConfig()}),
    ):
        with pytest.raises(ValueError, match=r"'lin' runs 2 times.*layer_calls"):
            call()


def test_last_run_matches_captum(setup):
    model, f, p, x, td = setup
    ours = saliency(f, p, td, target=1, layers=["lin"], use_inputs=False, multiply_by_inputs=True,
                    layer_calls={"lin": -1})["lin"]
    theirs = LayerGradientXActivation(model, model.lin).attribute(x.clone(), target=1)
    torch.testing.assert_close(ours, theirs)


def test_last_run_layer_ig_interpolates_that_run_only(setup):
    """Only the second run of ``lin`` moves along the path; ``head`` is linear in it, so IG is exact.

    (captum's LayerIntegratedGradients replaces *every* run by the interpolation of the last
    one, which is not the integral of any path of this model.)"""
    model, f, p, x, td = setup
    ours = integrated_gradients(f, p, td, 0.0, target=2, layers=["lin"], n_steps=16, layer_calls={"lin": 1})["lin"]
    second = lambda z: model.lin(model.act(model.lin(z)))
    expected = (second(x) - second(torch.zeros_like(x))) * model.head.weight[2]
    torch.testing.assert_close(ours, expected.detach())


def test_first_run_is_the_gradient_at_that_run(setup):
    model, f, p, x, td = setup
    first = lambda d: model.head(model.lin(model.act(model.lin(x) + d))) + model.act(
        model.down(model.act(model.lin(x) + d))).sum(-1, keepdim=True)
    expected = torch.func.vjp(first, torch.zeros(5, 4, dtype=torch.float64))[1](
        torch.eye(3, dtype=torch.float64)[0].expand(5, 3))[0]
    ours = saliency(f, p, td, target=0, layers=["lin"], use_inputs=False, layer_calls={"lin": 0})["lin"]
    torch.testing.assert_close(ours, expected)


def test_runs_of_different_shapes(setup):
    _, f, p, _, td = setup
    first = saliency(f, p, td, target=0, layers=["act"], use_inputs=False, layer_calls={"act": 0})["act"]
    second = saliency(f, p, td, target=0, layers=["act"], use_inputs=False, layer_calls={"act": -1})["act"]
    assert first.shape == (5, 4) and second.shape == (5, 2)
    torch.testing.assert_close(second, torch.ones(5, 2, dtype=torch.float64))  # d(sum act)/d act


def test_bad_layer_calls(setup):
    _, f, p, _, td = setup
    with pytest.raises(ValueError, match=r"layer_calls\['lin'\].*\[-2, 2\)"):
        saliency(f, p, td, target=0, layers=["lin"], layer_calls={"lin": 2})
    with pytest.raises(ValueError, match=r"layer_calls names \['head'\]"):
        saliency(f, p, td, target=0, layers=["lin"], layer_calls={"lin": 0, "head": 0})


class WithSpare(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.spare = nn.Linear(2, 2)  # never called

    def forward(self, x):
        return self.lin(x)


def test_layer_that_never_runs():
    model = WithSpare()
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    td = TensorDict(input=torch.randn(2, 3), batch_size=[2])
    with pytest.raises(ValueError, match=r"'spare' never ran"):
        saliency(f, p, td, target=0, layers=["spare"])
