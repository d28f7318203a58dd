"""tdhook_fn.compat.attribution.LRP side by side with tdhook 0.1.3's LRP: an MLP and a CNN.

Both sides run the same options on copies of one model; every rule class of
``lrp_helpers.rules``, EpsilonPlus, ``input_modules``, ``target_modules``,
``init_attr_targets``, ``init_attr_grads``, ``Sum``, float32 and float64.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import tdhook.attribution as ref_attr
import torch
from tdhook.attribution.lrp_helpers import layers as ref_layers
from tdhook.attribution.lrp_helpers import rules as ref_rules
from tensordict import TensorDict
from torch import nn

import tdhook_fn.compat.attribution as our_attr
from tdhook_fn.compat.attribution.lrp_helpers import layers as our_layers
from tdhook_fn.compat.attribution.lrp_helpers import rules as our_rules

# tdhook rounds its epsilons to float32 (NOTE in tests/attribution/test_lrp_tdhook.py): the
# float64 cases use epsilons exact in float32 and compare tightly.
EPS = 2.0**-20
TOL = {torch.float64: {"rtol": 1e-9, "atol": 1e-11}, torch.float32: {"rtol": 1e-4, "atol": 1e-6}}


def mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype).eval()


def cnn(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 5, 3), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(5, 3),
    ).to(dtype)
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    return model.eval()


MODELS = {"mlp": (mlp, (5,), "[2]"), "cnn": (cnn, (2, 10, 10), "[4]")}


def data(name: str, dtype: torch.dtype, batch: int = 4) -> TensorDict:
    torch.manual_seed(2)
    return TensorDict(input=torch.randn(batch, *MODELS[name][1], dtype=dtype), batch_size=[batch])


def run(lib: Any, make: Callable[[Any], Any], model: nn.Module, td: TensorDict) -> tuple[TensorDict, list[str]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with make(lib).prepare(copy.deepcopy(model)) as hooked:
            out = hooked(td.clone())
    return out, [str(w.message) for w in seen if "No rule found" in str(w.message)]


def compare(make: Callable[[Any], Any], name: str, dtype: torch.dtype, keys: tuple[Any, ...] = ("input",),
            ) -> TensorDict:
    model, td = MODELS[name][0](dtype), data(name, dtype)
    theirs, their_warnings = run(ref_attr, make, model, td)
    ours, our_warnings = run(our_attr, make, model, td)
    assert our_warnings == their_warnings
    assert set(ours.keys(True, True)) == set(theirs.keys(True, True))
    for key in keys:
        expected, actual = theirs["attr", key], ours["attr", key]
        assert actual.abs().sum() > 0
        torch.testing.assert_close(actual, expected, **TOL[dtype])
    return ours


def lib_rules(lib: Any) -> Any:
    return ref_rules if lib is ref_attr else our_rules


def epsilon_plus(lib: Any, dtype: torch.dtype, **kwargs: Any) -> Any:
    eps = {} if dtype == torch.float32 else {"epsilon": EPS, "stabilizer": EPS}
    return lib_rules(lib).EpsilonPlus(**eps, **kwargs)


def target(index: int) -> Callable[[TensorDict, TensorDict], TensorDict]:
    return lambda t, _: TensorDict(o=t["output"][..., index], batch_size=t.batch_size)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(MODELS))
def test_epsilon_plus(name: str, dtype: torch.dtype) -> None:
    compare(lambda lib: lib.LRP(rule_mapper=epsilon_plus(lib, dtype)), name, dtype)
    compare(lambda lib: lib.LRP(rule_mapper=epsilon_plus(lib, dtype), skip_modules=lib.LRP.default_skip), name, dtype)
    for index in (0, 2):
        compare(lambda lib, i=index: lib.LRP(rule_mapper=epsilon_plus(lib, dtype), init_attr_targets=target(i)),
                name, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(MODELS))
def test_input_modules_and_init_attr_grads(name: str, dtype: torch.dtype) -> None:
    layer = MODELS[name][2]
    compare(lambda lib: lib.LRP(rule_mapper=epsilon_plus(lib, dtype), input_modules=[layer]), name, dtype,
            ("input", layer))
    grads = lambda t, _: TensorDict(output=torch.linspace(0.5, 2.0, 3, dtype=dtype).expand_as(t["output"]),
                                    batch_size=t.batch_size)
    compare(lambda lib: lib.LRP(rule_mapper=epsilon_plus(lib, dtype), init_attr_grads=grads), name, dtype)


def test_attribution_key() -> None:
    model, td = mlp(torch.float32), data("mlp", torch.float32)
    theirs, _ = run(ref_attr, lambda lib: lib.LRP(rule_mapper=epsilon_plus(lib, torch.float32),
                                                  attribution_key=("lrp", "r")), model, td)
    ours, _ = run(our_attr, lambda lib: lib.LRP(rule_mapper=epsilon_plus(lib, torch.float32),
                                                attribution_key=("lrp", "r")), model, td)
    torch.testing.assert_close(ours["lrp", "r", "input"], theirs["lrp", "r", "input"], **TOL[torch.float32])


@pytest.mark.parametrize("name", list(MODELS))
def test_target_modules(name: str) -> None:
    """The relevance of the inputs for a hidden module's output (the targets seen under its path)."""
    dtype, layer = torch.float64, MODELS[name][2]
    pick = lambda t, _: TensorDict(h=t[layer].flatten(1)[..., 1], batch_size=t.batch_size)
    make = lambda lib: lib.LRP(rule_mapper=epsilon_plus(lib, dtype), target_modules=[layer], use_outputs=False,
                               init_attr_targets=pick)
    compare(make, name, dtype)


