"""lrp on a chain (NOTE [lrp on a chain]): the module-by-module walk gives the general path's maps.

Each test computes the maps twice: as lrp does (a hook-free ``nn.Sequential`` takes the
walk; a spy checks that it did), and with the walk switched off (the taps of
NOTE [lrp as modified vjps]). Models are float64, so the two agree to a few ulps.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from _tolerance import assert_close_ulps
from tensordict import TensorDict
from torch import nn
from zoo import same, snapshot

import tdhook_fn
from tdhook_fn.attribution import (
    AlphaBeta,
    Epsilon,
    EpsilonPlus,
    Flat,
    LayerNorm,
    Pass,
    PseudoIdentity,
    SoftmaxEpsilon,
    Stop,
    UniformEpsilon,
    WSquare,
    ZPlus,
    lrp,
)
from tdhook_fn.attribution._lrp.model_chain import chain_of

lrp_module = importlib.import_module("tdhook_fn.attribution._lrp.method")
pytestmark = pytest.mark.filterwarnings("ignore:lrp. no rule:UserWarning")


class Walks:
    """What each lrp call's chain attempt returned: True for the walk, False for the general path."""

    def __init__(self) -> None:
        self.taken: list[bool] = []


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> Iterator[Walks]:
    seen = Walks()
    original = lrp_module.chain_lrp

    def spy(*args: Any) -> Any:
        result = original(*args)
        seen.taken.append(result is not None)
        return result

    monkeypatch.setattr(lrp_module, "chain_lrp", spy)
    yield seen


def general(monkeypatch: pytest.MonkeyPatch, *args: Any, **kwargs: Any) -> TensorDict:
    """lrp by the taps only."""
    with monkeypatch.context() as m:
        m.setattr(lrp_module, "chain_lrp", lambda *_a: None)
        return lrp(*args, **kwargs)


def mlp(inplace: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=inplace), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 4)).double().eval()


def cnn() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(),
                          nn.Linear(4 * 2 * 2, 3))
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    return model.double().eval()


def both(monkeypatch: pytest.MonkeyPatch, walks: Walks, model: nn.Module, x: torch.Tensor, *,
         walked: bool = True, **options: Any) -> TensorDict:
    f, p = tdhook_fn.pure(model)
    td = TensorDict(input=x, batch_size=x.shape[:1])
    before = snapshot(model)
    walks.taken.clear()
    ours = lrp(f, p, td, **options)
    assert walks.taken in (([True],) if walked else ([], [False]))
    assert_close_ulps(ours, general(monkeypatch, f, p, td, **options), ulps=64)
    assert same(snapshot(model), before)
    return ours


MLP_RULES: list[Any] = [
    EpsilonPlus(),
    {nn.Linear: Epsilon(1e-9), nn.ReLU: Pass(), nn.Tanh: Pass()},
    {nn.Linear: UniformEpsilon(), nn.ReLU: PseudoIdentity(), nn.Tanh: PseudoIdentity()},
    {"0": WSquare(), "2": AlphaBeta(2.0, 1.0), "4": ZPlus(), nn.ReLU: Pass(), nn.Tanh: Pass()},
    {"0": Flat(), nn.Linear: Epsilon()},  # no rule on the activations: their plain gradient
]


@pytest.mark.parametrize("rules", MLP_RULES, ids=["epsilon-plus", "lrp0", "uniform-pseudo", "w2-ab-z+", "flat"])
def test_mlp_rules(monkeypatch: pytest.MonkeyPatch, walks: Walks, rules: Any) -> None:
    x = torch.randn(5, 6, dtype=torch.float64)
    relevance = both(monkeypatch, walks, mlp(), x, target=1, rules=rules)
    assert relevance["input"].shape == (5, 6) and relevance["input"].abs().sum() > 0


@pytest.mark.parametrize("rules", [EpsilonPlus(), {nn.Conv2d: AlphaBeta(), nn.BatchNorm2d: Pass(), nn.ReLU: Pass(),
                                                   nn.AvgPool2d: Epsilon(), nn.Linear: Epsilon()}],
                         ids=["epsilon-plus", "alpha-beta"])
def test_cnn_with_batch_norm_and_pooling(monkeypatch: pytest.MonkeyPatch, walks: Walks, rules: Any) -> None:
    both(monkeypatch, walks, cnn(), torch.randn(3, 2, 8, 8, dtype=torch.float64), target=2, rules=rules)


