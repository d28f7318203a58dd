"""lrp's axioms and contracts: LRP-0 = gradient x input / target, conservation, batches, vmap, purity."""

from __future__ import annotations

import itertools
import threading
import warnings
from typing import Any

import attr_zoo
import pytest
import torch
from _tolerance import assert_close_ulps
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torch import nn
from zoo import same, snapshot

import tdhook_fn
from tdhook_fn.attribution import (
    AHQKV,
    AlphaBeta,
    Epsilon,
    EpsilonPlus,
    Ignore,
    Pass,
    Stop,
    UniformEpsilon,
    ZPlus,
    lrp,
    rule_taps,
    saliency,
)

LRP0 = {nn.Linear: Epsilon(1e-12), nn.Conv2d: Epsilon(1e-12), nn.ReLU: Pass(), nn.Flatten: Ignore()}


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    yield from attr_zoo.one_thread()


def bias_free_mlp(widths: list[int], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers += [nn.Linear(a, b, bias=False)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
    return nn.Sequential(*layers).double()


def small_cnn(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Conv2d(3, 2, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8, 3)).to(dtype).eval()


def fp(model: nn.Module) -> tuple[Any, TensorDict]:
    return tdhook_fn.functional(model), tdhook_fn.params(model)


def test_lrp0_is_gradient_times_input_over_the_target_value() -> None:
    """LRP-0 on a bias-free ReLU net: R = x * df/dx / f(x) (tdhook puts relevance 1 in at the target)."""
    net = bias_free_mlp([4, 6, 5, 3])
    f, p = fp(net)
    x = TensorDict(input=torch.randn(7, 4, dtype=torch.float64), batch_size=[7])
    relevance = lrp(f, p, x, target=2, rules=LRP0)["input"]
    gxi = saliency(f, p, x, target=2, multiply_by_inputs=True)["input"]
    value = f(p, x)["output"][:, 2:3]
    torch.testing.assert_close(relevance, gxi / value, rtol=1e-9, atol=1e-12)


def test_lrp0_on_a_bias_free_cnn_is_gradient_times_input_over_the_target_value() -> None:
    net = small_cnn()
    for module in net:
        if getattr(module, "bias", None) is not None:
            module.bias = None  # type: ignore[assignment]
    f, p = fp(net)
    x = TensorDict(input=torch.randn(3, 1, 6, 6, dtype=torch.float64), batch_size=[3])
    relevance = lrp(f, p, x, target=1, rules=LRP0)["input"]
    gxi = saliency(f, p, x, target=1, multiply_by_inputs=True)["input"]
    value = f(p, x)["output"][:, 1].reshape(3, 1, 1, 1)
    torch.testing.assert_close(relevance, gxi / value, rtol=1e-8, atol=1e-10)


@settings(max_examples=25, deadline=None)
@given(widths=st.lists(st.integers(1, 6), min_size=2, max_size=5), seed=st.integers(0, 2**16),
       batch=st.integers(1, 3))
def test_lrp0_conserves_relevance_at_every_layer(widths: list[int], seed: int, batch: int) -> None:
    """Without biases and with epsilon -> 0, every layer's relevance sums to the target's (1)."""
    net = bias_free_mlp(widths, seed)
    f, p = fp(net)
    torch.manual_seed(seed + 1)
    x = TensorDict(input=torch.randn(batch, widths[0], dtype=torch.float64), batch_size=[batch])
    out = f(p, x)["output"][:, 0]
    assume(bool((out.abs() > 1e-3).all()))
    layers = [f"[{i}]" for i, m in enumerate(net) if isinstance(m, nn.Linear)]
    result = lrp(f, p, x, target=0, rules=LRP0, layers=layers, check_conservation=True)
    for key in ("input", *layers):
        torch.testing.assert_close(result[key].sum(-1), torch.ones(batch, dtype=torch.float64), rtol=1e-7,
                                   atol=1e-7, msg=lambda m, k=key: f"{k}: {m}")


def test_zplus_conserves_relevance_on_positive_inputs() -> None:
    net = bias_free_mlp([4, 6, 3], seed=5)
    f, p = fp(net)
    x = TensorDict(input=torch.rand(5, 4, dtype=torch.float64) + 0.1, batch_size=[5])
    for rule in (ZPlus(1e-12), AlphaBeta(2.0, 1.0, 1e-12)):
        result = lrp(f, p, x, target=1, rules={nn.Linear: rule, nn.ReLU: Pass()}, check_conservation=True)
        torch.testing.assert_close(result["input"].sum(-1), torch.ones(5, dtype=torch.float64))


def test_check_conservation_raises_where_biases_absorb_relevance() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    with torch.no_grad():
        net[2].bias.fill_(3.0)
    f, p = fp(net)
    x = TensorDict(input=torch.randn(4, 3, dtype=torch.float64), batch_size=[4])
    with pytest.raises(RuntimeError, match="not conserved"):
        lrp(f, p, x, target=0, rules=LRP0, check_conservation=True)


def test_per_target_equals_one_call_per_target() -> None:
    net = small_cnn()
    f, p = fp(net)
    x = TensorDict(input=torch.randn(4, 1, 6, 6, dtype=torch.float64), batch_size=[4])
    maps = lrp(f, p, x, target=(0, 2), rules=EpsilonPlus(), per_target=True, layers=["[2]"])
    assert maps.batch_size == torch.Size([2, 4])
    for t, target in enumerate((0, 2)):
        one = lrp(f, p, x, target=target, rules=EpsilonPlus(), layers=["[2]"])
        assert_close_ulps(maps[t], one)
    summed = lrp(f, p, x, target=(0, 2), rules=EpsilonPlus())
    assert_close_ulps(summed["input"], maps["input"].sum(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batch_shapes_and_vmap_give_the_same_maps(dtype: torch.dtype) -> None:
    net = small_cnn(dtype)
    f, p = fp(net)
    data = torch.randn(2, 3, 1, 6, 6, dtype=dtype)
    run = lambda td: lrp(f, p, td, target=1, rules=EpsilonPlus(), layers=["[0]"])
    grid = run(TensorDict(input=data, batch_size=[2, 3]))
    flat = run(TensorDict(input=data.reshape(6, 1, 6, 6), batch_size=[6]))
    single = run(TensorDict(input=data[1, 2], batch_size=[]))
    assert grid.batch_size == torch.Size([2, 3]) and single.batch_size == torch.Size([])
    assert_close_ulps(grid.reshape(6), flat)
    assert_close_ulps(single, grid[1, 2])
    per_sample = torch.func.vmap(run)(TensorDict(input=data[0], batch_size=[3]))
    assert_close_ulps(per_sample, grid[0])


def test_vmap_of_per_target_maps() -> None:
    net = bias_free_mlp([3, 5, 4])
    f, p = fp(net)
    x = TensorDict(input=torch.randn(6, 3, dtype=torch.float64), batch_size=[6])
    run = lambda td: lrp(f, p, td, target=(0, 3), rules=LRP0, per_target=True)
    assert_close_ulps(torch.func.vmap(run, out_dims=1)(x), run(x))


def test_stop_sends_nothing_back_and_keeps_the_layers_above() -> None:
    net = bias_free_mlp([3, 5, 4, 2])
    f, p = fp(net)
    x = TensorDict(input=torch.randn(4, 3, dtype=torch.float64), batch_size=[4])
    stopped = lrp(f, p, x, target=0, rules={"[2]": Stop(), **LRP0}, layers=["[2]"])
    plain = lrp(f, p, x, target=0, rules=LRP0, layers=["[2]"])
    assert torch.equal(stopped["input"], torch.zeros_like(stopped["input"]))
    assert torch.equal(stopped["[2]"], plain["[2]"])


def test_rules_compute_with_the_given_params_not_the_models() -> None:
    net = bias_free_mlp([3, 5, 2])
    f, p = fp(net)
    other = p.apply(lambda t: t * 2 + 0.1)
    x = TensorDict(input=torch.randn(4, 3, dtype=torch.float64), batch_size=[4])
    copy = bias_free_mlp([3, 5, 2])
    tdhook_fn.params(copy)  # same structure
    copy.load_state_dict({k: v for k, v in other.flatten_keys(".").items()})
    expected = lrp(tdhook_fn.functional(copy), tdhook_fn.params(copy), x, target=1, rules=EpsilonPlus())
    assert_close_ulps(lrp(f, other, x, target=1, rules=EpsilonPlus()), expected)


def test_differentiating_an_lrp_map_raises_rather_than_lie() -> None:
    """A rule's backward would stand in for the module's derivative under an outer grad too."""
    net = bias_free_mlp([3, 4, 2])
    f, p = fp(net)
    x = TensorDict(input=torch.randn(2, 3, dtype=torch.float64), batch_size=[2])
    score = lambda q, td: lrp(f, q, td, target=1, rules=LRP0)["input"].sum()
    with pytest.raises(NotImplementedError, match="cannot be differentiated"):
        torch.func.grad(score)(p, x)
    with pytest.raises(NotImplementedError, match="cannot be differentiated"):
        torch.func.grad(score, argnums=1)(p, x)
    with pytest.raises(NotImplementedError, match="cannot be differentiated"):
        torch.func.vmap(torch.func.grad(lambda td: score(p, td)))(x)


def test_an_lrp_map_that_would_carry_a_regular_autograd_graph_raises() -> None:
    """Params that require grad (TensorDict.from_module) would make the map differentiable, and wrong."""
    net = bias_free_mlp([3, 4, 2])
    f, p = fp(net)
    x = TensorDict(input=torch.randn(2, 3, dtype=torch.float64), batch_size=[2])
    live = TensorDict.from_module(net)
    assert any(t.requires_grad for t in live.values(True, True))
    with pytest.raises(NotImplementedError, match="params require grad"):
        lrp(f, live, x, target=1, rules=LRP0)
    with pytest.raises(NotImplementedError, match="params require grad"):  # a batched map reads requires_grad False
        torch.func.vmap(lambda td: lrp(f, live, td, target=1, rules=LRP0))(x)
    scale = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    with pytest.raises(NotImplementedError, match="closed-over tensor"):
        lrp(f, p, x, target=lambda out: out["output"][..., 1] * scale, rules=LRP0)
    expected = lrp(f, p, x, target=1, rules=LRP0)
    with torch.no_grad():
        assert_close_ulps(lrp(f, live, x, target=1, rules=LRP0), expected)
    needs_grad = x.apply(lambda t: t.clone().requires_grad_())  # read as values: the map carries no graph
    mapped = lrp(f, p, needs_grad, target=1, rules=LRP0)
    assert not mapped["input"].requires_grad
    assert_close_ulps(mapped, expected)
    net2 = small_cnn(torch.float64)  # a CNN's map carried the inputs' graph before they were read as values
    f2, p2 = fp(net2)
    x2 = TensorDict(input=torch.randn(2, 1, 6, 6, dtype=torch.float64), batch_size=[2])
    expected2 = lrp(f2, p2, x2, target=1, rules=EpsilonPlus())
    mapped2 = lrp(f2, p2, x2.apply(lambda t: t.clone().requires_grad_()), target=1, rules=EpsilonPlus())
    assert not mapped2["input"].requires_grad
    assert_close_ulps(mapped2, expected2)


def test_the_model_is_unchanged_after_calls_and_after_a_rule_raises() -> None:
    net = small_cnn(torch.float32)
    f, p = fp(net)
    before, p_before = snapshot(net), p.clone()
    x = TensorDict(input=torch.randn(2, 1, 6, 6), batch_size=[2])
    lrp(f, p, x, target=1, rules=EpsilonPlus(), per_target=False, layers=["[2]"])
    lrp(f, p, x, target=(0, 1), rules=EpsilonPlus(), per_target=True)
    with pytest.raises(ValueError, match="Pass at '0'"):
        lrp(f, p, x, target=1, rules={"[0]": Pass(), **LRP0})
    with pytest.raises(ValueError, match="runs inside"):
        lrp(f, p, x, target=1, rules={"": Epsilon(), nn.Conv2d: Epsilon()}, warn_on_missing_rule=False)
    assert same(before, snapshot(net))
    assert (p == p_before).all()
    assert_close_ulps(lrp(f, p, x, target=1, rules=EpsilonPlus()), lrp(f, p, x, target=1, rules=EpsilonPlus()))


def test_two_threads_sharing_one_model_get_their_own_maps() -> None:
    net = small_cnn(torch.float32)
    f, p = fp(net)
    params = [p, p.apply(lambda t: -t)]
    inputs = [TensorDict(input=torch.randn(3, 1, 6, 6), batch_size=[3]) for _ in range(2)]
    expected = [lrp(f, params[i], inputs[i], target=i, rules=EpsilonPlus(), per_target=i == 1) for i in range(2)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def work(i: int) -> None:
        try:
            barrier.wait()
            for _ in range(15):
                got = lrp(f, params[i], inputs[i], target=i, rules=EpsilonPlus(), per_target=i == 1)
                assert torch.equal(got["input"], expected[i]["input"])
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_bad_rules_name_what_is_wrong() -> None:
    net = bias_free_mlp([3, 4, 2])
    f, p = fp(net)
    x = TensorDict(input=torch.randn(2, 3, dtype=torch.float64), batch_size=[2])
    with pytest.raises(ValueError, match="'nope' names no submodule"):
        lrp(f, p, x, target=0, rules={"nope": Epsilon()})
    with pytest.raises(TypeError, match="no relevance method"):
        lrp(f, p, x, target=0, rules={nn.Linear: "epsilon"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="Functional"):
        lrp(lambda q, td: td, p, x, target=0, rules=LRP0)
    with pytest.raises(ValueError, match="alpha - beta must be 1"):
        AlphaBeta(2.0, 2.0)
    with pytest.raises(ValueError, match=">= 0"):
        AlphaBeta(-1.0, -2.0)
    with pytest.warns(UserWarning, match="no rule for module '1'"):
        lrp(f, p, x, target=0, rules={nn.Linear: Epsilon()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lrp(f, p, x, target=0, rules={nn.Linear: Epsilon()}, warn_on_missing_rule=False)


def test_rule_taps_compose_with_other_methods() -> None:
    """The taps are plain taps: saliency with them is lrp (the rules do the multiplying).

    (Not bitwise: lrp walks this chain with z+ fused into one op per module, NOTE [fused alpha-beta].)
    """
    net = small_cnn()
    f, p = fp(net)
    x = TensorDict(input=torch.randn(2, 1, 6, 6, dtype=torch.float64), batch_size=[2])
    taps = rule_taps(f, EpsilonPlus(), warn_on_missing_rule=False)
    assert_close_ulps(saliency(f, p, x, target=1, taps=taps)["input"],
                      lrp(f, p, x, target=1, rules=EpsilonPlus())["input"], ulps=64)


def test_per_target_with_a_vmapped_pullback_equals_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """On accelerators the engine vmaps the pullback over the one-hots: the rules' backwards batch."""
    from tdhook_fn.attribution import _engine

    net = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(),
                        nn.Linear(12, 3)).double().eval()
    f, p = fp(net)
    x = TensorDict(input=torch.randn(4, 1, 6, 6, dtype=torch.float64), batch_size=[4])
    rules = EpsilonPlus(rule_mapper=lambda n, m: AlphaBeta() if isinstance(m, nn.Linear) else None)
    loop = lrp(f, p, x, target=(0, 1, 2), rules=rules, per_target=True, layers=["[2]"], check_conservation=False)
    monkeypatch.setattr(_engine, "pull_each", lambda pullback, cot: torch.func.vmap(pullback)(cot)[0])
    assert_close_ulps(lrp(f, p, x, target=(0, 1, 2), rules=rules, per_target=True, layers=["[2]"]), loop)


class Twice(nn.Module):
    """One Linear run twice in a forward (a weight-tied block)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)
        self.act = nn.ReLU()
        self.head = nn.Linear(4, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.lin(self.act(self.lin(x)))))  # type: ignore[no-any-return]


def test_a_module_run_twice_gets_its_rule_at_each_run() -> None:
    torch.manual_seed(6)
    net = Twice().double()
    f, p = fp(net)
    x = TensorDict(input=torch.randn(5, 4, dtype=torch.float64), batch_size=[5])
    relevance = lrp(f, p, x, target=0, rules=LRP0, check_conservation=True)["input"]
    gxi = saliency(f, p, x, target=0, multiply_by_inputs=True)["input"]
    torch.testing.assert_close(relevance, gxi / f(p, x)["output"][:, :1], rtol=1e-8, atol=1e-10)


class Definition:
    """A rule seen only through ``relevance`` (no gradient form): lrp re-runs the module."""

    def __init__(self, rule: Any) -> None:
        self.rule = rule

    def relevance(self, call: Any, grad: torch.Tensor) -> Any:
        return self.rule.relevance(call, grad)


@pytest.mark.parametrize("rule", [Epsilon(), Epsilon(0.25), UniformEpsilon(0.1), AHQKV(), Pass()], ids=repr)
def test_the_gradient_form_of_a_rule_equals_its_definition(rule: Any) -> None:
    """NOTE [gradient-form rules], [zero-valued carriers]: the fast paths = the rule's relevance."""
    torch.manual_seed(7)
    net = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(48, 6), nn.Tanh(),
                        nn.Linear(6, 3)).double()
    f, p = fp(net)
    x = TensorDict(input=torch.randn(3, 1, 6, 6, dtype=torch.float64), batch_size=[3])
    where = {AHQKV: (nn.Linear,), Pass: (nn.ReLU, nn.Tanh)}.get(type(rule), (nn.Linear, nn.Conv2d))
    mapper = lambda wrap: EpsilonPlus(rule_mapper=lambda n, m: wrap(rule) if isinstance(m, where) else None)
    fast = lrp(f, p, x, target=(0, 2), rules=mapper(lambda r: r), per_target=True, layers=["[3]"],
               warn_on_missing_rule=False)
    slow = lrp(f, p, x, target=(0, 2), rules=mapper(Definition), per_target=True, layers=["[3]"],
               warn_on_missing_rule=False)
    assert_close_ulps(fast, slow, ulps=8)


def test_cotangents_and_per_target_set_the_relevance_put_in() -> None:
    """Relevance is linear in what the targets put in; the conservation check follows it."""
    net = bias_free_mlp([3, 5, 4], seed=8)
    f, p = fp(net)
    x = TensorDict(input=torch.rand(4, 3, dtype=torch.float64) + 0.5, batch_size=[4])
    assert bool((f(p, x)["output"][:, [0, 2]].abs() > 1e-3).all())  # conservation needs a live target
    twice = lambda v: v.apply(lambda t: torch.full_like(t, 2.0))
    doubled = lrp(f, p, x, target=0, rules=LRP0, cotangents=twice, check_conservation=True)
    single = lrp(f, p, x, target=0, rules=LRP0)
    torch.testing.assert_close(doubled["input"], 2 * single["input"])
    maps = lrp(f, p, x, target=(0, 2), rules=LRP0, per_target=True, check_conservation=True)
    torch.testing.assert_close(maps["input"].sum(-1), torch.ones(2, 4, dtype=torch.float64))


@pytest.mark.parametrize("rule", [ZPlus(), AlphaBeta(2.0, 1.0)], ids=repr)
def test_alpha_beta_skips_the_negative_half_after_a_relu_without_changing_a_value(
        rule: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from tdhook_fn.attribution._lrp import rules as _lrp_rules

    net = small_cnn(torch.float64)
    f, p = fp(net)
    x = TensorDict(input=torch.randn(4, 1, 6, 6, dtype=torch.float64), batch_size=[4])
    rules = {nn.Conv2d: rule, nn.Linear: Epsilon(), nn.ReLU: Pass()}
    asked: list[bool] = []
    real = _lrp_rules._no_negative_entry
    taps = rule_taps(f, rules, warn_on_missing_rule=False)

    def both_paths() -> tuple[torch.Tensor, torch.Tensor]:  # the chain walk's fused rule, and the taps' rule
        return (lrp(f, p, x, target=1, rules=rules, warn_on_missing_rule=False)["input"],
                saliency(f, p, x, target=1, taps=taps)["input"])

    monkeypatch.setattr(_lrp_rules, "_no_negative_entry", lambda t: asked.append(real(t)) or asked[-1])
    walked, tapped = both_paths()
    assert asked.count(True) >= 2 and asked.count(False) >= 2  # the raw input has negatives, the ReLU's output not
    monkeypatch.setattr(_lrp_rules, "_no_negative_entry", lambda t: False)
    walked_both, tapped_both = both_paths()
    assert torch.equal(tapped, tapped_both)
    # fused, the halves share one op and their sums round differently
    assert_close_ulps(walked, walked_both, ulps=64)
