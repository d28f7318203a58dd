"""Params transforms: a prepared module's calls with other weights, the model never written."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from zoo import same, snapshot

import tdhook_fn
from tdhook_fn.compat.contexts import HookingContextFactory
from tdhook_fn.compat.modules import ParamsTransform, transforming_params

X = torch.randn(6, 4, generator=torch.Generator().manual_seed(5))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)).eval()


def doubled_last(model: nn.Module, params: TensorDictBase) -> TensorDictBase:
    result = params.clone(False)
    result.set(("3", "weight"), 2 * params.get(("3", "weight")))
    return result


class Transformed(HookingContextFactory):
    def __init__(self, transform: ParamsTransform) -> None:
        super().__init__()
        self._transform = transform

    def _prepare_module(self, module: Any, in_keys: Any, out_keys: Any, extra_relative_path: str) -> Any:
        return module.with_params_transform(self._transform)


def run(hooked: Any) -> torch.Tensor:
    return hooked(TensorDict(input=X, batch_size=[6]))["output"]  # type: ignore[no-any-return]


def test_calls_use_the_transformed_params_and_gradients_reach_the_model() -> None:
    model = make_model()
    before = snapshot(model)
    expected = tdhook_fn.call(model, doubled_last(model, tdhook_fn.params(model)), X)
    with Transformed(doubled_last).prepare(model) as hooked:
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


def test_transforming_params_applies_in_its_thread_only() -> None:
    model = make_model()
    plain = tdhook_fn.call(model, tdhook_fn.params(model), X)
    doubled = tdhook_fn.call(model, doubled_last(model, tdhook_fn.params(model)), X)
    seen: list[torch.Tensor] = []
    with HookingContextFactory().prepare(model) as hooked:
        inside, outside = threading.Event(), threading.Event()

        def other() -> None:
            inside.wait()
            seen.append(run(hooked).detach())
            outside.set()

        thread = threading.Thread(target=other)
        thread.start()
        with transforming_params(doubled_last):
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
    with Transformed(doubled_last).prepare(model) as hooked:
        assert torch.equal(run(hooked).detach(), expected.detach())
    for (name, buffer), (_, ref) in zip(model.named_buffers(), twin.named_buffers(), strict=True):
        assert torch.equal(buffer, ref), name
    assert int(model[1].num_batches_tracked) == 1


def test_a_transform_must_keep_keys_and_shapes() -> None:
    model = make_model()
    before = snapshot(model)

    def dropped(model: nn.Module, params: TensorDictBase) -> TensorDictBase:
        return params.exclude(("3", "bias"))

    def reshaped(model: nn.Module, params: TensorDictBase) -> TensorDictBase:
        result = params.clone(False)
        result.set(("3", "weight"), torch.zeros(4, 4))
        return result

    with Transformed(dropped).prepare(model) as hooked, pytest.raises(ValueError, match=r"missing \['3.bias'\]"):
        run(hooked)
    with Transformed(reshaped).prepare(model) as hooked, pytest.raises(ValueError, match=r"3\.weight' has shape"):
        run(hooked)
    with HookingContextFactory().prepare(model) as hooked:  # nothing left behind on the shadow
        assert torch.equal(run(hooked), tdhook_fn.call(model, tdhook_fn.params(model), X))
    assert same(before, snapshot(model))
