"""The methods that only read outputs, and the gradients without taps, pool in channels-last
(NOTE [shadow max pooling]) and give the plain kernel's numbers; the rule methods, and calls with a custom tap,
never do."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from torch.utils.hooks import RemovableHandle
from zoo import pooled_layouts, tiny_resnet

import tdhook_fn
from tdhook_fn import Tap, capture
from tdhook_fn.attribution import (
    EpsilonPlus,
    convergence_delta,
    deconvolution,
    deeplift,
    feature_ablation,
    guided_backprop,
    integrated_gradients,
    kernel_shap,
    lime,
    lrp,
    occlusion,
    saliency,
    shapley_value_sampling,
    smoothgrad,
)
from tdhook_fn.attribution.metrics import infidelity

pytestmark = pytest.mark.usefixtures("pools_of_any_size")  # (small inputs: these test where and what it pools)


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(16, 4)).eval()


def _perturb(copies: TensorDict) -> tuple[TensorDict, TensorDict]:
    step = torch.full_like(copies["input"], 0.1)
    return TensorDict(input=step, batch_size=copies.batch_size), \
        TensorDict(input=copies["input"] - step, batch_size=copies.batch_size)


def _captured(f: Any) -> Any:
    return f.with_taps(capture("2", key="pooled"))


def _class_1(outputs: TensorDict) -> torch.Tensor:
    return outputs["output"][:, 1]


CALLS: dict[str, Callable[..., Any]] = {
    "occlusion": lambda f, p, x: occlusion(f, p, x, target=1, sliding_window_shapes=(1, 2, 2)),
    "feature_ablation": lambda f, p, x: feature_ablation(f, p, x, target=1),
    "shapley_value_sampling": lambda f, p, x: shapley_value_sampling(f, p, x, target=1, n_samples=2),
    "kernel_shap": lambda f, p, x: kernel_shap(f, p, x, target=1, n_samples=8),
    "lime": lambda f, p, x: lime(f, p, x, target=1, n_samples=8),
    "infidelity": lambda f, p, x: infidelity(f, p, _perturb, x, x.clone(), target=1, n_perturb_samples=3),
}
GRADIENTS: dict[str, Callable[..., Any]] = {
    "saliency": lambda f, p, x: saliency(f, p, x, target=1),
    "integrated_gradients": lambda f, p, x: integrated_gradients(f, p, x, 0.0, target=1, n_steps=4),
    "smoothgrad": lambda f, p, x: smoothgrad(f, p, x, target=1, nt_samples=3, stdevs=0.1,
                                             generator=torch.Generator().manual_seed(0)),
    # taps of the built-in kinds hand their functions values only: the shadows still pool in channels-last (a
    # capture on f: the general path, where the walks would pool on their own copy)
    "saliency, f with a capture": lambda f, p, x: saliency(_captured(f), p, x, target=_class_1),
    "guided_backprop, f with a capture": lambda f, p, x: guided_backprop(_captured(f), p, x, target=_class_1),
    "deconvolution, f with a capture": lambda f, p, x: deconvolution(_captured(f), p, x, target=_class_1),
}
RULED: dict[str, Callable[..., Any]] = {
    "lrp": lambda f, p, x: lrp(f, p, x, target=_class_1, rules=EpsilonPlus(), warn_on_missing_rule=False),
    "deeplift": lambda f, p, x: deeplift(f, p, x, target=_class_1),
}


def _pools(monkeypatch: pytest.MonkeyPatch, call: Callable[..., Any]) -> tuple[Any, list[bool]]:
    """What ``call`` gives on the small CNN, and whether each of its max poolings pooled a channels-last copy."""
    layouts = pooled_layouts(monkeypatch)
    f, p = tdhook_fn.pure(_cnn())
    x = TensorDict(input=torch.rand(3, 1, 4, 4, generator=torch.Generator().manual_seed(1)), batch_size=[3])
    torch.manual_seed(0)  # (the sampling methods draw from the global generator)
    return call(f, p, x), layouts


def _check_channels_last_gives_the_plain_kernels_numbers(monkeypatch: pytest.MonkeyPatch,
                                                        call: Callable[..., Any]) -> None:
    pooled, layouts = _pools(monkeypatch, call)
    assert layouts and all(layouts)
    monkeypatch.setattr("tdhook_fn._pool_layout.faster_in_channels_last", lambda *_: False)
    plain, layouts = _pools(monkeypatch, call)
    assert layouts and not any(layouts)
    torch.testing.assert_close(pooled, plain, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(CALLS))
def test_forward_only_methods_pool_in_channels_last(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _check_channels_last_gives_the_plain_kernels_numbers(monkeypatch, CALLS[name])


@pytest.mark.parametrize("name", list(GRADIENTS))
def test_gradients_pool_in_channels_last_and_give_autograds_maps(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _check_channels_last_gives_the_plain_kernels_numbers(monkeypatch, GRADIENTS[name])


@pytest.mark.parametrize("name", list(RULED))
def test_rule_methods_never_do(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On their general path (a capture on f: no walk), the rule taps choose by the module's class: the shadow's
    pool runs as the model's own ``nn.MaxPool2d``, in the default layout."""
    ran: list[type] = []
    forward = nn.MaxPool2d.forward

    def recorded(module: nn.MaxPool2d, x: torch.Tensor) -> Any:
        ran.append(type(module))
        return forward(module, x)

    monkeypatch.setattr(nn.MaxPool2d, "forward", recorded)
    _, layouts = _pools(monkeypatch, lambda f, p, x: RULED[name](_captured(f), p, x))
    assert ran and all(kind is nn.MaxPool2d for kind in ran), ran
    assert layouts and not any(layouts)


