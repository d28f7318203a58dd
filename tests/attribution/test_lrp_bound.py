"""The bound walk (NOTE [a bound walk]): the records' numbers, bit for bit, where an int target takes it.

A tensor target of one class per sample puts in the same one-hot by the engine's selection
and takes the planned walk's records; the same model, params and inputs then run the same
ops on the same shapes, so the maps must be equal, not close.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import AHQKV, Epsilon, EpsilonPlus, Pass, UniformEpsilon, lrp
from tdhook_fn.attribution._lrp.rules import divide_stabilized, stabilize

chain_module = importlib.import_module("tdhook_fn.attribution._lrp.chain")
lrp_plan_module = importlib.import_module("tdhook_fn.attribution._lrp.plan")
pytestmark = pytest.mark.filterwarnings("ignore:lrp. no rule:UserWarning")


@dataclass(frozen=True)
class HalfEpsilon(Epsilon):
    """An epsilon whose output factor is its own: the walk multiplies by it (no division, no in-place epsilon)."""

    def output_factor(self, path: str, n_inputs: int, output: torch.Tensor) -> torch.Tensor:
        return 0.5 * super().output_factor(path, n_inputs, output)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Linear(9, 9), nn.Tanh(), nn.Linear(9, 8), nn.Linear(8, 4))


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3, stride=2),
                         nn.ReLU(), nn.Flatten(), nn.Identity(), nn.Linear(4, 3))


CASES: list[tuple[Any, tuple[int, ...], Any]] = [
    (_mlp, (5, 6), EpsilonPlus()),
    (_mlp, (5, 6), {"0": UniformEpsilon(0.1), "2": AHQKV(), "4": HalfEpsilon(), nn.ReLU: Pass(), nn.Tanh: Pass()}),
    (_mlp, (5, 6), {"0": Epsilon(1e-9), nn.ReLU: Pass(), nn.Tanh: Pass()}),  # no rule on three layers: J^T alone
    (_cnn, (3, 2, 6, 6), EpsilonPlus()),  # fused z+ on the convolutions, pooling, reshapes
    (_cnn, (3, 2, 6, 6), {nn.Conv2d: Epsilon(), nn.Linear: Epsilon(), nn.ReLU: Pass()}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("make", "shape", "rules"), CASES,
                         ids=["epsilon-plus", "custom-forms", "no-rule-layers", "cnn-z+", "cnn-epsilon"])
def test_the_bound_walk_gives_the_records_bits(monkeypatch: pytest.MonkeyPatch, make: Any, shape: tuple[int, ...],
                                               rules: Any, dtype: torch.dtype) -> None:
    bound: list[bool] = []
    original = chain_module.run_bound
    monkeypatch.setattr(chain_module, "run_bound", lambda *a: bound.append(True) or original(*a))
    planned: list[bool] = []
    original_planned = chain_module.run_planned
    monkeypatch.setattr(chain_module, "run_planned", lambda *a: planned.append(True) or original_planned(*a))
    f, p = tdhook_fn.pure(make().to(dtype).eval())
    x = torch.randn(shape, dtype=dtype)
    x[0, 0] = -0.0  # (a signed zero where the first layer's inputs are read)
    td = TensorDict(input=x, batch_size=shape[:1])
    by_int = lrp(f, p, td, target=1, rules=rules, warn_on_missing_rule=False)["input"]
    by_tensor = lrp(f, p, td, target=torch.ones(shape[0], dtype=torch.long), rules=rules,
                    warn_on_missing_rule=False)["input"]
    assert bound == [True] and planned == [True]
    assert torch.equal(by_int, by_tensor)
    assert by_int.abs().sum() > 0


def test_the_bound_walk_writes_nothing_it_is_given() -> None:
    f, p = tdhook_fn.pure(_mlp().double().eval())
    x = torch.randn(5, 6, dtype=torch.float64)
    before, params_before = x.clone(), p.clone()
    maps = lrp(f, p, TensorDict(input=x, batch_size=[5]), target=0, rules=EpsilonPlus())["input"]
    assert torch.equal(x, before) and (p == params_before).all()
    assert maps.data_ptr() != x.data_ptr()


def test_the_composites_plan_key_holds_each_of_its_fields() -> None:
    """`EpsilonPlus` is keyed by its numbers: a new field would have to join the key."""
    assert [field.name for field in fields(EpsilonPlus)] == ["epsilon", "stabilizer", "rule_mapper"]
    key = lrp_plan_module._rules_key
    assert key(EpsilonPlus()) == key(EpsilonPlus(1e-6, 1e-6))
    assert len({key(EpsilonPlus()), key(EpsilonPlus(epsilon=0.5)), key(EpsilonPlus(stabilizer=0.5))}) == 3
    assert key(EpsilonPlus(rule_mapper=lambda _name, _module: None)) is None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal, NaNs in the same places and every sign the same (signed zeros included)."""
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(a.signbit(), b.signbit())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_stabilised_division_in_place_is_the_plain_ones(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    t = torch.tensor([-2.0, -0.0, 0.0, 3.0, 1e-7, -1e-7, float("nan"), float("inf"), -float("inf")], dtype=dtype)
    t = torch.cat([t, torch.randn(55, dtype=dtype)]).reshape(8, 8)
    relevance = torch.randn(8, 8, dtype=dtype)
    relevance[0, :3] = 0.0
    for view in (t, t.t()):  # (a non-contiguous t too: the walk's fused z are narrowed views)
        _same_bits(divide_stabilized(relevance, view, 1e-6), relevance / stabilize(view, 1e-6))
    _same_bits(divide_stabilized(relevance[:1], t, 0.5), relevance[:1] / stabilize(t, 0.5))  # (a broadcast)
    other = relevance.to(torch.float32 if dtype == torch.float64 else torch.float64)
    _same_bits(divide_stabilized(other, t, 0.5), other / stabilize(t, 0.5))  # (another dtype)
