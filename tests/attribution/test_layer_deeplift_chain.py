"""layer_deeplift on a chain takes the DeepLift walk stopped at the layer (NOTE [layers on the chain]): the same maps
as the general path (rescale rules on LRP's walk), which a forward hook on the model forces; other models and paths
take the general path."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from _tolerance import assert_close_ulps
from attr_zoo import on_general_path
from captum.attr import LayerDeepLift
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import _deeplift
from tdhook_fn.attribution._deeplift import layer_deeplift

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _mlp(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype).eval()


def _cnn(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 6, 3), nn.Sigmoid(),
                         nn.Flatten(), nn.Linear(24, 5), nn.LeakyReLU(0.1), nn.Linear(5, 4)).to(dtype).eval()



def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many calls reach the walk stopped at layers."""
    calls: list[int] = []
    walk = _deeplift.chain_layer_deeplift

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return walk(*args, **kwargs)

    monkeypatch.setattr(_deeplift, "chain_layer_deeplift", counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("multiply", [True, False])
@pytest.mark.parametrize("per_target", [False, True])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_the_walk_equals_the_general_path(kind: str, dtype: torch.dtype, multiply: bool, per_target: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    model = _mlp(dtype) if kind == "mlp" else _cnn(dtype)
    layers = ["[0]", "[2]", "[3]", "[4]"] if kind == "mlp" else ["[0]", "[3]", "[5]", "[7]", "[8]"]
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    torch.manual_seed(2)
    x = TensorDict(input=torch.randn(6, *((5,) if kind == "mlp" else (1, 8, 8)), dtype=dtype), batch_size=[6])
    target = (0, 2) if per_target else 1
    calls = _counting(monkeypatch)

    def call() -> TensorDict:
        return layer_deeplift(f, p, x, 0.2, target=target, layers=layers, multiply_by_inputs=multiply,
                              per_target=per_target)

    walked = call()
    assert len(calls) == 1
    general = on_general_path(model, call)
    assert len(calls) == 1
    if kind == "mlp":  # the same ops: linear layers' adjoints are autograd's matrix products
        assert walked.batch_size == general.batch_size
        for path in layers:
            assert torch.equal(walked[path], general[path]), path
    else:  # a convolution's pullback is its adjoint on the walk, autograd's kernel on the general path
        assert_close_ulps(walked, general, ulps=8)


def test_batch_shapes_sample_references_and_labels_equal_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _cnn(torch.float64)
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    torch.manual_seed(3)
    x = TensorDict(input=torch.randn(2, 3, 1, 8, 8, dtype=torch.float64), batch_size=[2, 3])
    b = TensorDict(input=torch.randn(2, 3, 1, 8, 8, dtype=torch.float64), batch_size=[2, 3])
    labels = torch.tensor([[0, 3, 1], [2, 2, 0]])
    calls = _counting(monkeypatch)

    def call() -> TensorDict:
        return layer_deeplift(f, p, x, b, target=labels, layers=["[4]"])

    walked = call()
    assert len(calls) == 1 and walked.batch_size == (2, 3)
    assert_close_ulps(walked, on_general_path(model, call), ulps=8)


def test_maps_alias_neither_each_other_nor_the_params() -> None:
    # without multiply_by_inputs the map below a flatten is a view of the map above it on the walk
    model = _cnn(torch.float64)
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    x = TensorDict(input=torch.randn(4, 1, 8, 8, dtype=torch.float64), batch_size=[4])
    maps = layer_deeplift(f, p, x, target=1, layers=["[4]", "[5]", "[7]"], multiply_by_inputs=False)
    before, params = maps.clone(), p.clone()
    for path in ("[5]", "[7]"):
        maps[path].add_(1.0)
    assert torch.equal(maps["[4]"], before["[4]"])
    assert (p == params).all()


def test_other_models_and_paths_take_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("the walk was taken")

    monkeypatch.setattr(_deeplift, "chain_layer_deeplift", refused)
    torch.manual_seed(4)
    x = torch.randn(5, 4, dtype=torch.float64)

    class Residual(nn.Module):  # not a chain: its own forward
        def __init__(self) -> None:
            super().__init__()
            self.a, self.act, self.b = nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.b(h + self.act(self.a(h)))  # type: ignore[no-any-return]

    residual = Residual().double()
    nested = nn.Sequential(nn.Sequential(nn.Linear(4, 6), nn.Tanh()), nn.Linear(6, 2)).double()
    for model, path, module in ((residual, "act", residual.act), (nested, "[0]", nested[0])):
        f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
        ours = layer_deeplift(f, p, x, target=1, layers=[path])  # ("[0]": a container, no link's output)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = LayerDeepLift(model, module).attribute(x, target=1).detach()
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-13)
    relu = nn.ReLU()
    twice = nn.Sequential(nn.Linear(4, 4), relu, nn.Linear(4, 4), relu, nn.Linear(4, 2)).double()
    f, p = tdhook_fn.functional(twice), tdhook_fn.params(twice)
    with pytest.raises(ValueError, match="runs 2 times"):
        layer_deeplift(f, p, x, target=1, layers=["[1]"])