@pytest.mark.parametrize("name", list(MODELS))
def test_targets_from_labels(name: str) -> None:
    """``init_attr_targets`` choosing each sample's class from an ``additional_init_keys`` entry."""
    dtype = torch.float64
    td = data(name, dtype)
    td["label"] = torch.tensor([0, 2, 1, 2])
    by_label = lambda t, extra: TensorDict(o=t["output"].gather(-1, extra["label"][:, None])[:, 0],
                                           batch_size=t.batch_size)
    make = lambda lib: lib.LRP(rule_mapper=epsilon_plus(lib, dtype), init_attr_targets=by_label,
                               additional_init_keys=["label"])
    model = MODELS[name][0](dtype)
    theirs, ours = run(ref_attr, make, model, td)[0], run(our_attr, make, model, td)[0]
    torch.testing.assert_close(ours["attr", "input"], theirs["attr", "input"], **TOL[dtype])


# (our class name, constructor arguments, module class, child index or None)
RULES: list[tuple[str, tuple[Any, ...], type[nn.Module], int | None, str]] = [
    ("EpsilonRule", (), nn.Linear, None, "mlp"),
    ("EpsilonRule", (0.125,), nn.Linear, None, "mlp"),
    ("EpsilonRule", (2.0**-7,), nn.Conv2d, None, "cnn"),
    ("UniformEpsilonRule", (2.0**-7,), nn.Linear, None, "mlp"),
    ("AlphaBetaRule", (), nn.Linear, None, "mlp"),
    ("AlphaBetaRule", (1.0, 0.0), nn.Conv2d, None, "cnn"),
    ("AlphaBetaRule", (2.0, 1.0, 2.0**-10), nn.Conv2d, None, "cnn"),
    ("FlatRule", (), nn.Linear, 0, "mlp"),
    ("FlatRule", (), nn.Conv2d, 0, "cnn"),
    ("WSquareRule", (), nn.Linear, 0, "mlp"),
    ("WSquareRule", (2.0**-10,), nn.Conv2d, 0, "cnn"),
    ("PassRule", (), nn.Tanh, None, "mlp"),
    ("PseudoIdentityRule", (), nn.Tanh, None, "mlp"),
    ("UniformRule", (), nn.Tanh, None, "mlp"),
    ("StopRule", (), nn.Tanh, None, "mlp"),
    ("IgnoreRule", (), nn.Linear, 2, "mlp"),
    ("AHQKVRule", (), nn.Linear, 2, "mlp"),
]