@pytest.mark.parametrize("options", [
    {"target": (0, 2), "per_target": True},
    {"target": (0, 2)},
    {"target": 1, "cotangents": lambda values: values.apply(lambda v: 2.0 * torch.ones_like(v))},
    {"target": torch.tensor([0, 3, 1, 1, 2])},
    {"target": lambda td: td["output"][..., :2].sum(-1)},
], ids=["per-target", "summed", "cotangents", "per-sample-classes", "callable"])
def test_targets(monkeypatch: pytest.MonkeyPatch, walks: Walks, options: dict[str, Any]) -> None:
    both(monkeypatch, walks, mlp(), torch.randn(5, 6, dtype=torch.float64), rules=EpsilonPlus(),
         walked=not options.get("per_target"), **options)  # per_target: the taps (one pullback per target)


@pytest.mark.parametrize("batch", [(), (2, 3)])
def test_batch_shapes(monkeypatch: pytest.MonkeyPatch, walks: Walks, batch: tuple[int, ...]) -> None:
    f, p = tdhook_fn.pure(mlp())
    td = TensorDict(input=torch.randn(*batch, 6, dtype=torch.float64), batch_size=batch)
    ours = lrp(f, p, td, target=1, rules=EpsilonPlus(), per_target=False)
    assert walks.taken[-1] and ours.batch_size == batch and ours["input"].shape == (*batch, 6)
    assert_close_ulps(ours, general(monkeypatch, f, p, td, target=1, rules=EpsilonPlus()), ulps=64)


def test_nested_sequentials_and_a_rule_on_a_container(monkeypatch: pytest.MonkeyPatch, walks: Walks) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(6, 8), nn.ReLU()), nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
                          nn.Linear(8, 3)).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    both(monkeypatch, walks, model, x, target=0, rules={nn.Linear: Epsilon(), nn.ReLU: Pass()})
    both(monkeypatch, walks, model, x, target=0, rules={"0": Epsilon(), "1": PseudoIdentity(), "2": Epsilon()})


def test_in_place_activations_get_copies(monkeypatch: pytest.MonkeyPatch, walks: Walks) -> None:
    x = torch.randn(5, 6, dtype=torch.float64)
    for rules in ({nn.Linear: Epsilon(), nn.ReLU: Pass()}, {nn.Linear: Epsilon(), nn.ReLU: PseudoIdentity()},
                  {nn.Linear: AlphaBeta()}):
        in_place = both(monkeypatch, walks, mlp(inplace=True), x, target=1, rules=rules)
        assert_close_ulps(in_place, both(monkeypatch, walks, mlp(), x, target=1, rules=rules), ulps=64)


