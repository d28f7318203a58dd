"""Plans per model (NOTE [plans per model]): served while the model is unchanged, rebuilt after any change.

Each change is made between two calls on one model and one Functional; the second call
must give the maps of a fresh copy of the changed model (which no plan has seen), and the
plan must have been rebuilt (a spy counts the builds).
"""

from __future__ import annotations

import copy
import gc
import importlib
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn import _model_plans
from tdhook_fn.attribution import Epsilon, EpsilonPlus, Pass, deeplift, lrp

lrp_plan_module = importlib.import_module("tdhook_fn.attribution._lrp.plan")
chain_walk_module = importlib.import_module("tdhook_fn.attribution._chain_walk")
pytestmark = pytest.mark.filterwarnings("ignore:lrp. no rule:UserWarning")


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3)).double().eval()


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The plans built, by method."""
    seen: list[str] = []
    lrp_build, walk_build = lrp_plan_module._build, chain_walk_module._plan
    monkeypatch.setattr(lrp_plan_module, "_build", lambda *a: seen.append("lrp") or lrp_build(*a))
    monkeypatch.setattr(chain_walk_module, "_plan", lambda *a: seen.append("deeplift") or walk_build(*a))
    yield seen


def _maps(model: nn.Module, x: torch.Tensor, rules: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    f, p = tdhook_fn.pure(model)
    td = TensorDict(input=x, batch_size=x.shape[:1])
    return (lrp(f, p, td, target=1, rules=EpsilonPlus() if rules is None else rules)["input"],
            deeplift(f, p, td, target=1)["input"])


def _check_change(builds: list[str], change: Callable[[nn.Sequential], object]) -> None:
    model = mlp()
    x = torch.randn(5, 4, dtype=torch.float64)
    _maps(model, x)
    _maps(model, x)
    assert builds == ["lrp", "deeplift"]  # built once, served the second time
    change(model)
    with torch.no_grad():
        ours = _maps(model, x)
        fresh = _maps(copy.deepcopy(model), x)
    assert builds.count("lrp") >= 2 and builds.count("deeplift") >= 2  # (the copy builds its own too)
    for a, b in zip(ours, fresh, strict=True):
        torch.testing.assert_close(a, b)


def _set_child(model: nn.Sequential) -> None:
    model[1] = nn.Tanh()


def _set_class(model: nn.Sequential) -> None:
    model[3].__class__ = nn.Sigmoid


def _set_attribute(model: nn.Sequential) -> None:
    model[1].inplace = True


def _set_parameter(model: nn.Sequential) -> None:
    model[2].bias = None


def _add_module(model: nn.Sequential) -> None:
    model.append(nn.Tanh())


def _train(model: nn.Sequential) -> None:
    model.insert(2, nn.Dropout(0.0))
    model.train()


@pytest.mark.parametrize("change", [_set_child, _set_class, _set_attribute, _set_parameter, _add_module, _train],
                         ids=["child", "class", "attribute", "parameter", "module added", "train mode"])
def test_a_change_of_the_model_builds_a_new_plan(builds: list[str], change: Callable[[nn.Sequential], object]) -> None:
    _check_change(builds, change)


def test_a_hook_takes_the_general_path_and_its_removal_the_walk_again(builds: list[str]) -> None:
    model = mlp()
    x = torch.randn(3, 4, dtype=torch.float64)
    clean = _maps(model, x)
    handle = model[2].register_forward_hook(lambda _m, _a, out: out * 2.0)
    hooked = _maps(model, x)
    handle.remove()
    again = _maps(model, x)
    assert not torch.allclose(clean[0], hooked[0])
    for a, b in zip(clean, again, strict=True):
        torch.testing.assert_close(a, b)


def test_a_changed_parameter_shape_is_seen_at_the_next_call() -> None:
    model = mlp()
    x = torch.randn(3, 4, dtype=torch.float64)
    f, p = tdhook_fn.pure(model)
    td = TensorDict(input=x, batch_size=[3])
    lrp(f, p, td, target=0, rules=EpsilonPlus())
    with torch.no_grad():  # (the module's slots do not change: only the tensor's shape)
        model[4].weight.data = torch.randn(3, 7, dtype=torch.float64)
    with pytest.raises((ValueError, RuntimeError, KeyError)):
        lrp(f, p, td, target=0, rules=EpsilonPlus())  # the old params no longer fit the model: as without a plan


def test_mapping_rules_changed_in_place_are_seen(builds: list[str]) -> None:
    model = mlp()
    x = torch.randn(3, 4, dtype=torch.float64)
    rules: dict[Any, Any] = {nn.Linear: Epsilon(1e-6), nn.ReLU: Pass()}
    first = _maps(model, x, rules)[0]
    rules[nn.Linear] = Epsilon(0.5)
    second = _maps(model, x, rules)[0]
    fresh = _maps(copy.deepcopy(model), x, dict(rules))[0]
    assert not torch.allclose(first, second)
    torch.testing.assert_close(second, fresh)


def test_a_rule_mapper_is_asked_at_every_call(builds: list[str]) -> None:
    model = mlp()
    x = torch.randn(3, 4, dtype=torch.float64)
    epsilon = [1e-6]

    def mapper(_name: str, module: nn.Module) -> Any:
        return Epsilon(epsilon[0]) if isinstance(module, nn.Linear) else Pass() if isinstance(module, nn.ReLU) else None

    first = _maps(model, x, mapper)[0]
    epsilon[0] = 0.5
    second = _maps(model, x, mapper)[0]
    torch.testing.assert_close(second, _maps(model, x, {nn.Linear: Epsilon(0.5), nn.ReLU: Pass()})[0])
    assert not torch.allclose(first, second)


def test_a_model_holding_other_values_gets_no_snapshot() -> None:
    model = mlp()
    assert _model_plans.Snapshot.of(model) is not None
    model[1].table = [1, 2]  # a list: mutable, so never trusted
    assert _model_plans.Snapshot.of(model) is None
    model = mlp()
    model[1].owner = lambda: model  # a function may refer to the model: never held
    assert _model_plans.Snapshot.of(model) is None


def test_a_snapshot_sees_each_kind_of_change() -> None:
    changes: list[Callable[[nn.Sequential], object]] = [
        _set_child, _set_class, _set_attribute, _set_parameter, _add_module, lambda m: m.train(),
        lambda m: m[0].register_buffer("scale", torch.ones(())), lambda m: setattr(m[1], "extra", 1.5),
        lambda m: m[2].register_forward_pre_hook(lambda *_a: None), lambda m: delattr(m[4], "bias"),
    ]
    for change in changes:
        model = mlp()
        snapshot = _model_plans.Snapshot.of(model)
        assert snapshot is not None and snapshot.holds()
        change(model)
        assert not snapshot.holds()


def test_a_global_hook_breaks_every_snapshot() -> None:
    model = mlp()
    snapshot = _model_plans.Snapshot.of(model)
    assert snapshot is not None
    handle = nn.modules.module.register_module_forward_hook(lambda *_a: None)
    try:
        assert not snapshot.holds() and _model_plans.Snapshot.of(model) is None
    finally:
        handle.remove()
    assert snapshot.holds()


def test_plans_do_not_keep_the_model_alive() -> None:
    model = mlp()
    _maps(model, torch.randn(3, 4, dtype=torch.float64))
    assert model in _model_plans._plans
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("register", ["_register_state_dict_hook", "register_load_state_dict_post_hook"])
def test_a_state_dict_hook_referring_to_the_model_does_not_keep_it_alive(register: str) -> None:
    model = mlp()
    owner = [model]  # (the hook holds the model, as a hook written as a closure over it does)
    getattr(model[-1], register)(lambda *_a, _owner=owner, **_k: None)
    x = torch.randn(3, 4, dtype=torch.float64)
    before, again = _maps(model, x), _maps(model, x)
    assert all(torch.equal(a, b) for a, b in zip(before, again, strict=True))
    gone = weakref.ref(model)
    del model, owner
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("register", ["register_forward_hook", "_register_state_dict_hook"])
def test_a_hook_added_after_a_plan_does_not_keep_the_model_alive(register: str) -> None:
    model = mlp()
    x = torch.randn(3, 4, dtype=torch.float64)
    _maps(model, x)  # (a plan and its snapshot are cached)
    owner = [model]
    getattr(model[-1], register)(lambda *_a, _owner=owner, **_k: None)
    _maps(model, x)  # (the snapshot fails; the model now gets none, and the stale entry must go)
    gone = weakref.ref(model)
    del model, owner
    gc.collect()
    assert gone() is None


class _Holder(nn.Module):
    """A module with no parameters or buffers: an entry moved into its slot keeps the model's flat names and values."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _nested() -> nn.Sequential:
    return nn.Sequential(nn.Sequential(nn.ReLU()), _Holder())


