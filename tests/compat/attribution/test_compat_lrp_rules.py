"""tdhook's rule API (``Rule.register(module)``) in compat: tdhook 0.1.3's numbers, the core's VJPs, clean removal.

The oracle is tdhook 0.1.3 itself (its rules registered on a twin module); the core
check compares a registered chain with `tdhook_fn.attribution.lrp`. zennit is compared
in ``test_compat_lrp_rules_zennit.py``.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tdhook.attribution.lrp_helpers import rules as ref_rules
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn import attribution
from tdhook_fn.compat.attribution import LRP
from tdhook_fn.compat.attribution.lrp_helpers import rules as our_rules

Factory = Callable[[], nn.Module]


def _seeded(make: Callable[[], nn.Module]) -> Factory:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return make().double()

    return build


linear = _seeded(lambda: nn.Linear(6, 5))
square = _seeded(lambda: nn.Linear(5, 5))
conv = _seeded(lambda: nn.Conv1d(3, 4, 3, padding=1))
qkv = _seeded(lambda: nn.Linear(6, 12))
norm = _seeded(lambda: nn.LayerNorm(5))
softmax = _seeded(lambda: nn.Softmax(-1))

# (rule class, its arguments, module factory, input shape)
CASES: list[tuple[str, tuple[Any, ...], Factory, tuple[int, ...]]] = [
    ("EpsilonRule", (1e-6,), linear, (4, 6)),
    ("EpsilonRule", (0.1,), conv, (2, 3, 7)),
    ("UniformEpsilonRule", (1e-6,), linear, (4, 6)),
    ("SoftmaxEpsilonRule", (), softmax, (4, 5)),
    ("PassRule", (), square, (4, 5)),
    ("StopRule", (), linear, (4, 6)),
    ("UniformRule", (), square, (4, 5)),
    ("WSquareRule", (1e-6,), linear, (4, 6)),
    ("WSquareRule", (1e-6,), conv, (2, 3, 7)),
    ("FlatRule", (1e-6,), conv, (2, 3, 7)),
    ("AlphaBetaRule", (2.0, 1.0), linear, (4, 6)),
    ("AlphaBetaRule", (1.0, 0.0), conv, (2, 3, 7)),
    ("LayerNormRule", (), norm, (4, 5)),
    ("PseudoIdentityRule", (1e-6,), square, (4, 5)),
    ("AHQKVRule", (), qkv, (4, 6)),
]


def _relevance(module: nn.Module, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor | None:
    x = x.clone().requires_grad_()
    module(x).backward(r)
    return x.grad


@pytest.mark.parametrize(("name", "args", "make", "shape"), CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_registered_rule_equals_tdhook(name: str, args: tuple[Any, ...], make: Factory,
                                       shape: tuple[int, ...]) -> None:
    torch.manual_seed(1)
    x = torch.randn(shape, dtype=torch.float64)
    ours_module, theirs_module = make(), make()
    r = torch.randn_like(ours_module(x))
    with getattr(our_rules, name)(*args).register(ours_module):
        ours = _relevance(ours_module, x, r)
    handle = getattr(ref_rules, name)(*args).register(theirs_module)
    theirs = _relevance(theirs_module, x, r)
    handle.remove()
    if theirs is None:  # StopRule: nothing reaches the input
        assert ours is None
        return
    assert ours is not None
    # tdhook rounds epsilon to float32 (see docs/compat.md): up to ~1e-6 relative where an output is near 0
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-10)


def test_registered_chain_equals_the_core_lrp() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3), nn.Tanh()).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    r = torch.randn(4, 3, dtype=torch.float64)
    handles = [our_rules.EpsilonRule(1e-3).register(model[0]), our_rules.PassRule().register(model[1]),
               our_rules.AlphaBetaRule(1.0, 0.0).register(model[2]), our_rules.PassRule().register(model[3])]
    registered = _relevance(model, x, r)
    for handle in handles:
        handle.remove()
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    rules = {"[0]": attribution.Epsilon(1e-3), "[1]": attribution.Pass(), "[2]": attribution.ZPlus(),
             "[3]": attribution.Pass()}
    core = attribution.lrp(f, p, TensorDict(input=x, batch_size=[4]), target=lambda out: out, rules=rules,
                           cotangents=lambda targets: TensorDict(output=r, batch_size=[4]))
    assert registered is not None
    torch.testing.assert_close(registered, core["input"], rtol=1e-12, atol=1e-14)


def _snapshot(module: nn.Module) -> tuple[Any, ...]:
    return (dict(module.__dict__.items()), {k: len(v) for k, v in module.__dict__.items() if k.endswith("hooks")},
            {k: v.clone() for k, v in module.state_dict().items()}, module.forward)


def _same(module: nn.Module, before: tuple[Any, ...]) -> None:
    state, hooks, tensors, forward = _snapshot(module)
    assert state.keys() == before[0].keys()
    assert all(state[k] is before[0][k] for k in state if not k.endswith("hooks"))
    assert hooks == before[1]
    assert tensors.keys() == before[2].keys()
    assert all(torch.equal(tensors[k], before[2][k]) for k in tensors)
    assert forward == before[3]


def test_register_and_remove_restore_the_module() -> None:
    module = linear()
    before = _snapshot(module)
    rule = our_rules.EpsilonRule()
    handle = rule.register(module)
    assert isinstance(handle, our_rules.RemovableRuleHandle)
    assert handle._rule is rule and handle._module_ref() is module
    assert module._forward_hooks and module._forward_pre_hooks
    _relevance(module, torch.randn(2, 6, dtype=torch.float64), torch.ones(2, 5, dtype=torch.float64))
    handle.remove()
    _same(module, before)
    handle.remove()  # twice: nothing to do
    rule.register(module)
    rule.unregister(module)  # tdhook's other way out
    _same(module, before)
    with rule.register(module) as entered:
        assert entered.__class__ is our_rules.RemovableRuleHandle
    _same(module, before)
    with pytest.raises(ValueError, match="not registered"):
        rule.unregister(module)


def test_a_removed_handle_leaves_a_later_registration_alone() -> None:
    module, rule = linear(), our_rules.EpsilonRule()
    old = rule.register(module)
    old.remove()
    rule.register(module)
    hooks = len(module._forward_hooks)
    old.remove()
    assert len(module._forward_hooks) == hooks > 0
    rule.unregister(module)
    assert len(module._forward_hooks) == 0


def test_handle_of_a_dead_module_and_ignore_rule() -> None:
    module = linear()
    handle = our_rules.EpsilonRule().register(module)
    del module
    gc.collect()
    assert handle._module_ref() is None  # a registration keeps no module alive
    handle.remove()  # the module is gone: nothing to do
    module = linear()
    before = _snapshot(module)
    with our_rules.IgnoreRule().register(module):  # registers nothing: the plain gradient
        _same(module, before)
        x = torch.randn(2, 6, dtype=torch.float64)
        torch.testing.assert_close(_relevance(module, x, torch.ones(2, 5, dtype=torch.float64)),
                                   torch.ones(2, 5, dtype=torch.float64) @ module.weight.detach())
    our_rules.IgnoreRule().unregister(module)


def test_parameters_are_constants_under_a_rule() -> None:
    module = linear()
    with our_rules.EpsilonRule().register(module), our_rules.EpsilonRule().register(nn.Identity()):
        x = torch.randn(2, 6, dtype=torch.float64)
        assert not module(x).requires_grad  # the input does not require grad: nor does the output
        with torch.no_grad():
            assert not module(x.requires_grad_()).requires_grad
        module(x).sum().backward()
        assert x.grad is not None
        assert all(p.grad is None for p in module.parameters())


def test_settings_are_read_at_each_call() -> None:
    ours_module, theirs_module = linear(), linear()
    ours, theirs = our_rules.EpsilonRule(1e-6), ref_rules.EpsilonRule(1e-6)
    x, r = torch.randn(3, 6, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    with ours.register(ours_module):
        theirs.register(theirs_module)
        ours.epsilon = theirs.epsilon = 10.0
        torch.testing.assert_close(_relevance(ours_module, x, r), _relevance(theirs_module, x, r), rtol=1e-7,
                                   atol=1e-12)


def test_keyword_arguments_reach_the_module() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4, bias=False).double()

        def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            return self.lin(x) * scale

    module = Scaled()
    x = torch.randn(2, 4, dtype=torch.float64)
    with our_rules.EpsilonRule(1e-9).register(module):
        y = module(x, scale=3.0)
        torch.testing.assert_close(y, module.lin(x).detach() * 3.0)
        assert _relevance(module, x, torch.ones(2, 4, dtype=torch.float64)) is not None


def test_threads_share_a_registered_module() -> None:
    module, rule = linear(), our_rules.AlphaBetaRule()
    xs = [torch.randn(8, 6, dtype=torch.float64) for _ in range(4)]
    r = torch.ones(8, 5, dtype=torch.float64)
    with rule.register(module):
        alone = [_relevance(module, x, r) for x in xs]
        together: list[torch.Tensor | None] = [None] * len(xs)

        def work(i: int) -> None:
            for _ in range(5):
                together[i] = _relevance(module, xs[i], r)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for a, b in zip(alone, together, strict=True):
        assert a is not None and b is not None
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_conservation_hook() -> None:
    torch.manual_seed(3)
    module = nn.Linear(5, 5, bias=False).double()
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 5, dtype=torch.float64)
    module.register_full_backward_hook(our_rules.raise_for_unconserved_rel_factory())
    with pytest.raises(RuntimeError, match="Unconserved relevance for module Linear"):
        module(x).backward(r)  # a plain gradient does not conserve
    for rule in (our_rules.EpsilonRule(0.0), our_rules.PassRule()):
        with rule.register(module):
            module(x).backward(r)  # conserving rules on a bias-free layer: no error
    hook = our_rules.raise_for_unconserved_rel_factory(atol=0.1, rtol=0.0)
    hook(module, (torch.ones(2), None), (torch.full((4,), 0.5),))  # 2 and 2: fine; None holds nothing
    with pytest.raises(RuntimeError, match="the inputs hold 2.*the outputs 2.5"):
        hook(module, torch.ones(2), torch.full((5,), 0.5))


def test_call_time_errors_are_tdhooks() -> None:
    class Two(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a + b

    two = Two()
    for rule in (our_rules.AlphaBetaRule(), our_rules.LayerNormRule(), our_rules.PseudoIdentityRule()):
        with rule.register(two), pytest.raises(NotImplementedError, match="does not support multiple inputs"):
            two(torch.ones(2), torch.ones(2))
    with our_rules.PassRule().register(two), pytest.raises(ValueError, match="number of inputs and outputs"):
        two(torch.ones(2), torch.ones(2))
    layer = linear()
    with our_rules.PassRule().register(layer), pytest.raises(ValueError, match=r"Input \(shape=.*different shapes"):
        layer(torch.ones(6, dtype=torch.float64))
    with our_rules.EpsilonRule().register(two), pytest.raises(TypeError, match="one tensor returned"):
        two(torch.ones(2), 3.0)


def test_registration_errors() -> None:
    module = linear()
    with our_rules.EpsilonRule().register(module), pytest.raises(ValueError, match="already has EpsilonRule"):
        our_rules.PassRule().register(module)
    with pytest.raises(TypeError, match="nn.Module"):
        our_rules.EpsilonRule().register(lambda x: x)  # type: ignore[arg-type]

    class Custom(our_rules.Rule):
        pass

    with pytest.raises(TypeError, match="stands for no tdhook_fn rule"):
        Custom().register(linear())


def test_rules_do_not_nest_or_enter_pure_calls() -> None:
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU()).double()
    x = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    before = _snapshot(model)
    with our_rules.EpsilonRule().register(model), our_rules.EpsilonRule().register(model[0]):
        with pytest.raises(ValueError, match="rules may not nest"):
            model(x)
    _same(model, before)
    with our_rules.EpsilonRule().register(model[0]):
        f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
        with pytest.raises(RuntimeError, match="inside a tdhook_fn pure function"):
            attribution.saliency(f, p, TensorDict(input=x.detach().requires_grad_(), batch_size=[2]), target=0)
        lrp = LRP(rule_mapper=our_rules.EpsilonPlus(), skip_modules=LRP.default_skip)
        with lrp.prepare(model) as hooked, pytest.raises(RuntimeError, match="give it to LRP's rule_mapper"):
            hooked(TensorDict(input=x.detach(), batch_size=[2]))
    _same(model, before)


class _Blend(nn.Module):
    """Two inputs, one output: ``tanh(a) * b + a``."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.tanh(a) * b + a


