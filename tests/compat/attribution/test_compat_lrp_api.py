"""tdhook_fn.compat.attribution.LRP and lrp_helpers: tdhook 0.1.3's names and signatures, errors, no mutation."""

from __future__ import annotations

import inspect
import threading
import warnings
from typing import Any

import pytest
import tdhook.attribution as ref_attr
import torch
from tdhook.attribution.lrp_helpers import layers as ref_layers
from tdhook.attribution.lrp_helpers import rules as ref_rules
from tdhook.attribution.lrp_helpers import types as ref_types
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

import tdhook_fn.compat.attribution as our_attr
from tdhook_fn import attribution
from tdhook_fn.compat.attribution.lrp_helpers import layers as our_layers
from tdhook_fn.compat.attribution.lrp_helpers import rules as our_rules
from tdhook_fn.compat.attribution.lrp_helpers import types as our_types

NOT_PROVIDED = {"ParamModifier", "AbstractFunctionMeta"}
RULE_CLASSES = ["EpsilonRule", "UniformEpsilonRule", "SoftmaxEpsilonRule", "PassRule", "IgnoreRule", "StopRule",
                "UniformRule", "WSquareRule", "FlatRule", "AlphaBetaRule", "LayerNormRule", "PseudoIdentityRule",
                "AHQKVRule"]


def params_of(sig: inspect.Signature) -> list[tuple[str, Any]]:
    return [(p.name, p.default) for p in sig.parameters.values()]


def test_names_and_signatures() -> None:
    assert params_of(inspect.signature(our_attr.LRP)) == params_of(inspect.signature(ref_attr.LRP))
    theirs = {n for n, v in vars(ref_rules).items() if not n.startswith("_") and getattr(v, "__module__", "") ==
              ref_rules.__name__}
    assert theirs - set(our_rules.__all__) == NOT_PROVIDED
    for name in [*RULE_CLASSES, "EpsilonPlus", "BaseRuleMapper", "stabilize"]:
        assert params_of(inspect.signature(getattr(our_rules, name))) == params_of(
            inspect.signature(getattr(ref_rules, name))), name
    assert params_of(inspect.signature(our_layers.Sum)) == params_of(inspect.signature(ref_layers.Sum))
    for name in ["Activation", "AvgPool", "BatchNorm", "Convolution", "ConvolutionStandard", "ConvolutionTranspose",
                 "Linear", "MaxPool", "SubclassMeta"]:
        assert hasattr(our_types, name), name
    assert set(our_attr.__all__) >= {"LRP", "lrp_helpers"}


def test_rule_classes_map_to_tdhook_fn_rules() -> None:
    assert our_rules.EpsilonRule().rule() == attribution.Epsilon(1e-6)
    rule = our_rules.EpsilonRule(0.5)
    rule.epsilon = 0.25  # tdhook's epsilon setter
    assert rule.rule() == attribution.Epsilon(0.25)
    assert our_rules.AlphaBetaRule().rule() == attribution.AlphaBeta(2.0, 1.0, 1e-6)
    assert our_rules.FlatRule(0.5).rule() == attribution.Flat(0.5)
    for name in RULE_CLASSES:
        assert callable(getattr(getattr(our_rules, name)().rule(), "relevance", None)), name
    x = torch.tensor([-2.0, 0.0, 3.0])
    torch.testing.assert_close(our_rules.stabilize(x, 0.5), ref_rules.stabilize(x, 0.5))


def test_types_and_default_skip_agree_with_tdhook() -> None:
    modules = [nn.Conv1d(1, 1, 1), nn.Conv2d(1, 1, 1), nn.ConvTranspose2d(1, 1, 1), nn.Linear(1, 1), nn.ReLU(),
               nn.GELU(), nn.Softmax(-1), nn.BatchNorm2d(1), nn.AvgPool2d(2), nn.AdaptiveMaxPool1d(1),
               nn.MaxPool2d(2), nn.LayerNorm(2), nn.Sequential(), nn.ModuleList(), nn.Identity()]
    for group in ["Activation", "AvgPool", "BatchNorm", "Convolution", "ConvolutionStandard", "ConvolutionTranspose",
                  "Linear", "MaxPool"]:
        for m in modules:
            assert isinstance(m, getattr(our_types, group)) == isinstance(m, getattr(ref_types, group)), (group, m)
    wrapped = TensorDictModule(nn.Linear(1, 1), in_keys=["x"], out_keys=["y"])
    for name in ["", "td_module", "module", "module.0", "x"]:
        for m in [*modules, wrapped]:
            assert our_attr.LRP.default_skip(name, m) == ref_attr.LRP.default_skip(name, m), (name, m)
    for m in modules:
        for mapper in ("EpsilonPlus", "BaseRuleMapper"):
            ours, theirs = getattr(our_rules, mapper)()("x", m), getattr(ref_rules, mapper)()("x", m)
            assert (ours is None) == (theirs is None), (mapper, m)
            if ours is not None:
                assert type(ours).__name__ in (type(theirs).__name__.removesuffix("Rule"),
                                               type(theirs).__name__, "AlphaBeta", "Epsilon", "Pass", "Ignore")


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 2)).eval()


