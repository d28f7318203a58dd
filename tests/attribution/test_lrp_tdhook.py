"""lrp side by side with tdhook 0.1.3's LRP: every rule, an MLP and a small CNN, float64 and float32."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers import rules as ref
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import (
    AHQKV,
    AlphaBeta,
    Epsilon,
    EpsilonPlus,
    Flat,
    LayerNorm,
    Pass,
    PseudoIdentity,
    SoftmaxEpsilon,
    Uniform,
    UniformEpsilon,
    WSquare,
    ZPlus,
    lrp,
)

MAX_DIFF: dict[str, float] = {}  # rule -> largest |ours - tdhook| seen (float64), for the report

# tdhook 0.1.3 stabilises with ``eps * (-1) ** (z < 0)``: an integer tensor times a float,
# which rounds eps to float32 even for float64 models. We use eps as given; the epsilons
# below are exact in float32, so that float64 results can be compared tightly.


def mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype).eval()


def cnn(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 5, 3), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(5, 3),
    ).to(dtype)
    with torch.no_grad():  # eval-mode statistics that are not the identity
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    return model.eval()


def data(model: nn.Module, dtype: torch.dtype, batch: int = 4) -> TensorDict:
    torch.manual_seed(2)
    shape = (2, 10, 10) if isinstance(model[0], nn.Conv2d) else (model[0].in_features,)
    return TensorDict(input=torch.randn(batch, *shape, dtype=dtype), batch_size=[batch])


def theirs(model: nn.Module, td: TensorDict, mapper: Callable[[str, nn.Module], Any], target: int) -> torch.Tensor:
    factory = LRP(rule_mapper=mapper, warn_on_missing_rule=False,
                  init_attr_targets=lambda t, e: TensorDict(o=t["output"][..., target], batch_size=t.batch_size))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with factory.prepare(copy.deepcopy(model), in_keys=["input"], out_keys=["output"]) as hooked:
            return hooked(td.clone())["attr", "input"]  # type: ignore[no-any-return]


def ours(model: nn.Module, td: TensorDict, rules: Any, target: int) -> torch.Tensor:
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    return lrp(f, p, td, target=target, rules=rules, warn_on_missing_rule=False)["input"]


def at(cls: type[nn.Module], rule: Any, index: int | None = None) -> Callable[[str, nn.Module], Any]:
    """``rule`` at every ``cls`` (or only at the child ``index``), ``None`` elsewhere.

    tdhook names modules inside its wrapper (``module.0``); we name them as the model does.
    """
    return lambda name, m: rule if isinstance(m, cls) and (
        index is None or name.rsplit(".", 1)[-1] == str(index)) else None


def check(name: str, model: nn.Module, dtype: torch.dtype, our_rules: Any, ref_mapper: Any) -> None:
    td = data(model, dtype)
    for target in (0, 2):
        expected, actual = theirs(model, td, ref_mapper, target), ours(model, td, our_rules, target)
        assert actual.abs().sum() > 0
        tol = {"rtol": 1e-9, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
        torch.testing.assert_close(actual, expected, **tol, msg=lambda m, t=target: f"{name}, target {t}: {m}")
        if dtype == torch.float64:
            MAX_DIFF[name] = max(MAX_DIFF.get(name, 0.0), (actual - expected).abs().max().item())


# (name, model, our rule, their rule, class it goes to, only the module named)
CASES: list[tuple[str, Callable[[torch.dtype], nn.Module], Any, Any, type[nn.Module], int | None]] = [
    ("epsilon", mlp, Epsilon(), ref.EpsilonRule(), nn.Linear, None),
    ("epsilon_0.125", mlp, Epsilon(0.125), ref.EpsilonRule(0.125), nn.Linear, None),
    ("epsilon_conv", cnn, Epsilon(2**-7), ref.EpsilonRule(2**-7), nn.Conv2d, None),
    ("uniform_epsilon", mlp, UniformEpsilon(2**-7), ref.UniformEpsilonRule(2**-7), nn.Linear, None),
    ("zplus", mlp, ZPlus(), ref.AlphaBetaRule(1.0, 0.0), nn.Linear, None),
    ("zplus_conv", cnn, ZPlus(), ref.AlphaBetaRule(1.0, 0.0), nn.Conv2d, None),
    ("alpha2beta1", mlp, AlphaBeta(), ref.AlphaBetaRule(), nn.Linear, None),
    ("alpha2beta1_conv", cnn, AlphaBeta(2.0, 1.0), ref.AlphaBetaRule(2.0, 1.0), nn.Conv2d, None),
    ("flat", mlp, Flat(), ref.FlatRule(), nn.Linear, 0),
    ("flat_conv", cnn, Flat(), ref.FlatRule(), nn.Conv2d, 0),
    ("wsquare", mlp, WSquare(), ref.WSquareRule(), nn.Linear, 0),
    ("wsquare_conv", cnn, WSquare(), ref.WSquareRule(), nn.Conv2d, 0),
    ("pass_tanh", mlp, Pass(), ref.PassRule(), nn.Tanh, None),
    ("pseudo_identity", mlp, PseudoIdentity(), ref.PseudoIdentityRule(), nn.Tanh, None),
    ("uniform", mlp, Uniform(), ref.UniformRule(), nn.Tanh, None),
    ("ahqkv", mlp, AHQKV(), ref.AHQKVRule(), nn.Linear, 2),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("name", "model", "rule", "ref_rule", "cls", "index"), CASES, ids=[c[0] for c in CASES])
def test_rule_matches_tdhook(name: str, model: Any, rule: Any, ref_rule: Any, cls: type[nn.Module],
                             index: int | None, dtype: torch.dtype) -> None:
    """The rule at its modules, tdhook's EpsilonPlus everywhere else (both sides)."""
    net = model(dtype)
    check(name, net, dtype, EpsilonPlus(rule_mapper=at(cls, rule, index)),
          ref.EpsilonPlus(rule_mapper=at(cls, ref_rule, index)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("model", [mlp, cnn])
def test_epsilon_plus_matches_tdhook(model: Any, dtype: torch.dtype) -> None:
    check(f"epsilon_plus_{model.__name__}", model(dtype), dtype, EpsilonPlus(), ref.EpsilonPlus())
    check(f"epsilon_plus_{model.__name__}_0.125", model(dtype), dtype, EpsilonPlus(0.125, 2**-10),
          ref.EpsilonPlus(0.125, 2**-10))


def test_softmax_and_layer_norm_rules_match_tdhook() -> None:
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.Linear(6, 4), nn.Softmax(-1)).double().eval()
    with torch.no_grad():
        net[1].weight.uniform_(0.5, 1.5)
        net[1].bias.uniform_(-0.2, 0.2)
    rules = {nn.Linear: Epsilon(), nn.LayerNorm: LayerNorm(), nn.Softmax: SoftmaxEpsilon()}
    mapper = ref.EpsilonPlus(rule_mapper=lambda n, m: ref.LayerNormRule() if isinstance(m, nn.LayerNorm) else
                             ref.SoftmaxEpsilonRule() if isinstance(m, nn.Softmax) else None)
    check("layer_norm+softmax", net, torch.float64, rules, mapper)


def test_mapping_forms_give_the_same_maps() -> None:
    """By class, by path, by pattern and by callable: one assignment, one map."""
    net = mlp(torch.float64)
    td = data(net, torch.float64)
    by_class = {nn.Linear: Epsilon(0.01), nn.ReLU: Pass(), nn.Tanh: Pass()}
    by_path = {"[0]": Epsilon(0.01), "[2]": Epsilon(0.01), "[4]": Epsilon(0.01), "[1]": Pass(), "[3]": Pass()}
    by_pattern = {r"[024]": Epsilon(0.01), r"\d": Pass()}
    expected = ours(net, td, EpsilonPlus(0.01), 1)
    for rules in (by_class, by_path, by_pattern):
        torch.testing.assert_close(ours(net, td, rules, 1), expected, rtol=0, atol=0)


def test_report_max_diffs() -> None:
    """Runs last in this file: prints the float64 max abs differences (pytest -s)."""
    for name, diff in sorted(MAX_DIFF.items()):
        print(f"{name}: {diff:.3g}")


@pytest.mark.parametrize(("model", "layer"), [(cnn, "[4]"), (mlp, "[2]")])
def test_layer_relevance_and_summed_targets_match_tdhook(model: Any, layer: str) -> None:
    """``layers`` is tdhook's ``input_modules``: the relevance at the module's output."""
    net = model(torch.float64)
    td = data(net, torch.float64)
    factory = LRP(rule_mapper=ref.EpsilonPlus(), warn_on_missing_rule=False, input_modules=[layer],
                  init_attr_targets=lambda t, e: TensorDict(o=t["output"][..., [0, 2]], batch_size=t.batch_size))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with factory.prepare(copy.deepcopy(net), in_keys=["input"], out_keys=["output"]) as hooked:
            expected = hooked(td.clone())
    f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
    actual = lrp(f, p, td, target=(0, 2), rules=EpsilonPlus(), layers=[layer], warn_on_missing_rule=False)
    for key in ("input", layer):
        torch.testing.assert_close(actual[key], expected["attr", key], rtol=1e-9, atol=1e-12)