class WritesItsInput(nn.Module):
    """Adds one to its input in place, without an ``inplace`` attribute to say so."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(1.0)


def test_a_later_unannounced_in_place_write_sends_the_call_to_the_general_path(
        monkeypatch: pytest.MonkeyPatch, walks: Walks) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Softmax(-1), WritesItsInput(), nn.Linear(8, 3)).double()
    both(monkeypatch, walks, model, torch.randn(4, 6, dtype=torch.float64), walked=False, target=0,
         rules={nn.Linear: Epsilon(), nn.Softmax: SoftmaxEpsilon()})


def test_stop_and_layer_norm(monkeypatch: pytest.MonkeyPatch, walks: Walks) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    both(monkeypatch, walks, model, x, target=0, rules={nn.Linear: Epsilon(), nn.LayerNorm: LayerNorm()})
    stopped = both(monkeypatch, walks, model, x, target=0, rules={nn.Linear: Epsilon(), "3": Stop()})
    assert bool((stopped["input"] == 0).all())


@pytest.mark.parametrize("change", ["forward hook", "pre hook on a child", "global hook", "own forward", "taps",
                                    "layers"])
def test_what_the_walk_leaves_to_the_general_path(monkeypatch: pytest.MonkeyPatch, walks: Walks,
                                                  change: str) -> None:
    model = mlp()
    options: dict[str, Any] = {}
    handle = None
    if change == "forward hook":
        model.register_forward_hook(lambda _m, _a, out: out * 2.0)
    elif change == "pre hook on a child":
        model[2].register_forward_pre_hook(lambda _m, args: (args[0] + 1.0,))
    elif change == "global hook":
        handle = nn.modules.module.register_module_forward_hook(lambda _m, _a, out: None)
    elif change == "own forward":
        class Doubling(nn.Sequential):
            def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
                return 2.0 * super().forward(x)

        model = Doubling(*mlp())
    elif change == "taps":
        options["taps"] = [tdhook_fn.intervene("[1]", lambda t: 0.5 * t)]
    else:
        options["layers"] = ["[1]"]
    try:
        f, p = tdhook_fn.pure(model)
        td = TensorDict(input=torch.randn(5, 6, dtype=torch.float64), batch_size=[5])
        ours = lrp(f, p, td, target=1, rules=EpsilonPlus(), **options)
        assert walks.taken in ([], [False])
        assert_close_ulps(ours, general(monkeypatch, f, p, td, target=1, rules=EpsilonPlus(), **options), ulps=0)
    finally:
        if handle is not None:
            handle.remove()


def test_errors_are_the_general_paths(monkeypatch: pytest.MonkeyPatch, walks: Walks) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Flatten(0), nn.Linear(40, 3)).double()
    f, p = tdhook_fn.pure(model)
    td = TensorDict(input=torch.randn(5, 6, dtype=torch.float64), batch_size=[5])
    with pytest.raises(ValueError, match=r"Pass at '1' needs one input of the output's shape") as walked:
        lrp(f, p, td, target=0, rules={nn.Linear: Epsilon(), nn.Flatten: Pass()})
    with pytest.raises(ValueError, match=r"Pass at '1' needs one input of the output's shape") as tapped:
        general(monkeypatch, f, p, td, target=0, rules={nn.Linear: Epsilon(), nn.Flatten: Pass()})
    assert str(walked.value) == str(tapped.value)


def test_chains_are_hook_free_sequentials_with_one_positional_input_and_one_output() -> None:
    assert [name for name, _ in chain_of(tdhook_fn.functional(mlp())) or []] == ["0", "1", "2", "3", "4"]
    assert chain_of(tdhook_fn.functional(mlp(), in_keys={"input": "input"})) is None
    assert chain_of(tdhook_fn.functional(mlp(), out_keys=["a", "b"])) is None
    assert chain_of(tdhook_fn.functional(mlp()).with_taps(tdhook_fn.capture("[0]"))) is None


class Block(nn.Module):
    """A residual block: not a Sequential, so the walk cannot see inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act = nn.Linear(6, 6), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x)) + x


@pytest.mark.parametrize("rules", [EpsilonPlus(), {nn.Linear: Epsilon(), "0.act": Stop()}])
def test_rules_inside_a_block_send_the_call_to_the_general_path(monkeypatch: pytest.MonkeyPatch, walks: Walks,
                                                                 rules: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Linear(6, 3)).double()
    both(monkeypatch, walks, model, torch.randn(4, 6, dtype=torch.float64), walked=False, target=1, rules=rules)


@pytest.mark.parametrize("rules", [{nn.Linear: Epsilon(), nn.Tanh: Pass()}, {nn.Linear: AlphaBeta(), nn.Tanh: Stop()},
                                   {nn.Linear: Epsilon(), nn.Tanh: PseudoIdentity()}])
def test_a_module_run_twice_has_its_rule_both_times(monkeypatch: pytest.MonkeyPatch, walks: Walks,
                                                    rules: Any) -> None:
    torch.manual_seed(0)
    act, shared = nn.Tanh(), nn.Linear(8, 8)
    model = nn.Sequential(nn.Linear(6, 8), act, shared, act, shared, nn.Linear(8, 3)).double()
    both(monkeypatch, walks, model, torch.randn(4, 6, dtype=torch.float64), target=1, rules=rules)


class Clamps(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp_(min=0)


class Doubles(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2.0)


@pytest.mark.parametrize("rule", [Pass(), PseudoIdentity(), Stop(), Epsilon()])
def test_an_unannounced_in_place_write_never_reaches_the_callers_input(monkeypatch: pytest.MonkeyPatch, walks: Walks,
                                                                       rule: Any) -> None:
    model = nn.Sequential(Clamps(), nn.Linear(4, 2)).double()
    f, p = tdhook_fn.pure(model)
    x = torch.randn(3, 4, dtype=torch.float64)
    original = x.clone()
    td, rules = TensorDict(input=x, batch_size=[3]), {"0": rule, nn.Linear: Epsilon()}
    if isinstance(rule, Epsilon):  # the taps scale the input first: the module writes that copy
        assert_close_ulps(lrp(f, p, td, target=0, rules=rules), general(monkeypatch, f, p, td, target=0, rules=rules),
                          ulps=0)
    else:  # the taps' graph refuses the write to its leaf
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad is being used in an in-place"):
            lrp(f, p, td, target=0, rules=rules)
    assert walks.taken == [False] and torch.equal(x, original)


def test_a_write_to_a_passed_output_sends_the_call_to_the_general_path(monkeypatch: pytest.MonkeyPatch,
                                                                        walks: Walks) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), Doubles(), nn.Linear(8, 3)).double()
    both(monkeypatch, walks, model, torch.randn(4, 6, dtype=torch.float64), walked=False, target=0,
         rules={nn.Linear: Epsilon(), nn.Tanh: Pass(), "2": Pass()})