def snapshot(m: nn.Module) -> dict[str, Any]:
    return {"state": {k: v.clone() for k, v in m.state_dict().items()},
            "forward": [(n, sub.__dict__.get("forward")) for n, sub in m.named_modules()],
            "hooks": [(n, len(sub._forward_hooks), len(sub._forward_pre_hooks), len(sub._backward_hooks))
                      for n, sub in m.named_modules()],
            "grads": [p.grad for p in m.parameters()], "keys": sorted(vars(m))}


def assert_unchanged(m: nn.Module, before: dict[str, Any]) -> None:
    after = snapshot(m)
    assert after["state"].keys() == before["state"].keys()
    for k, v in before["state"].items():
        assert torch.equal(after["state"][k], v) and after["state"][k].dtype == v.dtype, k
    assert after["forward"] == before["forward"] and after["hooks"] == before["hooks"]
    assert all(g is None for g in after["grads"]) and after["keys"] == before["keys"]


def test_model_bitwise_unchanged_after_calls_and_exceptions() -> None:
    m = model()
    before = snapshot(m)
    td = TensorDict(input=torch.randn(4, 1, 4, 4), batch_size=[4])
    with our_attr.LRP(rule_mapper=our_rules.EpsilonPlus(), warn_on_missing_rule=False,
                      input_modules=["[1]"]).prepare(m) as hooked:
        assert_unchanged(m, before)
        out = hooked(td.clone())
        assert out["attr", "input"].shape == (4, 1, 4, 4)
        assert_unchanged(m, before)
    assert_unchanged(m, before)
    bad_target = our_attr.LRP(rule_mapper=our_rules.EpsilonPlus(), warn_on_missing_rule=False,
                              init_attr_targets=lambda t, _: t["output"])
    with pytest.raises(ValueError, match="must return a TensorDict"), bad_target.prepare(m) as hooked:
        hooked(td.clone())
    assert_unchanged(m, before)
    with pytest.raises(ValueError), our_attr.LRP(rule_mapper=lambda n, s: our_rules.PassRule() if isinstance(
            s, nn.Linear) else None, warn_on_missing_rule=False).prepare(m) as hooked:
        hooked(td.clone())  # Pass on a shape-changing layer
    assert_unchanged(m, before)
    with pytest.raises(ValueError, match="both have a rule"), our_attr.LRP(
            rule_mapper=lambda n, s: our_rules.EpsilonRule(), skip_modules=lambda n, s: n == "",
            warn_on_missing_rule=False).prepare(m):
        pass  # a rule on the Sequential and on its children: refused on entry
    assert_unchanged(m, before)


def test_errors() -> None:
    for lib in (our_rules, ref_rules):
        with pytest.raises(ValueError):
            lib.AlphaBetaRule(3.0, 1.0)
        with pytest.raises(ValueError):
            lib.AlphaBetaRule(-1.0, -2.0)
    with pytest.raises(NotImplementedError, match="output_grad_callbacks"):
        our_attr.LRP(output_grad_callbacks={"[0]": lambda module, grad_output: grad_output})
    with pytest.raises(TypeError, match="'module.0'"), our_attr.LRP(
            rule_mapper=lambda n, s: "epsilon" if n == "module.0" else None, warn_on_missing_rule=False,
    ).prepare(model()):
        pass
    with pytest.raises(ValueError, match="wrapper"), our_attr.LRP(
            rule_mapper=lambda n, s: our_rules.EpsilonRule() if n == "" else None, warn_on_missing_rule=False,
    ).prepare(model()):
        pass

    class Custom(our_rules.Rule):
        pass

    with pytest.raises(TypeError, match="relevance"), our_attr.LRP(
            rule_mapper=lambda n, s: Custom() if n == "module.3" else None, warn_on_missing_rule=False,
    ).prepare(model()):
        pass


