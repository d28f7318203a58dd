"""What a forward registers or assigns while it runs lives for that call only, and never reaches the model."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn


class _LazyScale(nn.Module):
    """Registers a buffer computed from its weight on its first call (a lazy cache), and assigns attributes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "scale"):
            self.register_buffer("scale", self.lin.weight.detach().sum(0), persistent=False)
        if "gain" not in self._parameters:
            self.register_parameter("gain", nn.Parameter(self.lin.bias.detach() + 1))
        if "extra" not in self._modules:
            self.extra = nn.Linear(4, 4)  # a new submodule, with its own (random) weights
            nn.init.zeros_(self.extra.weight)
            nn.init.constant_(self.extra.bias, float(self.lin.bias.detach().sum()))
        self.cache = x
        return (self.lin(x) * self.scale * self.gain) + self.extra(x)


def _expected(p: TensorDict, x: torch.Tensor) -> torch.Tensor:
    w, b = p["lin", "weight"], p["lin", "bias"]
    return nn.functional.linear(x, w, b) * w.sum(0) * (b + 1) + b.sum()


def test_a_buffer_registered_by_the_forward_is_recomputed_for_each_call() -> None:
    model = _LazyScale()
    x = torch.randn(3, 4)
    p = tdhook_fn.params(model)
    for scale in (1.0, 2.0, 0.5):  # the same pooled shadow serves each call
        q = p.apply(lambda t, s=scale: s * t)
        torch.testing.assert_close(tdhook_fn.call(model, q, x), _expected(q, x))


def test_what_the_forward_registers_never_reaches_the_model() -> None:
    model = _LazyScale()
    before = dict(model.__dict__)
    tdhook_fn.call(model, tdhook_fn.params(model), torch.randn(3, 4))
    assert model._non_persistent_buffers_set == set()
    assert list(model._buffers) == [] and list(model._parameters) == [] and list(model._modules) == ["lin"]
    assert "cache" not in model.__dict__ and model.__dict__.keys() == before.keys()


def test_a_hook_registered_by_the_forward_lives_for_that_call_only() -> None:
    class Hooking(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.lin.register_forward_hook(lambda m, a, out: out + 1)  # a hook per call, never removed
            return self.lin(x)

    model = Hooking()
    p, x = tdhook_fn.params(model), torch.randn(1, 2)
    expected = nn.functional.linear(x, p["lin", "weight"], p["lin", "bias"]) + 1
    for _ in range(3):
        torch.testing.assert_close(tdhook_fn.call(model, p, x), expected)
    assert not model.lin._forward_hooks


class _FillsACache(nn.Module):
    """A lazily filled cache in a plain dict attribute (rotary embeddings keep such tables)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(1.0, 5.0))
        self._cache: dict[int, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        if n not in self._cache:
            self._cache[n] = self.inv_freq[:n] * 2
        return x * self._cache[n]


def test_a_cache_a_forward_fills_is_private_to_the_call() -> None:
    model, x = _FillsACache(), torch.ones(4)
    half = tdhook_fn.params(model).apply(lambda t: 0.5 * t)
    torch.testing.assert_close(tdhook_fn.call(model, half, x), torch.arange(1.0, 5.0))
    assert model._cache == {}  # the model is never written
    torch.testing.assert_close(tdhook_fn.call(model, tdhook_fn.params(model), x), 2 * torch.arange(1.0, 5.0))
    torch.testing.assert_close(model(x), 2 * torch.arange(1.0, 5.0))


class _MaybeTied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2, bias=False)
        self.tied: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.tied.get("w", self.lin.weight).T


def test_a_container_filled_or_replaced_after_a_call_is_read_as_it_is_now() -> None:
    model, x = _MaybeTied(), torch.ones(1, 2)
    half = tdhook_fn.params(model).apply(lambda t: 0.5 * t)
    tdhook_fn.call(model, half, x)
    model.tied["w"] = model.lin.weight  # filled in place: same object, so no attribute identity changed
    torch.testing.assert_close(tdhook_fn.call(model, half, x), x @ (0.5 * model.lin.weight.detach()).T)
    del model.tied
    model.tied = {"w": model.lin.weight}  # a new dict, which may get the freed one's id
    torch.testing.assert_close(tdhook_fn.call(model, half, x), x @ (0.5 * model.lin.weight.detach()).T)
