"""Small models and a snapshot of everything a call could change on a model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import tdhook_fn


class TwoInput(nn.Module):
    def __init__(self, outputs: int = 2) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(3, 6)
        self.head = nn.Linear(6, outputs)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.a(x) + self.b(y)))


class Moded(nn.Module):
    """A forward with a string keyword: non-tensor inputs must reach every call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, mode: str = "linear") -> torch.Tensor:
        y = self.lin(x)
        return torch.tanh(y) if mode == "tanh" else y


@dataclass
class Parts:
    logits: torch.Tensor
    hidden: torch.Tensor


class DataclassOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> Parts:
        h = torch.relu(self.body(x))
        return Parts(self.head(h), h)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4, bias=False)
        self.dec = nn.Linear(4, 4, bias=False)
        self.dec.weight = self.enc.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(torch.tanh(self.enc(x)))


class Blocks(nn.Module):
    """ModuleList, ModuleDict and names with '/' in one model."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.heads = nn.ModuleDict({"main": nn.Linear(4, 2), "aux": nn.Linear(4, 1)})
        self.add_module("block0/module", nn.Sequential(nn.Linear(4, 4), nn.GELU()))

    def fn(self, i: int) -> nn.Module:
        return self.layers[i]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = getattr(self, "block0/module")(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.heads["main"](x) + self.heads["aux"](x)


class TdhookTestModel(nn.Module):
    """tdhook's own test model: its ReLU runs twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(10, 20)
        self.linear2 = nn.Linear(20, 20)
        self.linear3 = nn.Linear(20, 5)
        self.activation = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear3(self.activation(self.linear2(self.activation(self.linear1(x)))))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 5 * 5, 4)
    )


def zoo() -> dict[str, tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    """name -> (model in eval mode, example positional inputs with a batch of 2)."""
    torch.manual_seed(0)
    models: dict[str, tuple[nn.Module, tuple[torch.Tensor, ...]]] = {
        "mlp": (mlp(), (torch.randn(2, 4),)),
        "cnn": (cnn(), (torch.randn(2, 1, 5, 5),)),
        "two_input": (TwoInput(), (torch.randn(2, 4), torch.randn(2, 3))),
        "tied": (Tied(), (torch.randn(2, 4),)),
        "blocks": (Blocks(), (torch.randn(2, 4),)),
        "transformer": (
            nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True),
            (torch.randn(2, 3, 8),),
        ),
    }
    for model, _ in models.values():
        model.eval()
    return models


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything about ``model`` a call must leave alone, comparable with ``same``."""
    return {
        "tensors": {
            name: (id(t), t.detach().clone(), t.requires_grad, t.grad)
            for name, t in [*model.named_parameters(), *model.named_buffers()]
        },
        "modules": [(name, id(m), m.training, dict(m.__dict__)) for name, m in model.named_modules()],
        "hooks": [
            (name, key, dict(getattr(m, key)))
            for name, m in model.named_modules()
            for key in vars(m)
            if key.endswith("hooks") or "hooks_" in key
        ],
    }


def same(before: dict[str, Any], after: dict[str, Any]) -> bool:
    if before["tensors"].keys() != after["tensors"].keys():
        return False
    for name, (ident, value, requires_grad, grad) in before["tensors"].items():
        ident2, value2, requires_grad2, grad2 = after["tensors"][name]
        if ident != ident2 or requires_grad != requires_grad2 or grad is not grad2:
            return False
        if value.dtype != value2.dtype or not torch.equal(value, value2):
            return False
    if len(before["modules"]) != len(after["modules"]):
        return False
    for (n, i, t, d), (n2, i2, t2, d2) in zip(before["modules"], after["modules"]):
        if (n, i, t) != (n2, i2, t2) or d.keys() != d2.keys():
            return False
        if any(d[k] is not d2[k] for k in d):
            return False
    return bool(before["hooks"] == after["hooks"])


def tiny_gpt2(transformers: Any) -> Any:
    """A 2-layer GPT-2 of random weights (torch seeded 0 first), no dropout, in eval mode: no download.

    ``transformers`` is the module, as the test's ``pytest.importorskip`` returned it.
    """
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=40, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).eval()


def pooling_planes() -> dict[str, torch.Tensor]:
    """Batches of 2-d planes where max-pooling kernels could differ: ties, NaNs, signed zeros, float64 (four channels
    each: the fewest that shadows pool in channels-last, NOTE [shadow max pooling]; fewer elements than that takes,
    so the tests that pool them in channels-last lower it with the ``pools_of_any_size`` fixture)."""
    torch.manual_seed(0)
    ties = (torch.randn(6, 4, 9, 9) * 2).round().relu()  # many equal maxima (zeros after a ReLU)
    nans = torch.randn(6, 4, 8, 8)
    nans[0, 0, 0, :2] = float("nan")  # two NaNs in one window
    nans[1, 2, 2:4, 2:4] = float("nan")
    nans[2, 1, 5, 5] = float("nan")
    zeros = torch.zeros(3, 4, 6, 6)
    zeros[:, :, ::2] = -0.0  # signed zeros tie: the sign of the one taken shows
    return {"ties": ties, "nans": nans, "zeros": zeros, "float64": torch.randn(4, 4, 7, 7, dtype=torch.float64)}


def pooled_layouts(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each 2-d max pooling from now on pools a channels-last copy (False under vmap, which cannot be asked
    for a layout)."""
    seen: list[bool] = []
    plain = nn.functional.max_pool2d

    def spy(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        batched = torch._C._functorch.is_batchedtensor(x)
        seen.append(not batched and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())
        return plain(x, *args, **kwargs)

    monkeypatch.setattr(nn.functional, "max_pool2d", spy)
    return seen


def tiny_resnet() -> tuple[Any, Any]:
    """transformers' ResNet from a config (random init, seeded; its stem has an ``nn.MaxPool2d``, its output a
    ModelOutput) as a pure function of ``pixel_values`` to ``logits``, and its params; skipped without transformers."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                       num_labels=5)
    model = transformers.ResNetForImageClassification(config).eval()
    return (tdhook_fn.functional(model, in_keys={"pixel_values": "pixel_values"}, out_keys=["logits"]),
            tdhook_fn.params(model))
