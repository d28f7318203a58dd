"""Linear layers and convolutions as one op each way (NOTE [affine modules], NOTE [fused alpha-beta]).

The map and its adjoint are checked against the module's own forward and autograd's
VJP over convolution settings (hypothesis); the fused alpha-beta of the chain walk
against the rule's own relevance; and the modules that must not qualify against
their own forwards.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import pytest
import torch
from _tolerance import assert_close_ulps
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import AlphaBeta, Epsilon, EpsilonPlus, Pass, ZPlus, lrp, rule_taps, saliency
from tdhook_fn.attribution._lrp.affine import affine_of
from tdhook_fn.attribution._lrp.fused import fused
from tdhook_fn.attribution._lrp.module_call import ModuleCall, Template

CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


@st.composite
def convolutions(draw: Any) -> tuple[nn.Module, torch.Tensor]:
    """A convolution with drawn settings, and an input for it (batched or not)."""
    dims = draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 2]))
    kernel = draw(st.integers(1, 3))
    module = CONVS[dims](2 * groups, draw(st.integers(1, 2)) * groups, kernel, stride=draw(st.integers(1, 3)),
                         padding=draw(st.integers(0, 2)), dilation=draw(st.integers(1, 2)), groups=groups,
                         bias=draw(st.booleans())).double()
    reach = (kernel - 1) * module.dilation[0] + 1
    size = [draw(st.integers(max(reach - 2 * module.padding[0], 1), 7)) for _ in range(dims)]
    batch = [draw(st.integers(1, 3))] if draw(st.booleans()) else []  # unbatched inputs too
    return module, torch.randn(*batch, 2 * groups, *size, dtype=torch.float64)


def module_vjp(module: nn.Module, x: torch.Tensor, cotangent: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(module(x), x, cotangent)
    return g


@settings(max_examples=60, deadline=None)
@given(convolutions())
def test_a_convolution_and_its_adjoint_are_the_modules(case: tuple[nn.Module, torch.Tensor]) -> None:
    module, x = case
    affine = affine_of(type(module), module.__dict__, module._parameters)
    assert affine is not None
    y = affine.run(x, module.weight, module.bias)
    torch.testing.assert_close(y, module(x), rtol=1e-12, atol=1e-12)
    cotangent = torch.randn_like(y)
    expected = module_vjp(module, x, cotangent)
    torch.testing.assert_close(affine.pullback(module.weight, x.shape, y.shape)(cotangent), expected,
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(5,), (3, 5), (2, 3, 5)])
def test_a_linear_layer_and_its_adjoint(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    module = nn.Linear(5, 4).double()
    x = torch.randn(*shape, dtype=torch.float64)
    affine = affine_of(nn.Linear, module.__dict__, module._parameters)
    assert affine is not None and affine.channel_dim == -1
    cotangent = torch.randn(*shape[:-1], 4, dtype=torch.float64)
    torch.testing.assert_close(affine.run(x, module.weight, module.bias), module(x), rtol=0, atol=0)
    expected = module_vjp(module, x, cotangent)
    torch.testing.assert_close(affine.pullback(module.weight, x.shape, cotangent.shape)(cotangent), expected,
                               rtol=1e-12, atol=1e-12)


class OwnForward(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2.0


def _instance_forward() -> nn.Module:
    module = nn.Linear(4, 4)
    module.forward = functools.partial(lambda self, x: nn.Linear.forward(self, x) + 1.0, module)  # type: ignore[method-assign]
    return module


def _no_weight_parameter() -> nn.Module:
    module = nn.Linear(4, 4)
    weight = module.weight.detach()
    del module.weight
    module.weight = weight  # a plain attribute (as a parametrization leaves it)
    return module


@pytest.mark.parametrize("make", [
    lambda: OwnForward(4, 4),
    lambda: nn.Conv2d(2, 2, 3, padding="same"),
    lambda: nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"),
    lambda: nn.Conv2d(2, 2, 3, padding=1, padding_mode="circular"),
    lambda: nn.ConvTranspose2d(2, 2, 3),
    lambda: nn.Bilinear(2, 2, 2),
    _instance_forward,
    _no_weight_parameter,
], ids=["subclass-forward", "padding-same", "reflect", "circular", "transposed", "bilinear", "instance-forward",
        "weight-not-a-parameter"])
def test_modules_that_are_not_one_op(make: Any) -> None:
    module = make()
    assert affine_of(type(module), module.__dict__, module._parameters) is None


@pytest.mark.parametrize("make", [lambda: OwnForward(4, 3), lambda: nn.Conv1d(4, 3, 3, padding="same"),
                                  lambda: nn.Conv1d(4, 3, 3, padding=1, padding_mode="reflect")],
                         ids=["subclass-forward", "padding-same", "reflect"])
def test_their_rules_run_their_own_forward(make: Any) -> None:
    """z+ on a module that is no one op: the module's own forward and autograd (a subclass doubling its output)."""
    torch.manual_seed(0)
    module = make().double()
    x = torch.randn(2, 4, *([5] if isinstance(module, nn.Conv1d) else []), dtype=torch.float64)
    tensors: list[torch.Tensor] = []
    template = Template.of(module, tensors)
    assert template.affine is None
    call = ModuleCall("m", (x,), module(x), template, tuple(tensors), {})
    z, pull = call.linearize([x], lambda _n, p: p.clamp(min=0))
    with torch.no_grad():
        clamped = make().double()
        clamped.load_state_dict({k: v.clamp(min=0) for k, v in module.state_dict().items()})
    torch.testing.assert_close(z, clamped(x), rtol=1e-12, atol=1e-12)
    cotangent = torch.randn_like(z)
    torch.testing.assert_close(pull(cotangent)[0], module_vjp(clamped, x, cotangent), rtol=1e-12, atol=1e-12)


