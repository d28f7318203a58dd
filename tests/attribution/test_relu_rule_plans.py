"""The ReLU taps of deconvolution and guided Grad-CAM: a plan cached per model, seen stale when the model changes."""

import captum.attr as ca
import pytest
import torch
from attr_zoo import assert_same
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

from tdhook_fn import functional, params
from tdhook_fn._taps import Tap
from tdhook_fn.attribution import deconvolution, guided_grad_cam

pytestmark = [
    pytest.mark.filterwarnings("ignore:Input Tensor .* did not already require gradients:UserWarning"),
    pytest.mark.filterwarnings("ignore:Setting backward hooks on ReLU:UserWarning"),
]


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 2, 3, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(50, 4)).eval()


def _check(net: nn.Module, x: torch.Tensor) -> None:
    """deconvolution and guided Grad-CAM of ``net`` as captum's, bitwise."""
    f, p = functional(net), params(net)
    assert_same(deconvolution(f, p, x, target=2), ca.Deconvolution(net).attribute(x.clone(), target=2), exact=True)
    ours = guided_grad_cam(f, p, x, target=2, layer="[2]")
    theirs = ca.GuidedGradCam(net, net[2]).attribute(x.clone(), target=2)
    assert_same(ours, theirs, exact=True)


@pytest.mark.parametrize("change", ("relu replaced", "relu in place", "module added", "relu added"))
def test_a_cached_plan_is_not_served_after_the_model_changes(change):
    net, x = _net(), torch.randn(4, 1, 5, 5)
    _check(net, x)
    _check(net, x)  # (the plan served from the cache)
    if change == "relu replaced":
        net[1] = nn.Tanh()
    elif change == "relu in place":
        net[3] = nn.ReLU(inplace=True)
    elif change == "module added":
        net.insert(2, nn.Sequential(nn.Conv2d(3, 3, 1), nn.ReLU()))
    else:
        net.append(nn.ReLU())
    _check(net, x)


def test_a_relu_put_back_is_tapped_again():
    net, x = _net(), torch.randn(4, 1, 5, 5)
    relu = net[1]
    _check(net, x)
    net[1] = nn.Identity()
    _check(net, x)
    net[1] = relu
    _check(net, x)


@pytest.mark.parametrize("site", ("hook", "global hook", "tap"))
def test_what_else_reads_a_relu_sees_its_real_input_and_output(site):
    net, x = _net(), torch.randn(4, 1, 5, 5)
    _check(net, x)  # (a plan cached before the hook or tap comes)
    seen: list[torch.Size] = []
    if site == "hook":
        handle = net[1].register_forward_hook(lambda _m, args, out: seen.extend([args[0].shape, out.shape]))
        f = functional(net)
    elif site == "global hook":
        handle = register_module_forward_hook(
            lambda m, args, out: seen.extend([args[0].shape, out.shape]) if type(m) is nn.ReLU else None)
        f = functional(net)
    else:
        f = functional(net).with_taps(*(Tap(path, "intervene", lambda t: seen.append(t.shape), side)
                                        for path in ("[1]", "1") for side in ("input", "output")))
    plain = functional(_net())
    try:
        pairs = ((deconvolution(f, params(net), x, target=1), deconvolution(plain, params(net), x, target=1)),
                 (guided_grad_cam(f, params(net), x, target=1, layer="[2]"),
                  guided_grad_cam(plain, params(net), x, target=1, layer="[2]")))
    finally:
        if site != "tap":
            handle.remove()
    for ours, theirs in pairs:
        assert_same(ours, theirs, exact=True)
    assert seen and all(shape[0] == 4 and shape[2:] == (5, 5) for shape in seen)  # (real activations, no stand-in)


def test_a_relu_subclass_keeps_its_forward():
    class Shifted(nn.ReLU):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x) + 1.0

    net, x = _net(), torch.randn(4, 1, 5, 5)
    net[3] = Shifted()
    ours = guided_grad_cam(functional(net), params(net), x, target=2, layer="[2]")
    theirs = ca.GuidedGradCam(net, net[2]).attribute(x.clone(), target=2)
    assert_same(ours, theirs, exact=True)
