"""The layer pullbacks' forward (conductance, internal influence, layer IG on the inputs' path): random draws."""

import copy

import pytest
import torch
from _tolerance import assert_close_ulps
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import integrated_gradients
from tdhook_fn.attribution._internal_influence import internal_influence
from tdhook_fn.attribution._layer_conductance import layer_conductance
from tdhook_fn.attribution._neuron_conductance import neuron_conductance


class Jitter(nn.Module):
    """Adds uniform noise from torch's global generator: a forward that draws at random."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.5 * torch.rand_like(x)


def _models(draw: nn.Module) -> tuple[nn.Module, nn.Module]:
    """One model whose ReLU writes the attributed layer's output in place, and a copy whose ReLU does not."""
    torch.manual_seed(0)
    writing = nn.Sequential(nn.Linear(4, 6), draw, nn.Linear(6, 6), nn.ReLU(inplace=True), nn.Linear(6, 3))
    plain = copy.deepcopy(writing)
    plain[3] = nn.ReLU()
    return writing, plain


def _call(method: str, model: nn.Module, td: TensorDict) -> torch.Tensor:
    f, p = tdhook_fn.pure(model)
    if method == "layer_conductance":
        return layer_conductance(f, p, td, target=1, layers=["[2]"], n_steps=6)["[2]"]
    if method == "internal_influence":
        return internal_influence(f, p, td, target=1, layers=["[2]"], n_steps=6)["[2]"]
    if method == "layer_integrated_gradients":
        return integrated_gradients(f, p, td, 0.0, target=1, layers=["[2]"], interpolate="inputs", n_steps=6,
                                    use_inputs=False)["[2]"]
    return neuron_conductance(f, p, td, target=1, layer="[2]", neuron_selector=(2,), n_steps=6)["input"]


@pytest.mark.filterwarnings("ignore:.*apply dropout in training mode:RuntimeWarning")
@pytest.mark.parametrize("draw", [Jitter(), nn.Dropout(0.3).train()], ids=["rand", "dropout"])
@pytest.mark.parametrize("method", ["layer_conductance", "neuron_conductance", "internal_influence",
                                    "layer_integrated_gradients"])
def test_a_forward_run_again_after_an_in_place_write_draws_as_the_first_did(method, draw):
    """Where a later module writes the attributed activation in place, the forward runs again with copies
    (NOTE [activations read without a copy]); the second run draws the same numbers as the first, and torch's random
    state advances as for one forward: the maps and the caller's next draw equal those of a model without the
    write."""
    writing, plain = _models(draw)
    td = TensorDict(input=torch.randn(5, 4), batch_size=[5])
    maps, after = [], []
    for model in (writing, plain):
        _call(method, model, td)  # (warm-up: remembered layer specs, warnings)
        torch.manual_seed(1)
        maps.append(_call(method, model, td))
        after.append(torch.rand(3))
    assert_close_ulps(maps[0], maps[1])
    assert torch.equal(after[0], after[1])
    assert bool(maps[0].abs().sum() > 0)