RULES = [ZPlus(), AlphaBeta(2.0, 1.0), AlphaBeta(3.0, 2.0)]


@pytest.mark.parametrize("rule", RULES, ids=repr)
@pytest.mark.parametrize("module", ["linear", "linear-no-bias", "conv", "conv-no-bias", "conv-strided"])
@pytest.mark.parametrize("negative", [True, False], ids=["negative-inputs", "after-relu"])
def test_fused_alpha_beta_is_the_rule(rule: AlphaBeta, module: str, negative: bool) -> None:
    torch.manual_seed(0)
    layer = {"linear": lambda: nn.Linear(6, 5), "linear-no-bias": lambda: nn.Linear(6, 5, bias=False),
             "conv": lambda: nn.Conv2d(3, 4, 3, padding=1), "conv-no-bias": lambda: nn.Conv2d(3, 4, 3, bias=False),
             "conv-strided": lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1, dilation=2)}[module]().double()
    x = torch.randn(4, 6, dtype=torch.float64) if "linear" in module else torch.randn(4, 3, 7, 7,
                                                                                       dtype=torch.float64)
    if not negative:
        x = x.relu()
    tensors: list[torch.Tensor] = []
    template = Template.of(layer, tensors)
    assert template.affine is not None
    done = fused(rule, template.affine, x, layer.weight.detach(), None if layer.bias is None else layer.bias.detach())
    assert done is not None
    y, pull = done
    with torch.no_grad():
        assert_close_ulps(y, layer(x), ulps=16)  # (the same products; summed in another order with both signs)
        call = ModuleCall("m", (x,), y, template, tuple(t.detach() for t in tensors), {})
        relevance = torch.randn_like(y)
        (expected,) = rule.relevance(call, relevance)
        assert_close_ulps(pull(relevance), expected, ulps=64)


def test_grouped_convolutions_take_the_rule_itself() -> None:
    layer = nn.Conv2d(4, 4, 3, groups=2).double()
    affine = affine_of(nn.Conv2d, layer.__dict__, layer._parameters)
    assert affine is not None and affine.groups == 2
    assert fused(ZPlus(), affine, torch.randn(1, 4, 5, 5, dtype=torch.float64), layer.weight, layer.bias) is None
    assert fused(Epsilon(), affine, torch.randn(1, 4, 5, 5, dtype=torch.float64), layer.weight, layer.bias) is None


