"""The engine's passes: several pullbacks of one forward, each to its own keys after its own setup."""

import copy

import attr_zoo
import captum.attr as ca
import pytest
import torch
from _tolerance import assert_close_ulps
from attr_zoo import assert_same, build
from tensordict import TensorDict
from torch import nn

from tdhook_fn import functional, params
from tdhook_fn.attribution import guided_backprop, guided_grad_cam
from tdhook_fn.attribution._backward_passes import BackwardPass
from tdhook_fn.attribution._deconvolution import relu_rule_taps
from tdhook_fn.attribution._engine import gradients
from tdhook_fn.attribution._gradient_chain import Guide

pytestmark = [
    pytest.mark.filterwarnings("ignore:Input Tensor .* did not already require gradients:UserWarning"),
    pytest.mark.filterwarnings("ignore:Setting backward hooks on ReLU:UserWarning"),
]


@pytest.fixture(autouse=True)
def _one_thread():
    yield from attr_zoo.one_thread()


@pytest.mark.parametrize("per_target", (False, True))
def test_passes_give_what_one_call_per_pass_gives(per_target):
    e = build("cnn", torch.float64)
    td = e.inputs((3,))
    target = (0, 2) if per_target else 1
    kwargs = {"per_target": per_target, "layers": {"[2]": None}}
    both = gradients(e.f, e.params, td, target, input_keys=("input",), **kwargs,
                     passes=(BackwardPass(("[2]",)), BackwardPass(("input",))))
    alone = gradients(e.f, e.params, td, target, input_keys=("input",), **kwargs)
    for key in ("input", "[2]"):
        assert_close_ulps(both.grads[key], alone.grads[key])
    assert_close_ulps(both.activations["[2]"], alone.activations["[2]"])


@pytest.mark.parametrize("per_target", (False, True))
def test_each_pass_runs_its_setup_first_and_switches_a_rule(per_target):
    """The guided taps switched off for the pass to the layer, on for the inputs': each equals its own call."""
    e = build("cnn", torch.float64)
    td = e.inputs((3,))
    target = (0, 2) if per_target else 1
    guide, order = Guide(on=False), []

    def switch(on):
        def before():
            order.append(on)
            guide.on = on
        return before

    both = gradients(e.f, e.params, td, target, input_keys=("input",), layers={"[2]": None}, per_target=per_target,
                     taps=relu_rule_taps(e.f, guided=True, guide=guide),
                     passes=(BackwardPass(("[2]",), switch(False)), BackwardPass(("input",), switch(True))))
    assert order == [False, True]
    plain = gradients(e.f, e.params, td, target, input_keys=(), layers={"[2]": None}, per_target=per_target)
    guided = gradients(e.f, e.params, td, target, input_keys=("input",), per_target=per_target,
                       taps=relu_rule_taps(e.f, guided=True))
    assert_close_ulps(both.grads["[2]"], plain.grads["[2]"])
    assert_close_ulps(both.grads["input"], guided.grads["input"])
    assert not torch.allclose(guided.grads["input"], gradients(e.f, e.params, td, target, input_keys=("input",),
                                                               per_target=per_target).grads["input"])


def test_passes_compose_with_vmap():
    e = build("cnn", torch.float64)
    td = e.inputs((3,))
    guide = Guide(on=False)

    def both(sample):
        out = gradients(e.f, e.params, sample, 1, input_keys=("input",), layers={"[2]": None},
                        taps=relu_rule_taps(e.f, guided=True, guide=guide),
                        passes=(BackwardPass(("[2]",), guide.setter(False)),
                                BackwardPass(("input",), guide.setter(True))))
        return out.grads

    batched = both(td)
    per_sample = torch.func.vmap(both)(td)
    for key in ("input", "[2]"):
        assert_close_ulps(per_sample[key], batched[key])


def test_a_pass_naming_no_attributed_key_and_a_key_in_no_pass_are_refused():
    e = build("cnn")
    td = e.inputs((2,))
    with pytest.raises(ValueError, match=r"pass 1 names \['nope'\]"):
        gradients(e.f, e.params, td, 1, input_keys=("input",), layers={"[2]": None},
                  passes=(BackwardPass(("[2]",)), BackwardPass(("nope",))))
    with pytest.raises(ValueError, match=r"no pass gives the gradients of \['input'\]"):
        gradients(e.f, e.params, td, 1, input_keys=("input",), layers={"[2]": None}, passes=(BackwardPass(("[2]",)),))


def test_guided_grad_cam_runs_one_forward():
    e = build("cnn")
    td = e.inputs((2,))
    runs = []
    handle = e.model.register_forward_hook(lambda *_: runs.append(1))  # (the model's hooks run on its shadow)
    try:
        guided_grad_cam(e.f, e.params, td, target=1, layer="[2]")  # (the first call probes the layer's shape)
        runs.clear()
        guided_grad_cam(e.f, e.params, td, target=1, layer="[2]")
    finally:
        handle.remove()
    assert len(runs) == 1


def test_guided_backprop_paths_follow_the_model():
    """guided_backprop's paths are planned per model: a changed model is tapped as it is now."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double().eval()
    x = torch.randn(5, 4, dtype=torch.float64)
    skip = (nn.Linear,)
    for change in (None, "relu", "tanh"):
        if change == "relu":
            net[3] = nn.ReLU()
        elif change == "tanh":
            net[1] = nn.Tanh()
        ours = guided_backprop(functional(net), params(net), x, target=1, classes_to_skip=skip)
        fresh = copy.deepcopy(net)
        theirs = guided_backprop(functional(fresh), params(fresh), x, target=1, classes_to_skip=skip)
        assert_same(ours, theirs, exact=True)
        if change != "tanh":  # (nothing but ReLUs guided: captum's GuidedBackprop)
            assert_same(guided_backprop(functional(net), params(net), x, target=1,
                                        classes_to_skip=(nn.Linear, nn.Tanh)),
                        ca.GuidedBackprop(net).attribute(x.clone(), target=1), exact=True)


@pytest.mark.parametrize("wanted", (None, [1], [0, 1]))
def test_the_vmapped_pullback_accelerators_take_equals_one_pullback_per_target(wanted):
    """`pull_vmapped` (the per-target pullback on accelerators), run here on the CPU, against `pull_each`'s loop."""
    from tdhook_fn._vjp import vjp
    from tdhook_fn.attribution._backward_passes import pull_each, pull_vmapped

    torch.manual_seed(0)
    w = torch.randn(3, 4, dtype=torch.float64)
    x, h = torch.randn(5, 3, dtype=torch.float64), torch.zeros(5, 4, dtype=torch.float64)
    values, pullback, _ = vjp(lambda p: ({"y": torch.tanh(p[0] @ w + p[1])}, []), [x, h])
    cot = TensorDict(y=torch.eye(4, dtype=torch.float64)[:, None].expand(4, 5, 4), batch_size=[4, 5])
    looped = pull_each(pullback, cot, retain_graph=True, wanted=wanted)
    vmapped = pull_vmapped(pullback, cot, wanted)
    for i in range(2):
        if wanted is not None and i not in wanted:
            assert looped[i] is None and (i >= len(vmapped) or vmapped[i] is None)
        else:
            assert_close_ulps(vmapped[i], looped[i])