def test_a_forward_redone_under_func_vjp_draws_as_the_first_did():
    """A target closing over a tensor that requires grad sends the pullbacks to `torch.func.vjp`, which runs the
    forward again (NOTE [eager vjp]): it draws what the first run drew, and the generator advances once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), Jitter(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    f, p = tdhook_fn.pure(model)
    td = TensorDict(input=torch.randn(5, 4), batch_size=[5])
    weights = torch.tensor([0.5, -1.0, 2.0])
    maps, after = [], []
    for w in (weights.clone().requires_grad_(), weights):
        target = lambda out, w=w: out["output"] @ w
        internal_influence(f, p, td, target=target, layers=["[2]"], n_steps=6)  # (warm-up)
        torch.manual_seed(1)
        maps.append(internal_influence(f, p, td, target=target, layers=["[2]"], n_steps=6)["[2]"].detach())
        after.append(torch.rand(3))
    assert_close_ulps(maps[0], maps[1])
    assert torch.equal(after[0], after[1])


class Tile(nn.Module):
    """``x`` repeated ``r`` times along its last dim (``r`` may change between calls: a remembered spec is stale)."""

    def __init__(self, r: int) -> None:
        super().__init__()
        self.r = r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(1, self.r)


class FoldMean(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], -1, 6).mean(1)


@pytest.mark.parametrize("method", ["layer_conductance", "internal_influence", "layer_integrated_gradients"])
def test_a_call_made_again_after_a_stale_layer_spec_draws_as_the_first_try_did(method):
    """A remembered layer spec the call contradicts (the model changed) makes the call again with a fresh probe
    (NOTE [remembered layer specs]); the first try's draws are replayed, as if the call had run once."""
    def model(r: int) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), Jitter(), Tile(r), FoldMean(), nn.Linear(6, 3))

    td = TensorDict(input=torch.randn(5, 4), batch_size=[5])
    changed, fresh = model(1), model(2)
    maps, after = [], []
    for net in (changed, fresh):
        f, p = tdhook_fn.pure(net)
        if method == "layer_conductance":
            run = lambda: layer_conductance(f, p, td, target=1, layers=["[2]"], n_steps=6)["[2]"]
        elif method == "internal_influence":
            run = lambda: internal_influence(f, p, td, target=1, layers=["[2]"], n_steps=6)["[2]"]
        else:
            run = lambda: integrated_gradients(f, p, td, 0.0, target=1, layers=["[2]"], n_steps=6,
                                               interpolate="inputs", use_inputs=False)["[2]"]
        run()  # (remembers the spec of r=1 for `changed`, of r=2 for `fresh`)
        net[2].r = 2
        torch.manual_seed(1)
        maps.append(run())
        after.append(torch.rand(3))
    assert maps[0].shape == (5, 12)
    assert_close_ulps(maps[0], maps[1])
    assert torch.equal(after[0], after[1])


def _both_targets(td: TensorDict) -> torch.Tensor:
    """Two targets: a class of the output and a unit of the target layer ``[3]``."""
    return torch.stack([td["output"][..., 1], td["[3]"][..., 0]], -1)


@pytest.mark.parametrize("use_inputs", [True, False])
@pytest.mark.parametrize("option", ["plain", "per_target", "cotangents", "target_layers", "grad_fns", "chunks"])
def test_layer_ig_on_the_inputs_path_equals_the_engines_gradients_summed_along_the_path(option, use_inputs):
    """Layer integrated gradients with ``interpolate="inputs"`` runs on the layer pullbacks; with every option it
    equals the engine's gradients at the same path points, weighted by the quadrature (the mechanism it had)."""
    from tdhook_fn.attribution._baselines import path_points, quadrature
    from tdhook_fn.attribution._engine import grad_taps, gradients

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).eval()
    f, p = tdhook_fn.pure(model)
    td = TensorDict(input=torch.randn(3, 4), batch_size=[3])
    base = TensorDict(input=0.1 * torch.randn(3, 4), batch_size=[3])
    kwargs: dict = dict(target=(1, 2))
    if option == "per_target":
        kwargs["per_target"] = True
    elif option == "cotangents":
        kwargs["cotangents"] = lambda values: values.apply(lambda v: torch.linspace(0.5, 2.0, v.numel()).reshape(
            v.shape))
    elif option == "target_layers":
        kwargs.update(target=_both_targets, target_layers=["[3]"], per_target=True)
    elif option == "grad_fns":
        kwargs["grad_fns"] = {"[2]": lambda g: 2.0 * g}
    n_steps = 7
    ours = integrated_gradients(f, p, td, base, layers=["[1]"], interpolate="inputs", n_steps=n_steps,
                                use_inputs=use_inputs, chunk_size=3 if option == "chunks" else None, **kwargs)
    alphas, weights = quadrature("gausslegendre", n_steps)
    points = path_points(td, base, ["input"], alphas)
    engine = dict(kwargs)
    taps = grad_taps(engine.pop("grad_fns", None), ())
    grads = gradients(f, p, points, engine.pop("target"), input_keys=("input",) if use_inputs else (),
                      layers={"[1]": None}, taps=taps, **engine).grads
    lead = 1 if kwargs.get("per_target") else 0
    keys = ["[1]", "input"] if use_inputs else ["[1]"]
    assert sorted(ours.keys()) == sorted(keys)
    for key in keys:
        g = grads[key]
        expected = sum(w * g.select(lead, k) for k, w in enumerate(weights))
        if key == "input":
            expected = expected * (td["input"] - base["input"])
        assert_close_ulps(ours[key], expected, ulps=16)