def test_the_walk_with_every_kind_of_affine_module_gives_the_taps_maps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain of 1-, 2- and 3-d convolutions (grouped, strided, unfusable) and linear layers, walked and tapped."""
    lrp_module = importlib.import_module("tdhook_fn.attribution._lrp.method")
    walked_by: list[bool] = []
    chain_lrp = lrp_module.chain_lrp
    monkeypatch.setattr(lrp_module, "chain_lrp", lambda *a: walked_by.append((r := chain_lrp(*a)) is not None) or r)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv3d(1, 2, 2), nn.ReLU(), nn.Flatten(1, 2),  # [B, 2, 3, 4, 4] -> [B, 6, 4, 4]
        nn.Conv2d(6, 4, 3, padding=1, groups=2), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2, padding=1),
        nn.Flatten(2), nn.Conv1d(4, 3, 3, padding="same"), nn.ReLU(), nn.Flatten(), nn.Linear(12, 5), nn.ReLU(),
        nn.Linear(5, 3, bias=False)).double().eval()
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    x = TensorDict(input=torch.randn(3, 1, 4, 5, 5, dtype=torch.float64), batch_size=[3])
    for rules in (EpsilonPlus(), {nn.Conv3d: AlphaBeta(), nn.Conv2d: ZPlus(), nn.Conv1d: ZPlus(),
                                  nn.Linear: AlphaBeta(), nn.ReLU: Pass()}):
        walked = lrp(f, p, x, target=1, rules=rules, warn_on_missing_rule=False)["input"]
        taps = rule_taps(f, rules, warn_on_missing_rule=False)
        assert_close_ulps(walked, saliency(f, p, x, target=1, taps=taps)["input"], ulps=64)
        assert walked.abs().sum() > 0
    assert walked_by == [True, True]


@pytest.mark.parametrize("pool", [
    nn.MaxPool1d(2), nn.MaxPool2d(2), nn.MaxPool3d(2), nn.MaxPool2d(3, stride=1, padding=1),
    nn.MaxPool2d(2, stride=1, dilation=2), nn.MaxPool2d(3, stride=2, ceil_mode=True),
], ids=["1d", "2d", "3d", "overlapping-padded", "dilated", "ceil-mode"])
def test_the_walks_max_pooling_ties_and_overlaps_are_the_gradients(pool: nn.Module,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Max pooling on the walk (NOTE [lrp on a chain]): the gradient's scatter, ties (zeros after a ReLU) included."""
    lrp_module = importlib.import_module("tdhook_fn.attribution._lrp.method")
    walked_by: list[bool] = []
    chain_lrp = lrp_module.chain_lrp
    monkeypatch.setattr(lrp_module, "chain_lrp", lambda *a: walked_by.append((r := chain_lrp(*a)) is not None) or r)
    torch.manual_seed(0)
    dims = {nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3}[type(pool)]
    conv = CONVS[dims](2, 3, 3, padding=1)
    with torch.no_grad():
        conv.bias.sub_(0.6)  # many zeros after the ReLU: windows whose maximum is a tie
    model = nn.Sequential(conv, nn.ReLU(), pool, nn.Flatten(), nn.LazyLinear(4)).double().eval()
    x = torch.randn(3, 2, *[6] * dims, dtype=torch.float64)
    model(x)  # (materializes the lazy layer)
    assert (model[1](model[0](x)) == 0).double().mean() > 0.3
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    td = TensorDict(input=x, batch_size=[3])
    rules = {nn.Conv1d: ZPlus(), nn.Conv2d: ZPlus(), nn.Conv3d: ZPlus(), nn.ReLU: Pass(), nn.Linear: Epsilon()}
    walked = lrp(f, p, td, target=2, rules=rules, warn_on_missing_rule=False)["input"]
    tapped = saliency(f, p, td, target=2, taps=rule_taps(f, rules, warn_on_missing_rule=False))["input"]
    assert walked_by == [True]
    assert_close_ulps(walked, tapped, ulps=64)
    assert walked.abs().sum() > 0


def test_the_stacked_weights_follow_the_params_and_keep_nothing_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk's stacked weights (NOTE [fused alpha-beta]) follow new params and any write, and keep nothing."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 3, 3), nn.Flatten(),
                          nn.Linear(12, 2)).double().eval()
    f = tdhook_fn.functional(model)
    x = TensorDict(input=torch.randn(2, 2, 4, 4, dtype=torch.float64), batch_size=[2])
    lrp_module = importlib.import_module("tdhook_fn.attribution._lrp.method")

    def both(p: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
        walked = lrp(f, p, x, target=1, rules=EpsilonPlus(), warn_on_missing_rule=False)["input"]
        with monkeypatch.context() as m:
            m.setattr(lrp_module, "chain_lrp", lambda *_a: None)
            return walked, lrp(f, p, x, target=1, rules=EpsilonPlus(), warn_on_missing_rule=False)["input"]

    p = tdhook_fn.params(model)
    first, _ = both(p)
    with torch.no_grad():
        p["0", "weight"].mul_(-2.0)  # in place: the same tensor, a new version
        p["2", "bias"].add_(1.0)
    walked, tapped = both(p)
    assert_close_ulps(walked, tapped, ulps=64)
    assert not torch.allclose(walked, first)
    p["0", "weight"].data.mul_(-1.0)  # through .data: no new version (a training loop writes so)
    again, tapped = both(p)
    assert_close_ulps(again, tapped, ulps=64)
    assert not torch.allclose(again, walked)
    other = p.apply(lambda t: t * 0.5)  # new tensors
    assert_close_ulps(*both(other), ulps=64)
    dead = weakref.ref(other["0", "weight"])
    del other
    gc.collect()
    assert dead() is None


def test_the_kept_stacked_weights_are_served_only_for_the_same_bits() -> None:
    """NOTE [stacked weights kept]: the same bits serve the kept stack; a signed zero, a NaN, a .data write do not."""
    from tdhook_fn.attribution._lrp.stack_cache import StackCache

    stacks, built = StackCache(), []

    def build() -> object:
        built.append(object())
        return built[-1]

    w, b = torch.randn(3, 2, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    first = stacks.get(w, b, False, build)
    assert stacks.get(w.clone(), b.clone(), False, build) is first  # other tensors, the same bits
    assert stacks.get(w, b, True, build) is not first  # the other input sign has its own
    b.data[0] = -0.0  # equal to 0.0, other bits, and no new version
    assert stacks.get(w, b, False, build) is not first
    w2 = w.clone()
    w2[0, 0] = float("nan")
    nan_stack = stacks.get(w2, b, False, build)
    assert stacks.get(w2.clone(), b, False, build) is nan_stack  # a NaN's bits are its own: served again
    assert stacks.get(w2, None, False, build) is not nan_stack
    assert stacks.get(w2.float(), b.float(), False, build) is not nan_stack
    big = torch.randn(1 << 9, 1 << 8)
    assert stacks.get(big, None, False, build) is not stacks.get(big, None, False, build)  # large: never kept
    assert len(built) == 8