@pytest.mark.parametrize("name", ["UniformRule", "UniformEpsilonRule", "EpsilonRule", "StopRule"])
def test_rules_with_two_inputs_equal_tdhook(name: str) -> None:
    torch.manual_seed(4)
    a, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    r = torch.randn(3, 4, dtype=torch.float64)
    grads = []
    for lib in (our_rules, ref_rules):
        module = _Blend()
        handle = getattr(lib, name)().register(module)
        ins = [a.clone().requires_grad_(), b.clone().requires_grad_()]
        module(*ins).backward(r)
        handle.remove()
        grads.append([t.grad for t in ins])
    for ours, theirs in zip(*grads, strict=True):
        if theirs is None:
            assert ours is None
        else:
            torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["EpsilonRule", "AlphaBetaRule", "WSquareRule"])
def test_registered_rules_under_torch_func(name: str) -> None:
    module = linear()
    x = torch.randn(3, 6, dtype=torch.float64)
    with getattr(our_rules, name)().register(module):
        eager = _relevance(module, x, torch.ones(3, 5, dtype=torch.float64))
        by_grad = torch.func.grad(lambda t: module(t).sum())(x)
        per_sample = torch.func.vmap(torch.func.grad(lambda t: module(t).sum()))(x)
    assert eager is not None
    torch.testing.assert_close(by_grad, eager, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(per_sample, eager, rtol=1e-12, atol=1e-14)
    assert not by_grad.requires_grad  # the parameters are constants: no graph reaches them