@pytest.mark.parametrize("method", ["occlusion", "saliency"])
def test_a_hugging_face_resnet_gives_its_own_numbers(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' ResNet (random init from a config; its stem has an ``nn.MaxPool2d``, its output a ModelOutput):
    occlusion (forward only) and saliency (differentiated) pool in channels-last and give, bit for bit, the maps of
    the plain kernel."""
    f, p = tiny_resnet()
    x = TensorDict(pixel_values=torch.rand(2, 3, 16, 16), batch_size=[2])

    def attribute() -> torch.Tensor:
        if method == "saliency":
            return saliency(f, p, x, target=2)["pixel_values"]
        out = occlusion(f, p, x, target=2, sliding_window_shapes=(3, 4, 4), strides=(3, 4, 4))
        return out["pixel_values"]

    layouts = pooled_layouts(monkeypatch)
    pooled = attribute()
    assert layouts and all(layouts)
    monkeypatch.setattr("tdhook_fn._pool_layout.faster_in_channels_last", lambda *_: False)
    layouts.clear()
    assert torch.equal(attribute(), pooled) and layouts and not any(layouts)


class _ClassSeen(Tap):
    """A custom tap that reads the class of the module it is attached to, as a rule's taps do."""

    def attach(self, module: nn.Module, captured: dict[str, Any]) -> RemovableHandle:
        assert self.fn is not None
        self.fn(type(module))
        return module.register_forward_hook(lambda *_: None)


WITH_TAPS: dict[str, Callable[..., Any]] = {
    "integrated_gradients delta": lambda f, p, x, tap: integrated_gradients(
        f, p, x, 0.0, target=1, n_steps=2, taps=[tap], return_convergence_delta=True),
    "convergence_delta": lambda f, p, x, tap: convergence_delta(
        f, p, x, 0.0, TensorDict(input=torch.zeros_like(x["input"]), batch_size=x.batch_size), target=1, taps=[tap]),
    "occlusion, f with a tap": lambda f, p, x, tap: occlusion(
        f.with_taps(tap), p, x, target=1, sliding_window_shapes=(1, 2, 2)),
    "saliency, f with a tap": lambda f, p, x, tap: saliency(f.with_taps(tap), p, x, target=1),
}


@pytest.mark.parametrize("name", list(WITH_TAPS))
def test_a_tap_sees_the_models_own_pool_class(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A custom tap is handed the module it runs and may choose by its class (the rule methods' do), so every
    forward where one is attached, read only or differentiated, runs the model's own ``nn.MaxPool2d``, in its
    default layout."""
    classes: list[type] = []
    tap = _ClassSeen("2", "custom", classes.append)
    _, layouts = _pools(monkeypatch, lambda f, p, x: WITH_TAPS[name](f, p, x, tap))
    assert classes and all(kind is nn.MaxPool2d for kind in classes)
    assert layouts and not any(layouts)


def test_a_hugging_face_resnet_with_taps_on_its_stem_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' ResNet, tapped at its stem's ``nn.MaxPool2d``: with a capture the shadows still pool it in
    channels-last, with the plain kernel's map bit for bit; with a custom tap it runs the model's own class."""
    f, p = tiny_resnet()
    x = TensorDict(pixel_values=torch.rand(2, 3, 16, 16), batch_size=[2])
    pool = "resnet.embedder.pooler"
    classes: list[type] = []

    def logit_2(outputs: TensorDict) -> torch.Tensor:
        return outputs["logits"][:, 2]

    layouts = pooled_layouts(monkeypatch)
    captured = f.with_taps(capture(pool, key="pooled"))
    pooled = saliency(captured, p, x, target=logit_2)["pixel_values"]
    assert layouts and all(layouts)
    layouts.clear()
    saliency(f.with_taps(_ClassSeen(pool, "custom", classes.append)), p, x, target=2)
    assert classes == [nn.MaxPool2d] and layouts and not any(layouts)
    monkeypatch.setattr("tdhook_fn._pool_layout.faster_in_channels_last", lambda *_: False)
    assert torch.equal(saliency(captured, p, x, target=logit_2)["pixel_values"], pooled)