@pytest.mark.filterwarnings("ignore:lrp. modules .'1'. apply dropout:RuntimeWarning")
def test_a_walk_given_up_leaves_the_random_state_as_it_found_it(monkeypatch: pytest.MonkeyPatch,
                                                                walks: Walks) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Softmax(-1), WritesItsInput(),
                          nn.Linear(8, 3)).double().train()
    f, p = tdhook_fn.pure(model)
    td = TensorDict(input=torch.randn(4, 6, dtype=torch.float64), batch_size=[4])
    rules = {nn.Linear: Epsilon(), nn.Softmax: SoftmaxEpsilon()}
    results = []
    for run in (lambda: lrp(f, p, td, target=0, rules=rules), lambda: general(monkeypatch, f, p, td, target=0,
                                                                               rules=rules)):
        torch.manual_seed(1)
        results.append((run()["input"], torch.rand(3)))
    assert walks.taken == [False]
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_a_rule_on_the_root_takes_the_general_path(monkeypatch: pytest.MonkeyPatch, walks: Walks) -> None:
    x = torch.randn(4, 6, dtype=torch.float64)
    whole = both(monkeypatch, walks, mlp(), x, walked=False, target=0, rules={"": Epsilon()})
    f, p = tdhook_fn.pure(mlp())  # epsilon on the whole model: x * gradient / (f(x) + eps sign f(x))
    xs = x.clone().requires_grad_()
    out = tdhook_fn.call(mlp(), p, xs)[..., 0]
    (grad,) = torch.autograd.grad(out.sum(), xs)
    torch.testing.assert_close(whole["input"], x * grad / (out.detach() + 1e-6 * torch.sign(out.detach()))[:, None])


def _shadows(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each walk borrowed a shadow (NOTE [walks without a shadow])."""
    chain_module = importlib.import_module("tdhook_fn.attribution._lrp.chain")
    borrowed: list[bool] = []
    original = chain_module.run_chain
    monkeypatch.setattr(chain_module, "run_chain", lambda *a: borrowed.append(True) or original(*a))
    return borrowed


def test_a_walk_without_a_shadow_computes_with_the_params_not_the_models_tensors(
        monkeypatch: pytest.MonkeyPatch, walks: Walks) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(12, 4), nn.Tanh(), nn.Linear(4, 3)).double().eval()
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    f = tdhook_fn.functional(model)
    other = tdhook_fn.params(model).apply(lambda t: t * -1.5)  # not the model's numbers
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(-1.5)
    borrowed = _shadows(monkeypatch)
    td = TensorDict(input=x, batch_size=[3])
    before = snapshot(model)
    ours = lrp(f, other, td, target=2, rules=EpsilonPlus())
    assert walks.taken == [True] and borrowed == []
    assert same(snapshot(model), before)
    f_twin, p_twin = tdhook_fn.pure(twin)
    assert_close_ulps(ours, general(monkeypatch, f_twin, p_twin, td, target=2, rules=EpsilonPlus()), ulps=64)


@pytest.mark.parametrize("change", ["prelu", "buffer", "container parameter", "module twice", "batch norm"])
def test_what_needs_the_shadow_gets_it(monkeypatch: pytest.MonkeyPatch, walks: Walks, change: str) -> None:
    """Modules holding tensors the walk does not compute from, and layouts it does not map, borrow the shadow."""
    torch.manual_seed(0)
    linear = nn.Linear(6, 6)
    layers: list[nn.Module] = [nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3)]
    if change == "prelu":
        layers[1] = nn.PReLU()
    elif change == "batch norm":
        layers[1] = nn.BatchNorm1d(6)
    elif change == "module twice":
        layers = [linear, nn.ReLU(), linear, nn.Linear(6, 3)]
    model = nn.Sequential(*layers).double().eval()
    if change == "buffer":
        model[0].register_buffer("scale", torch.ones(6, dtype=torch.float64))
    elif change == "container parameter":
        model.register_parameter("extra", nn.Parameter(torch.ones(2, dtype=torch.float64)))
    f = tdhook_fn.functional(model)
    other = tdhook_fn.params(model).apply(lambda t: t * 1.5 if t.is_floating_point() else t)  # (not the model's)
    borrowed = _shadows(monkeypatch)
    td = TensorDict(input=torch.randn(4, 6, dtype=torch.float64), batch_size=[4])
    rules = {nn.Linear: Epsilon(), nn.ReLU: Pass(), nn.PReLU: Pass(), nn.BatchNorm1d: Pass()}
    ours = lrp(f, other, td, target=1, rules=rules)
    assert walks.taken == [True] and borrowed == [True]
    assert_close_ulps(ours, general(monkeypatch, f, other, td, target=1, rules=rules), ulps=64)


@pytest.mark.parametrize("change", ["missing", "unexpected", "shape"])
def test_params_that_do_not_fit_are_named_as_without_the_walk(monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    f, p = tdhook_fn.pure(model)
    if change == "missing":
        p = p.exclude(("2", "bias"))
    elif change == "unexpected":
        p = p.clone()
        p["extra"] = torch.zeros(2, dtype=torch.float64)
    else:
        p = p.clone()
        p["0", "weight"] = torch.zeros(8, 5, dtype=torch.float64)
    td = TensorDict(input=torch.randn(4, 6, dtype=torch.float64), batch_size=[4])
    with pytest.raises(ValueError, match="params do not match the model") as walked:
        lrp(f, p, td, target=0, rules=EpsilonPlus())
    with pytest.raises(ValueError, match="params do not match the model") as tapped:
        general(monkeypatch, f, p, td, target=0, rules=EpsilonPlus())
    assert str(walked.value) == str(tapped.value)


def test_an_output_without_the_batch_on_the_shadow_takes_the_general_path(monkeypatch: pytest.MonkeyPatch,
                                                                          walks: Walks) -> None:
    """A batch of one flattened whole (Flatten(0)) with a module of unknown backward (Softmax: the shadow)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(0), nn.Linear(12, 3), nn.Softmax(-1)).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    f, p = tdhook_fn.pure(model)
    td = TensorDict(input=x, batch_size=[])
    ours = lrp(f, p, td, target=0, rules={nn.Linear: Epsilon()}, warn_on_missing_rule=False)
    assert walks.taken == [False]
    assert_close_ulps(ours, general(monkeypatch, f, p, td, target=0, rules={nn.Linear: Epsilon()},
                                    warn_on_missing_rule=False), ulps=4)


