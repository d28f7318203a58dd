"""The ReLU taps of deconvolution and guided Grad-CAM: a plan cached per model, seen stale when the model changes."""

import captum.attr as ca
import pytest
import torch
from _tolerance import assert_close_ulps
from attr_zoo import assert_same, on_general_path
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

from tdhook_fn import functional, params
from tdhook_fn._taps import Tap
from tdhook_fn.attribution import deconvolution, guided_backprop, guided_grad_cam

pytestmark = [
    pytest.mark.filterwarnings("ignore:Input Tensor .* did not already require gradients:UserWarning"),
    pytest.mark.filterwarnings("ignore:Setting backward hooks on ReLU:UserWarning"),
]


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 2, 3, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(50, 4)).eval()


def _check(net: nn.Module, x: torch.Tensor) -> None:
    """deconvolution (its taps: off the chain walk) and guided Grad-CAM of ``net`` as captum's, bitwise."""
    f, p = functional(net), params(net)
    theirs = ca.Deconvolution(net).attribute(x.clone(), target=2)
    assert_same(on_general_path(net, lambda: deconvolution(f, p, x, target=2)), theirs, exact=True)
    assert_close_ulps(deconvolution(f, p, x, target=2), theirs)  # (the chain walk, where it is one)
    theirs = ca.GuidedGradCam(net, net[2]).attribute(x.clone(), target=2)
    assert_same(on_general_path(net, lambda: guided_grad_cam(f, p, x, target=2, layer="[2]")), theirs, exact=True)
    assert_close_ulps(guided_grad_cam(f, p, x, target=2, layer="[2]"), theirs)


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
        pairs = ((deconvolution(f, params(net), x, target=1),
                  on_general_path(plain.model, lambda: deconvolution(plain, params(net), x, target=1))),
                 (guided_grad_cam(f, params(net), x, target=1, layer="[2]"),
                  on_general_path(plain.model, lambda: guided_grad_cam(plain, params(net), x, target=1,
                                                                       layer="[2]"))))
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


class _Shifted(nn.ReLU):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 2.0 + 1.0


class _Leaky(nn.ReLU):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.leaky_relu(x, 0.1, inplace=self.inplace)


class _Scaled(nn.ReLU):
    """A ReLU subclass with a parameter of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([0.5, 1.5]).view(2, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * self.scale


def _net_with(relu: nn.Module) -> nn.Sequential:
    """``_net`` with ``relu`` as its second ReLU, a Tanh after it: the ReLU's output values reach the gradient."""
    net = _net()
    net[3] = relu
    net.insert(4, nn.Tanh())
    return net


@pytest.mark.parametrize("relu", (_Shifted(), _Leaky(), _Leaky(inplace=True), _Scaled()), ids=lambda r: repr(r))
def test_a_relu_subclass_keeps_its_forward_under_every_relu_rule(relu):
    """captum swaps only the backward of an nn.ReLU subclass: its own forward gives the values."""
    net, x = _net_with(relu), torch.randn(4, 1, 5, 5)
    f, p = functional(net), params(net)
    _check(net, x)
    plain = _net_with(nn.ReLU())  # (the same weights: _net is seeded)
    assert not torch.equal(deconvolution(f, p, x, target=2), deconvolution(functional(plain), params(plain), x,
                                                                             target=2))  # (the forward counts)
    skip = tuple({type(m) for m in net.modules() if not isinstance(m, nn.ReLU)})
    assert_same(guided_backprop(f, p, x, target=2, classes_to_skip=skip),
                ca.GuidedBackprop(net).attribute(x.clone(), target=2), exact=True)


@pytest.mark.parametrize("site", ("output", "input"))
def test_a_models_hook_that_changes_a_relu_keeps_its_values(site):
    """A hook of the model's on a ReLU changes its values; the rule changes only the backward, as captum's."""
    net, x = _net_with(nn.ReLU()), torch.randn(4, 1, 5, 5)
    if site == "output":
        handle = net[3].register_forward_hook(lambda _m, _args, out: out * 3.0 - 0.5)
    else:
        handle = net[3].register_forward_pre_hook(lambda _m, args: (args[0] * 3.0 - 0.5,))
    try:
        _check(net, x)
    finally:
        handle.remove()


def test_a_relu_subclass_composes_with_vmap_and_grad_refuses():
    net, x = _net_with(_Scaled()), torch.randn(4, 1, 5, 5, dtype=torch.float64)
    net = net.double()
    f, p = functional(net), params(net)
    batched = deconvolution(f, p, x, target=2)
    per_sample = torch.func.vmap(lambda s: deconvolution(f, p, s[None], target=2)[0])(x)
    assert_close_ulps(per_sample, batched)
    with pytest.raises(NotImplementedError, match="cannot be differentiated"):  # (a replaced derivative)
        torch.func.grad(lambda q: deconvolution(f, q, x, target=2).square().sum())(p)


def test_deconvolution_refuses_a_relu_subclass_that_changes_the_shape():
    class Pooled(nn.ReLU):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x)[..., :-1]

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), Pooled(), nn.Flatten(), nn.Linear(40, 3))
    with pytest.raises(ValueError, match=r"ReLU module '1' \(.*Pooled\) returns shape \[4, 2, 5, 4\] from an input"):
        deconvolution(functional(net), params(net), torch.randn(4, 1, 5, 5), target=0)