def test_warnings() -> None:
    for flag, count in ((True, 2), (False, 0)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with our_attr.LRP(rule_mapper=our_rules.EpsilonPlus(), warn_on_missing_rule=flag).prepare(model()):
                pass
        assert [str(w.message) for w in seen] == [
            "No rule found for module `` (TensorDictModule)", "No rule found for module `module` (Sequential)",
        ][:count]


def test_threads_share_one_context() -> None:
    m = model()
    xs = [torch.randn(3, 1, 4, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    results: dict[int, torch.Tensor] = {}
    with our_attr.LRP(rule_mapper=our_rules.EpsilonPlus(), warn_on_missing_rule=False).prepare(m) as hooked:
        expected = [hooked(TensorDict(input=x, batch_size=[3]))["attr", "input"] for x in xs]

        def work(i: int) -> None:
            for _ in range(5):
                results[i] = hooked(TensorDict(input=xs[i], batch_size=[3]))["attr", "input"]

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i in range(4):
        assert torch.equal(results[i], expected[i])


def test_stop_rule_behind_plain_modules() -> None:
    """tdhook's autograd.grad fails when only plain modules lie between the input and a StopRule; ours gives 0."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).eval()
    td = TensorDict(input=torch.randn(4, 5), batch_size=[4])
    for lib, rules in ((ref_attr, ref_rules), (our_attr, our_rules)):
        factory = lib.LRP(rule_mapper=lambda n, s, r=rules: r.StopRule() if isinstance(s, nn.Tanh) else None,
                          warn_on_missing_rule=False)
        if lib is ref_attr:
            with pytest.raises(RuntimeError, match="not have been used"), factory.prepare(m) as hooked:
                hooked(td.clone())
        else:
            with factory.prepare(m) as hooked:
                assert not hooked(td.clone())["attr", "input"].any()


def test_tensordict_module_and_nested_contexts() -> None:
    """A TensorDictModule model gets tdhook's names and numbers; an inner context of one factory
    on the same model leaves the outer one's rules in place."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    td = TensorDict(input=torch.randn(4, 5), batch_size=[4])
    results, names = [], []
    for lib, rules in ((ref_attr, ref_rules), (our_attr, our_rules)):
        seen: list[str] = []
        mapper = lambda n, s, r=rules, seen=seen: seen.append(n) or r.EpsilonPlus()(n, s)
        wrapped = TensorDictModule(m, in_keys=["input"], out_keys=["output"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with lib.LRP(rule_mapper=mapper).prepare(wrapped) as hooked:
                results.append(hooked(td.clone())["attr", "input"])
        names.append(seen)
    assert names[0] == names[1] == ["", "module", "module.0", "module.1", "module.2"]
    torch.testing.assert_close(results[1], results[0])
    factory = our_attr.LRP(rule_mapper=our_rules.EpsilonPlus(), warn_on_missing_rule=False)
    with factory.prepare(m) as outer:
        first = outer(td.clone())["attr", "input"]
        with factory.prepare(m) as inner:
            assert torch.equal(inner(td.clone())["attr", "input"], first)
        assert torch.equal(outer(td.clone())["attr", "input"], first)


def test_epsilon_plus_tables_agree() -> None:
    """The compat composite answers tdhook's rule objects standing for the pure composite's rules."""
    modules = [nn.Conv1d(1, 1, 1), nn.Conv2d(1, 1, 1), nn.ConvTranspose3d(1, 1, 1), nn.Linear(1, 1), nn.ReLU(),
               nn.Tanh(), nn.GELU(), nn.BatchNorm1d(1), nn.AvgPool2d(2), nn.AdaptiveAvgPool1d(1), nn.MaxPool2d(2),
               nn.Identity(), nn.Dropout(), nn.Flatten(), nn.LayerNorm(2), nn.Softmax(-1), nn.Sequential()]
    compat, pure = our_rules.EpsilonPlus(0.25, 0.5), attribution.EpsilonPlus(0.25, 0.5)
    theirs = ref_rules.EpsilonPlus(0.25, 0.5)
    for m in modules:
        ours, expected, ref = compat("x", m), pure("x", m), theirs("x", m)
        assert (ours is None) == (expected is None) == (ref is None), m
        if ours is not None:
            assert ours.rule() == expected, m
            assert type(ours).__name__ == type(ref).__name__, m
    assert compat("x", our_layers.Sum()).rule() == attribution.Epsilon(0.5)


def test_prepared_module_keeps_the_rules_of_its_entry_after_the_context_closes() -> None:
    """docs/compat.md: the rules live in the prepared module; the hooked module raises outside its context."""
    m = model()
    td = TensorDict(input=torch.randn(4, 1, 4, 4), batch_size=[4])
    with our_attr.LRP(rule_mapper=our_rules.EpsilonPlus(), warn_on_missing_rule=False).prepare(m) as hooked:
        inside = hooked(td.clone())["attr", "input"]
    with our_attr.LRP(warn_on_missing_rule=False).prepare(m) as plain:
        gradients = plain(td.clone())["attr", "input"]
    with pytest.raises(RuntimeError, match="must be called in context"):
        hooked(td.clone())
    after = hooked.td_module(td.clone())["attr", "input"]
    assert torch.equal(after, inside) and not torch.allclose(after, gradients)


def test_epsilon_plus_gives_each_module_its_own_rule() -> None:
    """A Sum's rule then a BatchNorm's, from fresh composites: tdhook's classes, one object per rule. (The pure rule
    of a Sum was made at each question and freed; its id, taken by the BatchNorm's, gave the Sum's rule there.)"""
    def modules(layers: Any) -> list[nn.Module]:
        return [nn.Conv2d(3, 8, 3), layers.Sum(), nn.BatchNorm2d(8), nn.BatchNorm2d(8), layers.Sum(), nn.AvgPool2d(2),
                nn.ReLU(), nn.Linear(2, 2)]

    ours, ref = modules(our_layers), modules(ref_layers)
    for _ in range(3):
        compat, theirs = our_rules.EpsilonPlus(), ref_rules.EpsilonPlus()
        answers = [compat(str(i), m) for i, m in enumerate(ours)]
        assert [type(a).__name__ for a in answers] == [type(theirs(str(i), m)).__name__ for i, m in enumerate(ref)]
        assert answers[2] is answers[3] and answers[1] is answers[4]
