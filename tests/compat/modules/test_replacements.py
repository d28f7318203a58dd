"""Replacements: a prepared module's calls with other weights, the model never written (NOTE [one scope])."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from zoo import same, snapshot

import tdhook_fn
from tdhook_fn.compat.contexts import HookingContextFactory
from tdhook_fn.compat.modules import Replacement, replacing

X = torch.randn(6, 4, generator=torch.Generator().manual_seed(5))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)).eval()


def doubled_last(model: nn.Module) -> Replacement:
    return model[3].weight, lambda value: 2 * value


def doubled_params(model: nn.Module) -> TensorDict:
    params = tdhook_fn.params(model)
    params.set(("3", "weight"), 2 * params.get(("3", "weight")))
    return params


class Replacing(HookingContextFactory):
    def __init__(self, replacement: Any) -> None:
        super().__init__()
        self._replacement = replacement

    def _prepare_module(self, module: Any, in_keys: Any, out_keys: Any, extra_relative_path: str) -> Any:
        return module.replacing([self._replacement(module.model)])


def run(hooked: Any) -> torch.Tensor:
    return hooked(TensorDict(input=X, batch_size=[6]))["output"]  # type: ignore[no-any-return]


def test_calls_use_the_transformed_params_and_gradients_reach_the_model() -> None:
    model = make_model()
    before = snapshot(model)
    expected = tdhook_fn.call(model, doubled_params(model), X)
    with Replacing(doubled_last).prepare(model) as hooked:
        out = run(hooked)
        assert torch.equal(out.detach(), expected)
        assert torch.equal(model(X), tdhook_fn.call(model, tdhook_fn.params(model), X))  # the raw model is plain
        assert same(before, snapshot(model))
        out.sum().backward()
    twin = copy.deepcopy(model)
    twin[3].weight.grad = None
    with torch.no_grad():
        twin[3].weight.mul_(2)
    twin(X).sum().backward()
    assert model[3].weight.grad is not None and twin[3].weight.grad is not None
    assert torch.allclose(model[3].weight.grad, 2 * twin[3].weight.grad)  # d(2w)/dw
    assert torch.allclose(model[0].weight.grad, twin[0].weight.grad)  # type: ignore[arg-type]


def test_replacing_applies_in_its_thread_only() -> None:
    model = make_model()
    plain = tdhook_fn.call(model, tdhook_fn.params(model), X)
    doubled = tdhook_fn.call(model, doubled_params(model), X)
    seen: list[torch.Tensor] = []
    with HookingContextFactory().prepare(model) as hooked:
        inside, outside = threading.Event(), threading.Event()

        def other() -> None:
            inside.wait()
            seen.append(run(hooked).detach())
            outside.set()

        thread = threading.Thread(target=other)
        thread.start()
        with replacing(doubled_last(model)):
            inside.set()
            outside.wait()
            assert torch.equal(run(hooked).detach(), doubled)
        thread.join()
        assert torch.equal(run(hooked).detach(), plain)
    assert torch.equal(seen[0], plain)


def test_buffers_stay_live() -> None:
    """In training mode BatchNorm updates the model's statistics, as a plain forward does."""
    model, twin = make_model().train(), make_model().train()
    with torch.no_grad():
        twin[3].weight.mul_(2)
    expected = twin(X)
    with Replacing(doubled_last).prepare(model) as hooked:
        assert torch.equal(run(hooked).detach(), expected.detach())
    for (name, buffer), (_, ref) in zip(model.named_buffers(), twin.named_buffers(), strict=True):
        assert torch.equal(buffer, ref), name
    assert int(model[1].num_batches_tracked) == 1


def test_a_replacement_must_keep_the_shape_and_acts_on_its_own_model_only() -> None:
    model, other = make_model(), make_model()
    before = snapshot(model)
    reshaped = lambda m: (m[3].weight, lambda value: torch.zeros(4, 4))
    with Replacing(reshaped).prepare(model) as hooked, pytest.raises(ValueError, match=r"3\.weight' has shape"):
        run(hooked)
    plain = tdhook_fn.call(model, tdhook_fn.params(model), X)
    with HookingContextFactory().prepare(model) as hooked:  # nothing left behind on the shadow
        assert torch.equal(run(hooked), plain)
        with replacing(doubled_last(other)):  # keyed by identity: another model's parameter
            assert torch.equal(run(hooked), plain)
    assert same(before, snapshot(model))


def test_replacements_compose_in_order_and_params_see_them() -> None:
    model = make_model()
    weight = model[3].weight
    plus_one, doubled = (weight, lambda value: value + 1), (weight, lambda value: 2 * value)
    expected = doubled_params(model)
    expected.set(("3", "weight"), 2 * (weight.detach() + 1))
    with HookingContextFactory().prepare(model) as hooked, replacing(plus_one, doubled):
        assert torch.equal(run(hooked).detach(), tdhook_fn.call(model, expected, X))
        routed = hooked.td_module
        assert torch.equal(routed.params(detach=True).get(("3", "weight")), expected.get(("3", "weight")))
        live = routed.params().get(("3", "weight"))
        assert live.requires_grad and torch.equal(live.detach(), expected.get(("3", "weight")))


def test_a_hooked_module_of_a_routed_module_routes_once() -> None:
    """A HookedModule made without a context over a RoutedModule runs it (hooks fire, replacements apply)."""
    from tensordict.nn import TensorDictModule

    from tdhook_fn.compat.modules import HookedModule, RoutedModule

    model = make_model()
    routed = RoutedModule(TensorDictModule(model, ["input"], ["output"])).replacing([doubled_last(model)])
    hooked = HookedModule(routed)
    hooked.set("module[2]", None, callback=lambda output, **kw: torch.ones_like(output))
    expected = torch.nn.functional.linear(torch.ones(6, 4), 2 * model[3].weight, model[3].bias)
    assert torch.equal(run(hooked).detach(), expected.detach())


def test_keys_found_once_follow_a_swapped_or_moved_parameter() -> None:
    """NOTE [replaced keys]: the keys kept from an earlier call are checked by identity at each call."""
    model = make_model()
    with Replacing(doubled_last).prepare(model) as hooked:
        assert torch.equal(run(hooked), tdhook_fn.call(model, doubled_params(model), X))
        assert torch.equal(run(hooked), tdhook_fn.call(model, doubled_params(model), X))  # (the keys kept)
        replaced = model[3].weight
        model[3].weight = nn.Parameter(replaced.detach() + 1)  # swapped out: the new weight is not replaced
        assert torch.equal(run(hooked), tdhook_fn.call(model, tdhook_fn.params(model), X))
        model[3] = nn.Sequential(nn.Linear(4, 2))  # the replaced tensor at another key
        model[3][0].weight = replaced
        params = tdhook_fn.params(model)
        params.set(("3", "0", "weight"), 2 * params.get(("3", "0", "weight")))
        assert torch.equal(run(hooked), tdhook_fn.call(model, params, X))