def test_an_epsilon_with_its_own_output_factor_keeps_it_on_the_walk(monkeypatch: pytest.MonkeyPatch,
                                                                     walks: Walks) -> None:
    @dataclass(frozen=True)
    class HalfEpsilon(Epsilon):
        def output_factor(self, path: str, n_inputs: int, output: torch.Tensor) -> torch.Tensor:
            return 0.5 * super().output_factor(path, n_inputs, output)

    x = torch.randn(5, 6, dtype=torch.float64)
    rules = {nn.Linear: HalfEpsilon(), nn.ReLU: Pass(), nn.Tanh: Pass()}
    both(monkeypatch, walks, mlp(), x, target=1, rules=rules)


@pytest.mark.parametrize("rule", [ZPlus(), AlphaBeta(2.0, 1.0)])
def test_alpha_beta_on_a_grouped_convolution_without_a_shadow_is_the_rules(monkeypatch: pytest.MonkeyPatch,
                                                                         walks: Walks, rule: AlphaBeta) -> None:
    """Stacked channels would cross groups: the rule's own step (the planned walk ran it as no rule before)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, groups=2), nn.ReLU(), nn.Flatten(),
                          nn.Linear(64, 3)).double().eval()
    borrowed = _shadows(monkeypatch)
    both(monkeypatch, walks, model, torch.randn(2, 4, 4, 4, dtype=torch.float64), target=1,
         rules={"0": rule, nn.ReLU: Pass(), nn.Linear: Epsilon()})
    assert borrowed == []


def test_a_nested_input_key_on_the_walk(monkeypatch: pytest.MonkeyPatch, walks: Walks) -> None:
    # the walk's maps under a nested key ("a", "b"): the same TensorDict as the general path's
    model = mlp()
    f, p = tdhook_fn.functional(model, in_keys=[("a", "b")], out_keys=["output"]), tdhook_fn.params(model)
    td = TensorDict({"a": {"b": torch.randn(5, 6, dtype=torch.float64)}}, batch_size=[5])
    ours = lrp(f, p, td, target=1, rules=EpsilonPlus())
    assert walks.taken == [True]
    assert_close_ulps(ours, general(monkeypatch, f, p, td, target=1, rules=EpsilonPlus()), ulps=64)
