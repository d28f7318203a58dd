"""pruning_scores + masks + apply_masks + call against tdhook 0.1.3's Pruning context."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from tdhook.weights.pruning import Pruning
from tensordict import TensorDict
from torch import nn
from w_models import prunable_net
from zoo import Blocks, same, snapshot

import tdhook_fn
from tdhook_fn.weights import apply_masks, default_skip, global_unstructured_masks, ln_structured_mask, pruning_scores


def _blocks() -> nn.Module:
    torch.manual_seed(0)
    return Blocks().eval()


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 5 * 5, 4)
    ).eval()


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "prunable": (prunable_net, lambda: torch.randn(3, 2, 5, 5, generator=torch.Generator().manual_seed(9))),
    "cnn_bn": (_cnn, lambda: torch.randn(3, 1, 5, 5, generator=torch.Generator().manual_seed(9))),
    "blocks": (_blocks, lambda: torch.randn(3, 4, generator=torch.Generator().manual_seed(9))),
}


def _importance(kind: str) -> Callable[..., torch.Tensor | None]:
    def importance(module_key: str, parameter_name: str, parameter: torch.Tensor) -> torch.Tensor | None:
        if kind == "magnitude":
            return parameter.detach().abs()
        if kind == "weights_only":
            return parameter.detach().abs() if parameter_name == "weight" else None
        # "ties": a deterministic function of the key and the values, with many equal scores
        return (parameter.detach() * 4).round() + len(module_key) % 2

    return importance


def _tdhook_output(model: nn.Module, factory: Pruning, x: torch.Tensor) -> torch.Tensor:
    twin = copy.deepcopy(model)
    with factory.prepare(twin) as hooked:
        out = hooked(TensorDict(input=x, batch_size=[x.shape[0]]))["output"].detach().clone()
        pruned_zeros = sum(int((p == 0).sum()) for p in twin.parameters())
    return out, pruned_zeros


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("kind", ["magnitude", "weights_only", "ties"])
@pytest.mark.parametrize("amount", [0.0, 0.2, 0.5, 0.9, 7])
def test_global_pruning_equals_tdhook(model_name: str, kind: str, amount) -> None:
    make, make_x = MODELS[model_name]
    model, x = make(), make_x()
    before = snapshot(model)
    params = tdhook_fn.params(model)
    scores = pruning_scores(model, params, _importance(kind), skip=default_skip)
    masks = global_unstructured_masks(scores, amount)
    ours = tdhook_fn.call(model, apply_masks(params, masks), x)
    assert same(before, snapshot(model))

    factory = Pruning(_importance(kind), amount_to_prune=amount, skip_modules=Pruning.default_skip)
    theirs, zeros = _tdhook_output(model, factory, x)
    assert zeros >= sum(int((~m).sum()) for m in masks.values(True, True))
    assert torch.allclose(ours, theirs, atol=1e-6), (ours - theirs).abs().max()
    if amount:
        assert not torch.allclose(ours, model(x), atol=1e-6)  # pruning did something


# module key in tdhook's path syntax -> (name in named_modules, (dim, amount))
STRUCTURED = {
    "prunable": {"[0]": ("0", (0, 0.34)), "[2]": ("2", (1, 2)), "[4]": ("4", (-1, 0.5)), "[6]": ("6", (0, None))},
    "cnn_bn": {"[0]": ("0", (1, None)), "[4]": ("4", (0, 0.5))},
    "blocks": {
        "layers[1]": ("layers.1", (0, 0.5)),
        "heads['main']": ("heads.main", (1, 3)),
        "<block0/module>[0]": ("block0/module.0", (0, 1)),
    },
}


@pytest.mark.parametrize("model_name", list(STRUCTURED))
@pytest.mark.parametrize("kind", ["magnitude", "ties"])
def test_structured_pruning_equals_tdhook(model_name: str, kind: str) -> None:
    make, make_x = MODELS[model_name]
    model, x = make(), make_x()
    default_amount = 0.25
    base_importance = _importance(kind)

    # tdhook's structured mode passes its path ("layers[1]") as module_key, pruning_scores the
    # module's name ("layers.1"): scores here do not depend on it
    def importance(module_key: str, parameter_name: str, parameter: torch.Tensor) -> torch.Tensor | None:
        return base_importance("", parameter_name, parameter) if parameter.dim() >= 2 else None

    spec = STRUCTURED[model_name]
    params = tdhook_fn.params(model)
    masks = TensorDict({}, batch_size=[])
    for path, (name, (dim, amount)) in spec.items():
        keep = lambda n, m, name=name: n != name
        scores = pruning_scores(model, params, importance, skip=keep)
        assert len(list(scores.keys(True, True))) == 1
        masks.update(ln_structured_mask(scores, amount or default_amount, dim, n=1))
    ours = tdhook_fn.call(model, apply_masks(params, masks), x)

    factory = Pruning(
        importance,
        amount_to_prune=default_amount,
        modules_to_prune={path: dimamount for path, (_, dimamount) in spec.items()},
        skip_modules=Pruning.default_skip,
    )
    theirs, _ = _tdhook_output(model, factory, x)
    assert torch.allclose(ours, theirs, atol=1e-6), (ours - theirs).abs().max()
    assert not torch.allclose(ours, model(x), atol=1e-6)
