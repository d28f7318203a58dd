"""Remembered layer specs (NOTE [remembered layer specs]): probed once, checked on every call, never stale."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import _layer_specs, integrated_gradients, saliency


class _Twice(nn.Module):
    """Runs ``block`` once, or twice when ``twice`` is set."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)
        self.twice = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(x)
        return self.head(self.block(h) if self.twice else h)


_FORWARDS = [0]  # outside the model: a call's private shadow resets the model's own attributes


class _Cut(nn.Module):
    """Keeps 4 features on odd forwards and 3 on even ones: a shape that changes from one forward to the next."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        _FORWARDS[0] += 1
        return h[:, : 3 + _FORWARDS[0] % 2]


def _count_probes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    probes: list[int] = []
    real = _layer_specs.on_meta

    def counted(*args: Any, **kwargs: Any) -> Any:
        probes.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_layer_specs, "on_meta", counted)
    return probes


def _x(n: int = 5) -> TensorDict:
    torch.manual_seed(1)
    return TensorDict(input=torch.randn(n, 4, dtype=torch.float64), batch_size=[n])


def test_a_second_call_does_not_probe_and_gives_the_same_maps(monkeypatch: pytest.MonkeyPatch) -> None:
    net = _Twice().double()
    f, p = tdhook_fn.pure(net)
    probes = _count_probes(monkeypatch)
    first = saliency(f, p, _x(), target=1, layers=["block"], use_inputs=False)
    second = saliency(f, p, _x(), target=1, layers=["block"], use_inputs=False)
    assert len(probes) == 1
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    saliency(f, p, _x(7), target=1, layers=["block"], use_inputs=False)  # another batch: another entry
    assert len(probes) == 2


def test_a_layer_whose_shape_changed_is_probed_again_not_broadcast(monkeypatch: pytest.MonkeyPatch) -> None:
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    f, p = tdhook_fn.pure(net)
    probes = _count_probes(monkeypatch)
    saliency(f, p, _x(), target=0, layers=["[1]"])
    net[0], net[2] = nn.Linear(4, 2).double(), nn.Linear(2, 3).double()  # [1]'s output: [5, 6] -> [5, 2]
    p = tdhook_fn.params(net)
    got = saliency(f, p, _x(), target=0, layers=["[1]"])
    assert len(probes) == 2 and got["[1]"].shape == torch.Size([5, 2])
    x = _x()["input"]
    act = torch.tanh(net[0](x)).detach().requires_grad_()
    (want,) = torch.autograd.grad(net[2](act)[:, 0].sum(), act)
    torch.testing.assert_close(got["[1]"], want)


def test_a_module_that_starts_running_twice_raises_as_on_a_first_call() -> None:
    net = _Twice().double()
    f, p = tdhook_fn.pure(net)
    saliency(f, p, _x(), target=1, layers=["block"])
    net.twice = True
    with pytest.raises(ValueError, match="runs 2 times"):
        saliency(f, p, _x(), target=1, layers=["block"])
    got = saliency(f, p, _x(), target=1, layers=["block"], layer_calls={"block": 0})
    assert got["block"].shape == torch.Size([5, 4])


def test_layer_ig_follows_a_changed_model() -> None:
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    f, p = tdhook_fn.pure(net)
    run = lambda p: integrated_gradients(f, p, _x(), 0.0, target=0, n_steps=8, layers=["[1]"], use_inputs=False)
    run(p)
    net[0], net[2] = nn.Linear(4, 2).double(), nn.Linear(2, 3).double()
    p = tdhook_fn.params(net)
    got = run(p)
    _layer_specs._memory.clear()
    torch.testing.assert_close(got, run(p), rtol=0, atol=0)
    assert got["[1]"].shape == torch.Size([5, 2])


def test_a_model_whose_layer_shape_changes_from_run_to_run_raises() -> None:
    torch.manual_seed(0)
    f, p = tdhook_fn.pure(nn.Sequential(nn.Linear(4, 4), _Cut()).double())
    with pytest.raises(RuntimeError, match=r"'\[1\]'.*runs differently"):
        saliency(f, p, _x(), target=lambda out: out["output"].sum(-1), layers=["[1]"])


def test_a_scalar_layer_of_one_unbatched_sample() -> None:
    """Batch () and a layer whose activation is a scalar per sample: the restored shape is ()."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 1), torch.nn.Flatten(0)).eval()
    f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
    x = torch.randn(3)
    one = saliency(f, p, TensorDict(input=x, batch_size=[]), target=lambda out: out["output"], layers=["[1]"])
    assert one["[1]"].shape == ()
    torch.testing.assert_close(one["input"], net[0].weight[0].detach())
    torch.testing.assert_close(one["[1]"], torch.tensor(1.0))