def _move_child(model: nn.Sequential) -> None:
    model[1].add_module("0", model[0]._modules.pop("0"))


def _swap_unread_container_for_attribute(model: nn.Sequential) -> None:
    del model[0]._state_dict_hooks  # (a container no plan reads: its value is not compared)
    model[0].extra = 1.5  # (the same number of attributes)


def _swap_hook_container_for_attribute(model: nn.Sequential) -> None:
    del model[0]._forward_hooks_always_called  # (a container read only as empty)
    model[0].extra = 1.5  # (the same number of attributes)


def _swap_buffer_names_for_attribute(model: nn.Sequential) -> None:
    del model[0]._non_persistent_buffers_set
    model[0].extra = 1.5


def _replace_hook_dict(model: nn.Sequential) -> None:
    model[0]._forward_hooks = OrderedDict({0: lambda *_a: None})


def _same_parameter_kind(model: nn.Sequential) -> None:
    model[0].weight = nn.Parameter(model[0].weight.detach().clone())


@pytest.mark.parametrize(("make", "change"), [
    (_nested, _move_child), (mlp, _swap_unread_container_for_attribute), (mlp, _replace_hook_dict),
    (mlp, _same_parameter_kind), (mlp, lambda m: setattr(m[1], "inplace", 0)),
    (mlp, lambda m: m[0]._parameters.update(weight=m[0]._parameters.pop("weight"))),
    (mlp, _swap_hook_container_for_attribute), (mlp, _swap_buffer_names_for_attribute),
    (mlp, lambda m: m[0]._forward_hooks_with_kwargs.update({0: True})),
], ids=["entry moved between slots", "unread container for an attribute", "hook dict replaced",
        "parameter replaced", "value equal but not identical", "parameter order", "hook container for an attribute",
        "buffer names for an attribute", "a hook mark alone"])
def test_what_the_flat_check_could_miss_it_sees(make: Callable[[], nn.Sequential],
                                                change: Callable[[nn.Sequential], object]) -> None:
    # NOTE [one flat check]: the changes a cheaper comparison would read as none
    model = make()
    snapshot = _model_plans.Snapshot.of(model)
    assert snapshot is not None and snapshot.holds()
    change(model)
    assert not snapshot.holds()


def test_the_flat_check_holds_across_calls_and_unread_changes(builds: list[str]) -> None:
    model = mlp()
    x = torch.randn(3, 4, dtype=torch.float64)
    snapshot = _model_plans.Snapshot.of(model)
    assert snapshot is not None
    for _ in range(3):
        _maps(model, x)  # (a call swaps the params in and back: the same objects, under the same names)
    assert snapshot.holds() and builds == ["lrp", "deeplift"]
    model[1].__dict__ = dict(reversed(vars(model[1]).items()))  # (another dict, the same attributes)
    model[2]._state_dict_hooks = OrderedDict()  # (a container no plan reads)
    assert snapshot.holds()
