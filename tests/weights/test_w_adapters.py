"""Adapters spliced into a model's forward, checked against hand-composed model parts."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from w_models import small_mlp

import tdhook_fn
from tdhook_fn.weights import Adapted, Adapter, adapter_params, with_adapters


def _inputs(batch: int = 5, d_in: int = 4, seed: int = 1) -> tuple[torch.Tensor, TensorDict]:
    x = torch.randn(batch, d_in, generator=torch.Generator().manual_seed(seed))
    return x, TensorDict(input=x, batch_size=[batch])


def _sae(d: int = 8, width: int = 16, seed: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, width), nn.ReLU(), nn.Linear(width, d))


def _adapted(model: nn.Module, adapters: dict) -> tuple[Adapted, TensorDict]:
    g = with_adapters(tdhook_fn.functional(model), adapters)
    p = tdhook_fn.params(model).update(adapter_params(adapters))
    return g, p


def _identity_linear(d: int) -> nn.Linear:
    lin = nn.Linear(d, d)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(d))
        lin.bias.zero_()
    return lin


@pytest.mark.parametrize("path", ["[0]", "[1]", "[2]"])
@pytest.mark.parametrize("site", ["output", "input"])
@pytest.mark.parametrize("kind", ["identity", "identity_linear"])
def test_identity_adapter_leaves_outputs_unchanged(path: str, site: str, kind: str) -> None:
    model = small_mlp()
    d = {("[0]", "input"): 4, ("[2]", "output"): 3}.get((path, site), 8)
    module = nn.Identity() if kind == "identity" else _identity_linear(d)
    g, p = _adapted(model, {"id": Adapter(module, path, path, site)})
    x, td = _inputs()
    expected = model(x)
    out = g(p, td)["output"]
    assert torch.allclose(out, expected, atol=1e-6)
    assert torch.allclose(out, tdhook_fn.functional(model)(tdhook_fn.params(model), td)["output"], atol=1e-6)


def test_same_path_sae_equals_manual_composition() -> None:
    model, sae = small_mlp(), _sae()
    g, p = _adapted(model, {"sae": (sae, "[0]", "[0]")})
    x, td = _inputs()
    expected = model[2](model[1](sae(model[0](x))))
    assert torch.allclose(g(p, td)["output"], expected, atol=1e-6)
    assert not torch.allclose(expected, model(x), atol=1e-3)  # the adapter does something


def test_adapter_weights_come_from_params_not_module() -> None:
    model, sae = small_mlp(), _sae()
    g, p = _adapted(model, {"sae": (sae, "[1]", "[1]")})
    other = p["adapters", "sae"].apply(lambda t: t * 0.5 + 0.1)
    p2 = p.clone(False)
    p2["adapters", "sae"] = other
    x, td = _inputs()
    expected = model[2](tdhook_fn.call(sae, other, model[1](model[0](x))))
    assert torch.allclose(g(p2, td)["output"], expected, atol=1e-6)
    assert torch.allclose(g(p, td)["output"], model[2](sae(model[1](model[0](x)))), atol=1e-6)


def test_transcoder_equals_manual_composition() -> None:
    model = small_mlp()
    torch.manual_seed(3)
    transcoder = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8))
    # reads the pre-activation [0], replaces the post-activation [1]
    g, p = _adapted(model, {"tc": (transcoder, "[0]", "[1]")})
    x, td = _inputs()
    expected = model[2](transcoder(model[0](x)))
    assert torch.allclose(g(p, td)["output"], expected, atol=1e-6)


def test_input_site_adapters_equal_manual_composition() -> None:
    model, sae = small_mlp(), _sae()
    x, td = _inputs()
    g, p = _adapted(model, {"sae": Adapter(sae, "[2]", "[2]", site="input")})
    assert torch.allclose(g(p, td)["output"], model[2](sae(model[1](model[0](x)))), atol=1e-6)
    torch.manual_seed(4)
    transcoder = nn.Linear(8, 8)
    # input of [1] is the pre-activation; the input of [2] is replaced
    g, p = _adapted(model, {"tc": Adapter(transcoder, "[1]", "[2]", site="input")})
    assert torch.allclose(g(p, td)["output"], model[2](transcoder(model[0](x))), atol=1e-6)


def test_two_adapters_compose() -> None:
    model, sae = small_mlp(), _sae()
    torch.manual_seed(5)
    head = nn.Linear(3, 3)
    adapters = {"sae": (sae, "[0]", "[0]"), "head": Adapter(head, "[2]", "[2]")}
    g, p = _adapted(model, adapters)
    x, td = _inputs()
    expected = head(model[2](model[1](sae(model[0](x)))))
    assert torch.allclose(g(p, td)["output"], expected, atol=1e-6)


def test_adapters_with_taps_see_original_then_replaced() -> None:
    """Taps of the base function run before the adapters, taps added later after them."""
    model, sae = small_mlp(), _sae()
    f = tdhook_fn.functional(model).with_taps(tdhook_fn.capture("[1]", key="h"))
    g = with_adapters(f, {"sae": (sae, "[1]", "[1]")}).with_taps(tdhook_fn.capture("[1]", key="rec"))
    p = tdhook_fn.params(model).update(adapter_params({"sae": (sae, "[1]", "[1]")}))
    x, td = _inputs()
    out = g(p, td)
    h = model[1](model[0](x))
    assert torch.allclose(out["h"], h, atol=1e-6)
    assert torch.allclose(out["rec"], sae(h), atol=1e-6)
    assert torch.allclose(out["output"], model[2](sae(h)), atol=1e-6)


@pytest.mark.parametrize("transcoder", [False, True])
def test_adapters_under_vmap(transcoder: bool) -> None:
    model, sae = small_mlp(), _sae()
    g, p = _adapted(model, {"a": (sae, "[0]", "[1]" if transcoder else "[0]")})
    x, td = _inputs(batch=6)
    batched = g(p, td)["output"]
    vmapped = torch.func.vmap(g, (None, 0))(p, td)["output"]
    per_sample = torch.stack([g(p, td[i])["output"] for i in range(6)])
    assert torch.allclose(vmapped, batched, atol=1e-6)
    assert torch.allclose(per_sample, batched, atol=1e-6)
    # over a stack of adapter weights
    stacked = torch.stack([p, p.apply(lambda t: t * 1.1)])
    over_params = torch.func.vmap(g, (0, None))(stacked, td)["output"]
    assert torch.allclose(over_params[0], batched, atol=1e-6)
    assert torch.allclose(over_params[1], g(p.apply(lambda t: t * 1.1), td)["output"], atol=1e-6)


class SAE(nn.Module):
    def __init__(self, d: int, width: int):
        super().__init__()
        self.enc = nn.Linear(d, width)
        self.dec = nn.Linear(width, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.dec(torch.relu(self.enc(h)))


def test_train_sae_with_func_grad() -> None:
    torch.manual_seed(0)
    model = small_mlp(0, d_in=6, d_hidden=16, d_out=3)
    sae = SAE(16, 32)
    adapters = {"sae": (sae, "[1]", "[1]")}
    f = tdhook_fn.functional(model).with_taps(tdhook_fn.capture("[1]", key="h"))
    g = with_adapters(f, adapters).with_taps(tdhook_fn.capture("[1]", key="rec"))
    model_params = tdhook_fn.params(model)
    weights = adapter_params(adapters)["adapters", "sae"]
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(1))
    td = TensorDict(input=x, batch_size=[64])
    l1 = 1e-3

    def losses(w: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
        full = model_params.clone(False)
        full["adapters"] = TensorDict({"sae": w}, batch_size=[])
        out = g(full, td)
        reconstruction = (out["rec"] - out["h"]).square().mean()
        latent = torch.relu(tdhook_fn.call(sae.enc, w["enc"], out["h"]))
        return reconstruction + l1 * latent.abs().sum(-1).mean(), reconstruction

    grad_fn = torch.func.grad(losses, has_aux=True)
    m = weights.apply(torch.zeros_like)
    v = weights.apply(torch.zeros_like)
    lr, b1, b2 = 1e-2, 0.9, 0.999
    first = None
    for step in range(1, 201):
        grads, reconstruction = grad_fn(weights)
        first = float(reconstruction) if first is None else first
        m = m.apply(lambda mi, gi: b1 * mi + (1 - b1) * gi, grads)
        v = v.apply(lambda vi, gi: b2 * vi + (1 - b2) * gi * gi, grads)
        weights = weights.apply(
            lambda w, mi, vi: w - lr * (mi / (1 - b1**step)) / ((vi / (1 - b2**step)).sqrt() + 1e-8), m, v
        )
    _, final = losses(weights)
    assert float(final) <= 0.5 * first, (first, float(final))
    # the module's own weights were not trained in place
    assert torch.equal(sae.enc.weight, adapter_params(adapters)["adapters", "sae", "enc", "weight"])


def test_missing_adapters_entry_is_a_key_error() -> None:
    model, sae = small_mlp(), _sae()
    g = with_adapters(tdhook_fn.functional(model), {"sae": (sae, "[0]", "[0]")})
    with pytest.raises(KeyError, match="adapters"):
        g(tdhook_fn.params(model), _inputs()[1])
    g2 = with_adapters(tdhook_fn.functional(model), {"sae": (sae, "[0]", "[0]")}, key="mine")
    p = tdhook_fn.params(model).update(adapter_params({"sae": (sae, "[0]", "[0]")}, key="mine"))
    assert torch.allclose(
        g2(p, _inputs()[1])["output"],
        g(tdhook_fn.params(model).update(adapter_params({"sae": (sae, "[0]", "[0]")})), _inputs()[1])["output"],
    )
    with pytest.raises(KeyError, match="mine"):
        g2(tdhook_fn.params(model).update(adapter_params({"sae": (sae, "[0]", "[0]")})), _inputs()[1])


@pytest.mark.parametrize(
    ("in_path", "out_path", "bad"),
    [
        ("[7]", "[7]", "[7]"),
        ("[0]", "nope", "nope"),
        ("missing.layer", "[1]", "missing.layer"),
    ],
)
def test_unresolvable_adapter_path(in_path: str, out_path: str, bad: str) -> None:
    model, sae = small_mlp(), _sae()
    with pytest.raises(ValueError, match="sae") as info:
        with_adapters(tdhook_fn.functional(model), {"sae": (sae, in_path, out_path)})
    assert repr(bad) in str(info.value)


def test_with_adapters_needs_a_functional() -> None:
    model, sae = small_mlp(), _sae()
    with pytest.raises(TypeError):
        with_adapters(model, {"sae": (sae, "[0]", "[0]")})


def test_nested_with_adapters_compose_and_missing_weights_are_named():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    a, b = nn.Linear(4, 4), nn.Linear(2, 2)
    td = TensorDict(input=torch.randn(5, 3), batch_size=[5])
    outer = with_adapters(with_adapters(tdhook_fn.functional(net), {"a": (a, "[0]", "[0]")}), {"b": (b, "[2]", "[2]")})
    p = tdhook_fn.params(net).update(adapter_params({"a": (a, "[0]", "[0]"), "b": (b, "[2]", "[2]")}))
    expected = b(net[2](net[1](a(net[0](td["input"])))))
    torch.testing.assert_close(outer(p, td)["output"], expected)
    with pytest.raises(KeyError, match="'b'"):
        outer(p.exclude(("adapters", "b")), td)
