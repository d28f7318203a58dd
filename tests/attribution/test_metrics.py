"""infidelity and sensitivity_max against captum 0.9.0, given the same perturbations.

Both sides get perturbation functions drawing from a generator reset to the same seed
(or torch's global one, reseeded), so they draw the same numbers for the same (sample,
copy): our copies ``[*B, k]`` are captum's ``repeat_interleave`` layout ``[N * k]``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _tolerance import assert_close_ulps
from captum.attr import Saliency
from captum.metrics import infidelity as captum_infidelity
from captum.metrics import sensitivity_max as captum_sensitivity_max
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torch import nn
from zoo import TwoInput

import tdhook_fn
from tdhook_fn.attribution import integrated_gradients, saliency
from tdhook_fn.attribution.metrics import infidelity, normal_perturbation, sensitivity_max, uniform_perturbation

SEED = 7


def cnn(dtype: torch.dtype = torch.float32) -> nn.Module:
    """A digits-sized CNN: ``[N, 1, 8, 8] -> [N, 10]``."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64, 10))
    return net.to(dtype).eval()


def mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)).to(dtype).eval()


def digits(model: str, n: int = 4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    from sklearn.datasets import load_digits

    x = torch.as_tensor(load_digits().data[:n] / 16.0, dtype=dtype)
    return x.reshape(n, 1, 8, 8) if model == "cnn" else x


MODELS = {"cnn": cnn, "mlp": mlp}


def seeded_noise(scale: float = 0.1) -> Callable[..., Any]:
    """captum's perturbation contract, drawing from a generator reset at each metric call (via ``reset``)."""
    g = torch.Generator()

    def perturb(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(x.shape, generator=g, dtype=x.dtype) * scale
        return noise, x - noise

    perturb.reset = lambda: g.manual_seed(SEED)  # type: ignore[attr-defined]
    return perturb


def tds_of(perturb: Callable[..., Any], keys: list[str]) -> Callable[..., Any]:
    """The tensor perturbation of each key in turn (captum's tuple order), on TensorDicts."""

    def on_td(copies: TensorDict) -> tuple[TensorDict, TensorDict]:
        dx, moved = TensorDict({}, batch_size=copies.batch_size), TensorDict({}, batch_size=copies.batch_size)
        for key in keys:
            d, m = perturb(copies[key])
            dx[key], moved[key] = d, m
        return dx, moved

    return on_td


# ------------------------------------------------------------------------- infidelity


@pytest.mark.parametrize("model", ["cnn", "mlp"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("target_form", ["int", "tensor"])
def test_infidelity_equals_captum(model: str, normalize: bool, target_form: str) -> None:
    net = MODELS[model]()
    f, p = tdhook_fn.pure(net)
    x = digits(model)
    target: Any = 3 if target_form == "int" else net(x).argmax(-1)
    attr = saliency(f, p, x, target=target)
    perturb = seeded_noise()
    perturb.reset()
    ours = infidelity(f, p, perturb, x, attr, target=target, n_perturb_samples=6, normalize=normalize)
    perturb.reset()
    theirs = captum_infidelity(net, perturb, x, attr, target=target, n_perturb_samples=6, normalize=normalize)
    assert ours.shape == theirs.shape == (4,)
    assert_close_ulps(ours, theirs, ulps=64)


@pytest.mark.parametrize("chunk_size", [1, 4])
def test_infidelity_chunks_equal_captum_batches(chunk_size: int) -> None:
    net = mlp()
    f, p = tdhook_fn.pure(net)
    x = digits("mlp")
    attr = saliency(f, p, x, target=2, multiply_by_inputs=True)
    perturb = seeded_noise()
    perturb.reset()
    ours = infidelity(f, p, perturb, x, attr, target=2, n_perturb_samples=7, chunk_size=chunk_size)
    perturb.reset()
    theirs = captum_infidelity(net, perturb, x, attr, target=2, n_perturb_samples=7,
                               max_examples_per_batch=chunk_size * len(x))
    assert_close_ulps(ours, theirs, ulps=64)


def test_infidelity_several_keys_and_baselines_equal_captum() -> None:
    torch.manual_seed(2)
    net = TwoInput(3).eval()
    f, p = tdhook_fn.pure(net, in_keys=["x", "y"])
    x, y = torch.randn(3, 4), torch.randn(3, 3)
    td = TensorDict(x=x, y=y, batch_size=[3])
    attr = saliency(f, p, td, target=1)
    g = torch.Generator()

    def perturb(inputs: tuple[torch.Tensor, ...], baselines: tuple[torch.Tensor, ...]) -> Any:
        dx = tuple(torch.randn(i.shape, generator=g) * (i - b) * 0.1 for i, b in zip(inputs, baselines, strict=True))
        return dx, tuple(i - d for i, d in zip(inputs, dx, strict=True))

    def on_td(copies: TensorDict, base: TensorDict) -> tuple[TensorDict, TensorDict]:
        dx, moved = perturb((copies["x"], copies["y"]), (base["x"], base["y"]))
        batch = copies.batch_size
        return TensorDict(x=dx[0], y=dx[1], batch_size=batch), TensorDict(x=moved[0], y=moved[1], batch_size=batch)

    base = TensorDict(x=torch.randn(3, 4), y=torch.randn(3, 3), batch_size=[3])
    g.manual_seed(SEED)
    ours = infidelity(f, p, on_td, td, attr, target=1, baselines=base, n_perturb_samples=5)
    g.manual_seed(SEED)
    theirs = captum_infidelity(net, perturb, (x, y), (attr["x"], attr["y"]), baselines=(base["x"], base["y"]),
                               target=1, n_perturb_samples=5)
    assert_close_ulps(ours, theirs, ulps=64)


def test_infidelity_float64_equals_captum() -> None:
    net = cnn(torch.float64)
    f, p = tdhook_fn.pure(net)
    x = digits("cnn", dtype=torch.float64)
    attr = integrated_gradients(f, p, x, torch.zeros_like(x), target=4, n_steps=8)
    perturb = seeded_noise()
    for normalize in (False, True):
        perturb.reset()
        ours = infidelity(f, p, perturb, x, attr, target=4, normalize=normalize)
        perturb.reset()
        theirs = captum_infidelity(net, perturb, x, attr, target=4, normalize=normalize)
        assert ours.dtype == torch.float64
        assert_close_ulps(ours, theirs, ulps=64)


def test_infidelity_batch_shapes_and_vmap() -> None:
    net = mlp()
    f, p = tdhook_fn.pure(net)
    flat = TensorDict(input=digits("mlp", 6), batch_size=[6])
    attr = saliency(f, p, flat, target=1)

    def shift(copies: TensorDict) -> tuple[TensorDict, TensorDict]:  # deterministic: copy j moves by 0.01 (j + 1)
        steps = torch.arange(1, copies.batch_size[-1] + 1, dtype=torch.float32)
        dx = (0.01 * steps.reshape(-1, 1) * torch.cos(copies["input"])).clone()
        return TensorDict(input=dx, batch_size=copies.batch_size), copies.apply(lambda v: v - dx)

    once = infidelity(f, p, shift, flat, attr, target=1, n_perturb_samples=3)
    grid = infidelity(f, p, shift, flat.reshape(2, 3), attr.reshape(2, 3), target=1, n_perturb_samples=3)
    assert grid.shape == (2, 3)
    assert_close_ulps(grid.reshape(6), once, ulps=16)
    per_sample = torch.vmap(lambda td, a: infidelity(f, p, shift, td, a, target=1, n_perturb_samples=3))(flat, attr)
    assert_close_ulps(per_sample, once, ulps=16)
    one = infidelity(f, p, shift, flat[0], attr[0], target=1, n_perturb_samples=3)
    assert one.shape == ()
    assert_close_ulps(one, once[0], ulps=16)


def test_infidelity_label_and_callable_targets() -> None:
    net = mlp()
    f, p = tdhook_fn.pure(net)
    x = digits("mlp")
    labels = net(x).argmax(-1)
    td = TensorDict(input=x, y=labels, batch_size=[4])
    attr = saliency(f, p, td, target=tdhook_fn.label("y")).select("input")
    perturb = tds_of(seeded_noise(), ["input"])
    seeded = seeded_noise()
    seeded.reset()
    with_label = infidelity(f, p, tds_of(seeded, ["input"]), td, attr, target=tdhook_fn.label("y"))
    seeded.reset()
    with_tensor = infidelity(f, p, tds_of(seeded, ["input"]), td.select("input"), attr, target=labels)
    assert_close_ulps(with_label, with_tensor, ulps=4)
    del perturb
    # several targets are summed, as the gradient methods attribute their sum
    two = saliency(f, p, x, target=(1, 2))
    seeded.reset()
    summed = infidelity(f, p, seeded, x, two, target=(1, 2), n_perturb_samples=3)
    seeded.reset()
    by_callable = infidelity(f, p, seeded, x, two, target=lambda out: out["output"][..., 1] + out["output"][..., 2],
                             n_perturb_samples=3)
    assert_close_ulps(summed, by_callable, ulps=4)


def test_infidelity_is_differentiable_in_the_attributions_and_leaves_inputs_alone() -> None:
    net = mlp()
    f, p = tdhook_fn.pure(net)
    x = TensorDict(input=digits("mlp"), batch_size=[4])
    before = x.clone()
    attr = saliency(f, p, x, target=0)
    perturb = functools.partial(normal_perturbation, std=0.05, generator=torch.Generator().manual_seed(0))
    grad = torch.func.grad(lambda a: infidelity(f, p, perturb, x, a, target=0, n_perturb_samples=4).sum())(attr)
    assert grad["input"].shape == x["input"].shape and bool(grad["input"].abs().sum() > 0)
    assert (x == before).all()


def test_a_transformer_layer_equals_captum() -> None:
    torch.manual_seed(4)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    net = nn.Sequential(layer, nn.Flatten(), nn.Linear(5 * 8, 3)).eval()
    f, p = tdhook_fn.pure(net)
    x = torch.randn(3, 5, 8)
    attr = saliency(f, p, x, target=2)
    perturb = seeded_noise(0.05)
    perturb.reset()
    ours = infidelity(f, p, perturb, x, attr, target=2, n_perturb_samples=4, normalize=True)
    perturb.reset()
    theirs = captum_infidelity(net, perturb, x, attr, target=2, n_perturb_samples=4, normalize=True)
    assert_close_ulps(ours, theirs, ulps=256)
    explain = functools.partial(saliency, f, p, abs=True)
    torch.manual_seed(SEED)
    ours = sensitivity_max(explain, x, target=2, n_perturb_samples=3)
    torch.manual_seed(SEED)
    theirs = captum_sensitivity_max(Saliency(net).attribute, x, target=2, n_perturb_samples=3)
    assert_close_ulps(ours, theirs, ulps=256)


def test_sensitivity_leaves_the_inputs_alone() -> None:
    f, p = tdhook_fn.pure(mlp())
    x = TensorDict(input=digits("mlp"), batch_size=[4])
    before = x.clone()
    sensitivity_max(functools.partial(saliency, f, p, target=0), x, n_perturb_samples=3, chunk_size=2)
    assert (x == before).all() and set(x.keys()) == {"input"}


def test_normal_perturbation_draws_copy_by_copy() -> None:
    copies = TensorDict(a=torch.zeros(2, 3, 5), b=torch.ones(2, 3, 4), batch_size=[2, 3])
    dx, moved = normal_perturbation(copies, 0.5, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(1)
    for j in range(3):
        for key, shape in (("a", (2, 5)), ("b", (2, 4))):
            expected = copies[key][:, j] + 0.5 * torch.randn(shape, generator=g)
            assert torch.equal(moved[key][:, j], expected)
    assert torch.equal(dx["a"], copies["a"] - moved["a"])


# ------------------------------------------------------------------------- sensitivity


@pytest.mark.parametrize("model", ["cnn", "mlp"])
@pytest.mark.parametrize("target_form", ["int", "tensor"])
@pytest.mark.parametrize("norm_ord", ["fro", 1])
def test_sensitivity_max_equals_captum(model: str, target_form: str, norm_ord: Any) -> None:
    net = MODELS[model]()
    f, p = tdhook_fn.pure(net)
    x = digits(model)
    target: Any = 5 if target_form == "int" else net(x).argmax(-1)
    explain = functools.partial(saliency, f, p, abs=True)
    torch.manual_seed(SEED)  # both draw captum's default uniform noise from the global generator
    ours = sensitivity_max(explain, x, target=target, n_perturb_samples=5, norm_ord=norm_ord, perturb_radius=0.05)
    torch.manual_seed(SEED)
    theirs = captum_sensitivity_max(Saliency(net).attribute, x, target=target, n_perturb_samples=5,
                                    norm_ord=norm_ord, perturb_radius=0.05)
    assert ours.shape == theirs.shape == (4,)
    assert_close_ulps(ours, theirs, ulps=64)


def test_sensitivity_max_chunks_equal_captum_batches() -> None:
    net = cnn()
    f, p = tdhook_fn.pure(net)
    x = digits("cnn")
    explain = functools.partial(saliency, f, p, abs=True)
    torch.manual_seed(SEED)
    ours = sensitivity_max(explain, x, target=1, n_perturb_samples=7, chunk_size=3)
    torch.manual_seed(SEED)
    theirs = captum_sensitivity_max(Saliency(net).attribute, x, target=1, n_perturb_samples=7,
                                    max_examples_per_batch=3 * len(x))
    assert_close_ulps(ours, theirs, ulps=64)


def test_sensitivity_max_several_keys_equals_captum() -> None:
    torch.manual_seed(3)
    net = TwoInput(3).eval()
    f, p = tdhook_fn.pure(net, in_keys=["x", "y"])
    x, y = torch.randn(3, 4), torch.randn(3, 3)
    td = TensorDict(x=x, y=y, batch_size=[3])
    explain = functools.partial(saliency, f, p, abs=True)
    torch.manual_seed(SEED)
    ours = sensitivity_max(explain, td, target=2, n_perturb_samples=4, perturb_func=functools.partial(
        uniform_perturbation, keys=["x", "y"]))
    torch.manual_seed(SEED)
    theirs = captum_sensitivity_max(Saliency(net).attribute, (x, y), target=2, n_perturb_samples=4)
    assert_close_ulps(ours, theirs, ulps=64)
    per_key = sensitivity_max(explain, td, target=2, n_perturb_samples=4, per_key=True)
    assert set(per_key.keys()) == {"x", "y"} and per_key["x"].shape == (3,)


def test_sensitivity_max_float64_generator_batch_shapes_and_vmap() -> None:
    net = mlp(torch.float64)
    f, p = tdhook_fn.pure(net)
    flat = TensorDict(input=digits("mlp", 6, torch.float64), batch_size=[6])
    explain = functools.partial(saliency, f, p, target=3)
    noise = functools.partial(uniform_perturbation, generator=torch.Generator())
    noise.keywords["generator"].manual_seed(0)
    once = sensitivity_max(explain, flat, perturb_func=noise, n_perturb_samples=3)
    assert once.dtype == torch.float64
    noise.keywords["generator"].manual_seed(0)
    again = sensitivity_max(explain, flat, perturb_func=noise, n_perturb_samples=3)
    assert torch.equal(once, again)

    def shift(copies: TensorDict, radius: float) -> TensorDict:
        steps = torch.arange(1, copies.batch_size[-1] + 1, dtype=torch.float64).reshape(-1, 1)
        return copies.apply(lambda v: v + radius * steps * torch.sin(v))

    base = sensitivity_max(explain, flat, perturb_func=shift, n_perturb_samples=3)
    grid = sensitivity_max(explain, flat.reshape(2, 3), perturb_func=shift, n_perturb_samples=3)
    assert_close_ulps(grid.reshape(6), base, ulps=16)
    mapped = torch.vmap(lambda td: sensitivity_max(explain, td, perturb_func=shift, n_perturb_samples=3))(flat)
    assert_close_ulps(mapped, base, ulps=16)
    given = sensitivity_max(explain, flat, perturb_func=shift, n_perturb_samples=3, explanations=explain(flat))
    assert_close_ulps(given, base, ulps=4)


# ------------------------------------------------------------------------- properties

PROPERTY = settings(max_examples=20, deadline=None)


@st.composite
def linear_case(draw: Any) -> tuple[nn.Module, TensorDict, int, float]:
    seed = draw(st.integers(0, 2**16))
    batch = draw(st.sampled_from([(), (3,), (2, 2)]))
    torch.manual_seed(seed)
    net = nn.Linear(5, 3).double().eval()
    x = TensorDict(input=torch.randn(*batch, 5, dtype=torch.float64), batch_size=list(batch))
    return net, x, draw(st.integers(0, 2)), draw(st.floats(1e-3, 10.0))


def _noise(scale: float) -> Callable[..., Any]:
    g = torch.Generator().manual_seed(0)
    return functools.partial(normal_perturbation, std=scale, generator=g)


@PROPERTY
@given(linear_case())
def test_exact_gradients_of_a_linear_model_have_zero_infidelity(case: Any) -> None:
    """F(x) - F(x - I) = I . grad F exactly for an affine F, whatever the perturbation's size."""
    net, x, target, scale = case
    f, p = tdhook_fn.pure(net)
    attr = saliency(f, p, x, target=target)
    score = infidelity(f, p, _noise(scale), x, attr, target=target, n_perturb_samples=4)
    assert score.shape == x.batch_size
    torch.testing.assert_close(score, torch.zeros_like(score), atol=1e-20 + 1e-24 * scale**2, rtol=0)


@PROPERTY
@given(linear_case(), st.floats(-50.0, 50.0).filter(lambda c: abs(c) > 1e-3))
def test_normalized_infidelity_ignores_the_attributions_scale(case: Any, c: float) -> None:
    net, x, target, scale = case
    f, p = tdhook_fn.pure(nn.Sequential(net, nn.Tanh()))
    attr = saliency(f, p, x, target=target).apply(lambda a: a + 0.3 * torch.randn_like(a))
    one = infidelity(f, p, _noise(scale), x, attr, target=target, n_perturb_samples=4, normalize=True)
    scaled = infidelity(f, p, _noise(scale), x, attr.apply(lambda a: c * a), target=target, n_perturb_samples=4,
                        normalize=True)
    torch.testing.assert_close(scaled, one, rtol=1e-9, atol=1e-12)


@PROPERTY
@given(linear_case())
def test_saliency_of_a_linear_model_has_zero_sensitivity(case: Any) -> None:
    """The gradient of an affine map does not change with the input."""
    net, x, target, radius = case
    f, p = tdhook_fn.pure(net)
    explain = functools.partial(saliency, f, p, target=target)
    noise = functools.partial(uniform_perturbation, generator=torch.Generator().manual_seed(0))
    score = sensitivity_max(explain, x, perturb_func=noise, perturb_radius=radius, n_perturb_samples=3)
    assert score.shape == x.batch_size
    assert bool((score == 0).all())


def test_a_non_tensor_input_reaches_the_forward_of_every_copy() -> None:
    """The copies go to ``f`` flat (NOTE [flat copies]); a string kwarg goes with them."""
    from tensordict import NonTensorData
    from zoo import Moded

    torch.manual_seed(0)
    net = Moded()
    moded, p = tdhook_fn.pure(net, in_keys={"input": "x", "mode": "mode"})
    plain, plain_params = tdhook_fn.pure(nn.Sequential(net.lin, nn.Tanh()))
    x, attr = torch.randn(3, 2), torch.randn(3, 2)
    td = TensorDict(input=x, batch_size=[3])
    td["mode"] = NonTensorData("tanh")

    def perturb(copies: TensorDict) -> tuple[TensorDict, TensorDict]:
        step = torch.arange(copies["input"].numel()).reshape(copies["input"].shape) % 5 * 0.1
        moved = TensorDict(input=copies["input"] - step, batch_size=copies.batch_size)
        return TensorDict(input=step, batch_size=copies.batch_size), moved

    ours = infidelity(moded, p, perturb, td, TensorDict(input=attr, batch_size=[3]), target=0, n_perturb_samples=4)
    want = infidelity(plain, plain_params, perturb, TensorDict(input=x, batch_size=[3]),
                      TensorDict(input=attr, batch_size=[3]), target=0, n_perturb_samples=4)
    torch.testing.assert_close(ours, want)
