"""deeplift, layer_deeplift and deeplift_shap given a plain tensor, or a TensorDict of that one tensor, take the
chain walk on it directly (NOTE [captum-style calls]: no TensorDict round trip): the maps of the TensorDict's way
(inputs of two batch dims take it), and every check of that way still fires (a wrong dtype, params that do not
fit, a model changed between calls, a bad target or argument)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import _deeplift, _deeplift_shap, _inputs, deeplift, deeplift_shap, layer_deeplift

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
D = torch.float64


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).to(D).eval()


def _cnn() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 6, 3), nn.Sigmoid(),
                         nn.Flatten(), nn.Linear(24, 3)).to(D).eval()


_MODELS = {"mlp": (_mlp, (5,), "[2]"), "cnn": (_cnn, (1, 8, 8), "[3]")}


@pytest.fixture
def wrapped(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The TensorDict's way taken: a tensor wrapped into a TensorDict, or a TensorDict walked as one."""
    seen: list[str] = []
    fresh = _inputs.fresh_tensordict
    monkeypatch.setattr(_inputs, "fresh_tensordict", lambda *a, **k: seen.append("wrapped") or fresh(*a, **k))
    for module, name in ((_deeplift, "_walked"), (_deeplift, "_layers_walked"), (_deeplift_shap, "_pairs_walked")):
        monkeypatch.setattr(module, name, lambda *a, _f=getattr(module, name), _n=name, **k: seen.append(_n) or _f(
            *a, **k))
    yield seen


def _calls(path: str, refs: torch.Tensor) -> dict[str, Callable[..., Any]]:
    """Each method as a call on (f, params, inputs, **kwargs), the one map read off a TensorDict result."""
    def read(out: Any, key: str) -> Any:
        return out if isinstance(out, torch.Tensor) else out[key]

    return {
        "deeplift": lambda f, p, x, **k: read(deeplift(f, p, x, k.pop("baselines", 0.0), **k), "input"),
        "layer_deeplift": lambda f, p, x, **k: read(layer_deeplift(f, p, x, layers=[path], **k), path),
        "deeplift_shap": lambda f, p, x, **k: read(deeplift_shap(f, p, x, refs, **{
            n: v for n, v in k.items() if n != "baselines"}), "input"),
    }


@pytest.mark.parametrize("model_name", list(_MODELS))
@pytest.mark.parametrize("method", ["deeplift", "layer_deeplift", "deeplift_shap"])
@pytest.mark.parametrize("kwargs", [{}, {"baselines": 0.5}, {"multiply_by_inputs": False}, {"per_target": True},
                                    {"labels": True}, {"eps": 0.3}],
                         ids=["default", "baseline 0.5", "multipliers", "per target", "labels", "eps"])
def test_a_tensor_takes_the_walk_and_gives_the_tensordict_maps(wrapped: list[str], model_name: str, method: str,
                                                               kwargs: dict[str, Any]) -> None:
    make, shape, path = _MODELS[model_name]
    f, p = tdhook_fn.pure(make())
    torch.manual_seed(2)
    x, refs = torch.randn(4, *shape, dtype=D), torch.randn(3, *shape, dtype=D)
    kwargs = dict(kwargs)
    labels = torch.tensor([0, 2, 1, 2]) if kwargs.pop("labels", False) else None
    target: Any = labels if labels is not None else ((0, 2) if "per_target" in kwargs else 1)
    call = _calls(path, refs)[method]
    ours = call(f, p, x, target=target, **kwargs)
    one = call(f, p, TensorDict(input=x, batch_size=[4]), target=target, **kwargs)
    assert not wrapped  # (the tensor path, for both: nothing wrapped, nothing walked as a TensorDict)
    two_dims = TensorDict(input=x.unsqueeze(0), batch_size=[1, 4])  # (the TensorDict's way)
    expected = call(f, p, two_dims, target=target if labels is None else labels.unsqueeze(0), **kwargs)
    assert wrapped
    assert isinstance(ours, torch.Tensor)
    expected = expected[:, 0] if "per_target" in kwargs else expected[0]
    torch.testing.assert_close(ours, expected)
    torch.testing.assert_close(one, expected)


@pytest.mark.parametrize("method", ["deeplift", "layer_deeplift", "deeplift_shap"])
@pytest.mark.parametrize("as_tensordict", [False, True], ids=["tensor", "TensorDict of one tensor"])
def test_the_checks_fire_on_the_tensor_path(method: str, as_tensordict: bool) -> None:
    f, p = tdhook_fn.pure(_mlp())
    x, refs = torch.randn(4, 5, dtype=D), torch.randn(3, 5, dtype=D)
    given = _calls("[2]", refs)[method]

    def call(f: Any, p: Any, x: torch.Tensor, **kwargs: Any) -> Any:
        return given(f, p, TensorDict(input=x, batch_size=x.shape[:1]) if as_tensordict and x.dim() else x, **kwargs)

    with pytest.raises(TypeError, match="floating-point"):
        call(f, p, torch.ones(4, 5, dtype=torch.long), target=0)  # (integer inputs)
    wrong = p.clone()
    wrong["2", "weight"] = torch.randn(8, 7, dtype=D)
    with pytest.raises((ValueError, RuntimeError, KeyError)):
        call(f, wrong, x, target=0)  # params of a wrong shape
    with pytest.raises((ValueError, RuntimeError, KeyError)):
        call(f, p.exclude(("2", "bias")), x, target=0)  # a parameter missing
    with pytest.raises(ValueError, match="batch shape"):
        call(f, p, x, target=torch.tensor([0, 1]))  # labels of another batch
    with pytest.raises(ValueError, match="eps"):
        call(f, p, x, target=0, eps=-1.0)
    with pytest.raises(TypeError, match="unexpected keyword"):
        call(f, p, x, target=0, epsilon=0.1)
    with pytest.raises(TypeError, match="params must be a TensorDict"):
        call(f, dict(p.items()), x, target=0)
    with pytest.raises(ValueError, match="0-d"):
        call(f, p, torch.tensor(1.0, dtype=D), target=0)


@pytest.mark.parametrize("method", ["deeplift", "layer_deeplift", "deeplift_shap"])
@pytest.mark.parametrize("change", ["child", "hook", "float32 input"])
def test_a_change_between_tensor_calls_is_seen(method: str, change: str) -> None:
    model = _mlp()
    f, p = tdhook_fn.pure(model)
    torch.manual_seed(3)
    x, refs = torch.randn(4, 5, dtype=D), torch.randn(3, 5, dtype=D)
    call = _calls("[2]", refs)[method]
    before = call(f, p, x, target=1)
    if change == "child":
        model[3] = nn.Sigmoid()
    elif change == "hook":
        model[2].register_forward_hook(lambda _m, _a, out: out * 2.0)
    else:
        x = x.float()
    if change == "float32 input":  # (the params are float64: as the TensorDict's way, which refuses it or runs it)
        try:
            expected = call(f, p, TensorDict(input=x, batch_size=[4]), target=1)
        except Exception as error:
            with pytest.raises(type(error)):
                call(f, p, x, target=1)
        else:
            torch.testing.assert_close(call(f, p, x, target=1), expected)
        return
    after = call(f, p, x, target=1)
    fresh_f, fresh_p = tdhook_fn.pure(copy.deepcopy(model))
    expected = call(fresh_f, fresh_p, TensorDict(input=x, batch_size=[4]), target=1)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, expected)
