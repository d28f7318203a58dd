"""Models that read an in-place module's input again: ``y = relu_(h)``, then ``head(y) + other(h)``.

``h`` holds the module's output after it runs, so ``other(h)`` reads ``relu(h)``. The rule
methods gave the module a copy, so ``other(h)`` read ``h`` as it was before, silently (up to
30 off in LRP); a layer's gradient at the module reached it through ``y`` alone. Each test
compares the in-place model with its twin that reads the output in both branches
(NOTE [replaced derivatives of in-place modules]).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from attr_zoo import DropoutAfterReLU
from tensordict import TensorDict
from torch import nn
from zoo import same, snapshot

from tdhook_fn import functional, map_grad, params
from tdhook_fn.attribution import (
    Epsilon,
    EpsilonPlus,
    ZPlus,
    deconvolution,
    deeplift,
    deeplift_shap,
    guided_backprop,
    guided_grad_cam,
    integrated_gradients,
    internal_influence,
    layer_conductance,
    layer_deeplift,
    lrp,
    saliency,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ACTIVATIONS = (nn.ReLU, nn.LeakyReLU, nn.ELU, nn.Hardtanh)


class _SubclassedReLU(nn.ReLU):
    """Not ``nn.ReLU`` itself: deconvolution runs the module (no stand-in)."""


class _Rereads(nn.Module):
    """``a -> act``; ``head`` reads the activation's output, ``other`` its input (``h``, or the twin's output)."""

    def __init__(self, act: type[nn.Module], inplace: bool, conv: bool = False, view: bool = False):
        super().__init__()
        layer: Callable[[int, int], nn.Module] = (lambda i, o: nn.Conv2d(i, o, 3, padding=1)) if conv else nn.Linear
        self.a, self.act = layer(4, 6), act(inplace=inplace)
        self.head, self.other = layer(6 if not view else 3, 3), layer(6, 3)
        self.inplace, self.view, self.conv = inplace, view, conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.a(x)
        if self.view:  # the module writes a view: its base changes too
            h = z[:, :3]
            y = self.act(h)
            return self.head(y) + self.other(z if self.inplace else torch.cat([y, z[:, 3:]], 1))
        y = self.act(z)
        out = self.head(y) + self.other(z if self.inplace else y)
        return out.mean((-2, -1)) if self.conv else out


def _twins(act: type[nn.Module] = nn.ReLU, **kw: bool) -> list[tuple[nn.Module, Callable, TensorDict]]:
    """The in-place model and its twin (the same weights), each with its pure function, in float64."""
    torch.manual_seed(0)
    written = _Rereads(act, True, **kw).double()
    twin = _Rereads(act, False, **kw).double()
    twin.load_state_dict(written.state_dict())
    return [(m, functional(m, in_keys=["x"], out_keys=["y"]), params(m)) for m in (written, twin)]


def _inputs(conv: bool = False) -> TensorDict:
    shape = (5, 4, 3, 3) if conv else (5, 4)
    return TensorDict(x=torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)),
                      batch_size=[5])


_REFERENCES = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

METHODS: dict[str, Callable] = {
    "deconvolution": lambda f, p, td: deconvolution(f, p, td, target=1),
    "guided_backprop": lambda f, p, td: guided_backprop(f, p, td, target=1),
    "guided_backprop_skipping_linear": lambda f, p, td: guided_backprop(f, p, td, target=1,
                                                                        classes_to_skip=(nn.Linear,)),
    "deeplift": lambda f, p, td: deeplift(f, p, td, target=1),
    "deeplift_shap": lambda f, p, td: deeplift_shap(f, p, td, _REFERENCES, target=1),
    "layer_deeplift": lambda f, p, td: layer_deeplift(f, p, td, target=1, layers=["a"]),
    "lrp_epsilon_plus": lambda f, p, td: lrp(f, p, td, target=1, rules=EpsilonPlus()),
    "lrp_epsilon_everywhere": lambda f, p, td: lrp(f, p, td, target=1, rules={
        "a": Epsilon(), "act": Epsilon(), "head": Epsilon(), "other": Epsilon()}),
    "lrp_zplus_on_the_activation": lambda f, p, td: lrp(f, p, td, target=1, rules={
        "a": Epsilon(), "act": ZPlus(), "head": Epsilon(), "other": Epsilon()}),
    "map_grad_at_its_input": lambda f, p, td: saliency(f, p, td, target=1, taps=[
        map_grad("act", lambda g: 2 * g.clamp(min=0), site="input")]),
    "map_grad_at_its_output": lambda f, p, td: saliency(f, p, td, target=1, taps=[
        map_grad("act", lambda g: 2 * g.clamp(min=0))]),
    "map_grad_at_both_sites_and_its_layer": lambda f, p, td: saliency(f, p, td, target=1, layers=["act"], taps=[
        map_grad("act", lambda g: 2 * g.clamp(min=0)), map_grad("act", lambda g: g.clamp(max=0.5), site="input")]),
    # the module's output is its written input: a layer's gradient reaches it through every reader
    "saliency_of_its_layer": lambda f, p, td: saliency(f, p, td, target=1, layers=["act"], use_inputs=False,
                                                       multiply_by_inputs=True),
    "integrated_gradients_of_its_layer": lambda f, p, td: integrated_gradients(f, p, td, 0.0, target=1,
                                                                               layers=["act"], use_inputs=False),
    "layer_conductance": lambda f, p, td: layer_conductance(f, p, td, 0.0, target=1, layers=["act"]),
    "internal_influence": lambda f, p, td: internal_influence(f, p, td, 0.0, target=1, layers=["act"]),
    "layer_deeplift_of_the_activation": lambda f, p, td: layer_deeplift(f, p, td, target=1, layers=["act"]),
    "lrp_of_its_layer": lambda f, p, td: lrp(f, p, td, target=1, rules=EpsilonPlus(), layers=["act"]),
    "guided_backprop_and_its_layer": lambda f, p, td: guided_backprop(f, p, td, target=1, layers=["act"]),
    # (f's own tap and deconvolution's on one module: one frame, NOTE [replaced derivatives of in-place modules])
    "deconvolution_after_fs_map_grad": lambda f, p, td: deconvolution(
        f.with_taps(map_grad("act", lambda g: 2 * g)), p, td, target=1),
}


def _close(written: TensorDict, twin: TensorDict) -> None:
    for key in twin.keys(True, True):
        torch.testing.assert_close(written[key], twin[key], rtol=1e-12, atol=1e-12, msg=str(key))


@pytest.mark.parametrize("act", ACTIVATIONS, ids=lambda a: a.__name__)
@pytest.mark.parametrize("name", METHODS)
def test_the_other_branch_reads_the_written_input(name, act):
    (model, f, p), (_, g, q) = _twins(act)
    td = _inputs()
    before, x = snapshot(model), td["x"].clone()
    _close(METHODS[name](f, p, td), METHODS[name](g, q, td))
    assert same(before, snapshot(model)) and torch.equal(td["x"], x)


@pytest.mark.parametrize("name", ("deconvolution", "guided_backprop", "deeplift", "lrp_epsilon_plus"))
def test_a_written_view_writes_its_base(name):
    """``relu_(z[:, :3])`` writes ``z``, which ``other`` reads."""
    (_, f, p), (_, g, q) = _twins(view=True)
    td = _inputs()
    _close(METHODS[name](f, p, td), METHODS[name](g, q, td))


@pytest.mark.parametrize("name", ("deconvolution", "guided_backprop"))
def test_a_relu_subclass_runs_itself(name):
    """Deconvolution runs a ReLU subclass on a copy (no stand-in); its output is written back as well."""
    (_, f, p), (_, g, q) = _twins(_SubclassedReLU)
    td = _inputs()
    _close(METHODS[name](f, p, td), METHODS[name](g, q, td))


def test_guided_grad_cam_on_a_cnn():
    (_, f, p), (_, g, q) = _twins(conv=True)
    td = _inputs(conv=True)
    _close(guided_grad_cam(f, p, td, target=1, layer="a"), guided_grad_cam(g, q, td, target=1, layer="a"))


@pytest.mark.parametrize("name", ("deconvolution", "guided_backprop", "deeplift", "lrp_epsilon_plus",
                                  "map_grad_at_its_input", "map_grad_at_its_output", "saliency_of_its_layer",
                                  "guided_backprop_and_its_layer"))
def test_under_vmap(name):
    (_, f, p), (_, g, q) = _twins()
    td = _inputs()
    per_sample = torch.func.vmap(lambda s: METHODS[name](f, p, s))(td)
    _close(per_sample, METHODS[name](g, q, td))


@pytest.mark.parametrize("name", ("deconvolution", "guided_backprop", "map_grad_at_its_output",
                                  "map_grad_at_both_sites_and_its_layer"))
def test_compiled(name):
    (_, f, p), (_, g, q) = _twins()
    td = _inputs()
    compiled = torch.compile(lambda p, td: METHODS[name](f, p, td), fullgraph=True, backend="eager")
    _close(compiled(p, td), METHODS[name](g, q, td))


def test_an_in_place_module_on_a_chain_keeps_the_rules_inputs():
    """A rule that runs the module again (Epsilon's definition, taken for an in-place module) gets copies."""
    def chain(inplace: bool) -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=inplace), nn.Linear(6, 3)).double()

    td = TensorDict(input=_inputs()["x"], batch_size=[5])
    maps = []
    for model in (chain(True), chain(False)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rules = {"[0]": Epsilon(), "[1]": Epsilon(), "[2]": Epsilon()}
            maps.append(lrp(functional(model), params(model), td, target=1, rules=rules))
    _close(*maps)


@pytest.mark.parametrize("name", ("deconvolution", "guided_backprop", "deeplift", "lrp_epsilon_plus",
                                  "map_grad_at_its_output"))
def test_a_module_that_says_inplace_but_writes_nothing_is_not_written_back(name):
    """Writing back after eval-mode dropout would break the ReLU's backward, which keeps ``h``."""
    torch.manual_seed(0)
    written, twin = DropoutAfterReLU(True).double().eval(), DropoutAfterReLU(False).double().eval()
    twin.load_state_dict(written.state_dict())
    td = _inputs()
    taps = {"map_grad_at_its_output": lambda f, p, td: saliency(f, p, td, target=1, taps=[
        map_grad("drop", lambda g: 2 * g.clamp(min=0))])}
    method = taps.get(name, METHODS[name])
    if name.startswith("lrp"):
        method = lambda f, p, td: lrp(f, p, td, target=1, rules=EpsilonPlus(), warn_on_missing_rule=False)
    maps = [method(functional(m, in_keys=["x"], out_keys=["y"]), params(m), td) for m in (written, twin)]
    _close(*maps)