def at(cls: type[nn.Module], rule: Any, index: int | None) -> Callable[[str, nn.Module], Any]:
    return lambda name, m: rule if isinstance(m, cls) and (index is None or name == f"module.{index}") else None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("rule", "args", "cls", "index", "name"), RULES,
                         ids=[f"{r[0]}{r[1]}-{r[4]}" for r in RULES])
def test_rule_classes(rule: str, args: tuple[Any, ...], cls: type[nn.Module], index: int | None, name: str,
                      dtype: torch.dtype) -> None:
    """Each tdhook rule class at its modules (by tdhook's names), EpsilonPlus elsewhere."""
    make = lambda lib: lib.LRP(rule_mapper=epsilon_plus(lib, dtype, rule_mapper=at(
        cls, getattr(lib_rules(lib), rule)(*args), index)))
    if rule == "StopRule":  # nothing reaches the input: zeros on both sides
        model, td = MODELS[name][0](dtype), data(name, dtype)
        theirs, ours = run(ref_attr, make, model, td)[0], run(our_attr, make, model, td)[0]
        assert not ours["attr", "input"].any()
        torch.testing.assert_close(ours["attr", "input"], theirs["attr", "input"], **TOL[dtype])
        return
    compare(make, name, dtype)


def test_softmax_and_layer_norm_rule_classes() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.Linear(6, 4), nn.Softmax(-1)).double().eval()
    td = TensorDict(input=torch.randn(3, 5, dtype=torch.float64), batch_size=[3])

    def make(lib: Any) -> Any:
        r = lib_rules(lib)
        table = {nn.LayerNorm: r.LayerNormRule(), nn.Softmax: r.SoftmaxEpsilonRule()}
        return lib.LRP(rule_mapper=r.EpsilonPlus(EPS, EPS, rule_mapper=lambda n, m: table.get(type(m))),
                       init_attr_targets=target(1))

    theirs, _ = run(ref_attr, make, model, td)
    ours, _ = run(our_attr, make, model, td)
    torch.testing.assert_close(ours["attr", "input"], theirs["attr", "input"], **TOL[torch.float64])


def test_sum_layer() -> None:
    """EpsilonPlus gives ``Sum`` the epsilon rule with its stabilizer, as tdhook."""
    torch.manual_seed(4)

    def model(layers: Any) -> nn.Module:
        torch.manual_seed(4)
        return nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Unflatten(-1, (3, 2)), layers.Sum(-1)).double().eval()

    td = TensorDict(input=torch.randn(4, 5, dtype=torch.float64), batch_size=[4])
    make = lambda lib: lib.LRP(rule_mapper=lib_rules(lib).EpsilonPlus(EPS, 2.0**-4), warn_on_missing_rule=False)
    theirs, _ = run(ref_attr, make, model(ref_layers), td)
    ours, _ = run(our_attr, make, model(our_layers), td)
    torch.testing.assert_close(ours["attr", "input"], theirs["attr", "input"], **TOL[torch.float64])
    assert our_layers.Sum()(torch.ones(2, 3)).tolist() == [3.0, 3.0]


def test_tdhook_fn_rules_from_the_mapper() -> None:
    """A rule mapper may return tdhook_fn rules: the same numbers as the tdhook classes."""
    from tdhook_fn.attribution import Epsilon

    dtype = torch.float64
    model, td = mlp(dtype), data("mlp", dtype)
    ours, _ = run(our_attr, lambda lib: lib.LRP(rule_mapper=our_rules.EpsilonPlus(
        EPS, EPS, rule_mapper=at(nn.Linear, Epsilon(0.125), None))), model, td)
    theirs, _ = run(ref_attr, lambda lib: lib.LRP(rule_mapper=ref_rules.EpsilonPlus(
        EPS, EPS, rule_mapper=at(nn.Linear, ref_rules.EpsilonRule(0.125), None))), model, td)
    torch.testing.assert_close(ours["attr", "input"], theirs["attr", "input"], **TOL[dtype])
