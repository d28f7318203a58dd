"""tdhook_fn.attribution.activation_maximisation: against a hand-written ascent, under vmap, untouched inputs."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from _tolerance import assert_close_ulps
from tensordict import TensorDict
from torch import nn
from zoo import TwoInput, cnn, mlp, same, snapshot

import tdhook_fn
from tdhook_fn.attribution import activation_maximisation

MODELS = {"mlp": (mlp, (4,)), "cnn": (cnn, (1, 5, 5))}


def setup(name: str, batch: tuple[int, ...] = (3,), dtype: torch.dtype = torch.float64):
    build, shape = MODELS[name]
    torch.manual_seed(0)
    model = build().eval().to(dtype)
    x = torch.randn(*batch, *shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    return model, tdhook_fn.functional(model), tdhook_fn.params(model), TensorDict(input=x, batch_size=list(batch))


def by_hand(objective: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, alpha: float = 0.1,
            n_steps: int = 10, low: float = -math.inf, high: float = math.inf) -> torch.Tensor:
    """The reference ascent: autograd on a plain tensor, one step at a time."""
    for _ in range(n_steps):
        x = x.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(objective(x).sum(), x)
        x = torch.clamp(x + alpha * g, min=low, max=high)
    return x.detach()


# -- values ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_hand_written_ascent(name: str, dtype: torch.dtype) -> None:
    model, f, p, td = setup(name, dtype=dtype)
    x, n = td["input"], 10 if name == "mlp" else 4  # tdhook's default: 10 steps
    out = activation_maximisation(f, p, td, target=1, **({} if n == 10 else {"n_steps": n}))
    assert_close_ulps(out["input"], by_hand(lambda v: model(v)[:, 1], x, n_steps=n))
    out = activation_maximisation(f, p, td, target=(0, 2), alpha=0.3, n_steps=4, min_value=-0.4, max_value=0.6)
    assert_close_ulps(out["input"], by_hand(lambda v: model(v)[:, [0, 2]], x, 0.3, 4, -0.4, 0.6))


def test_step_count_and_unclamped_start() -> None:
    model, f, p, td = setup("mlp")
    td["input"] = 3 * td["input"]  # outside the bounds: tdhook clamps only after a step
    for n in (0, 1, 3):
        out = activation_maximisation(f, p, td, target=0, n_steps=n, min_value=-1.0, max_value=1.0)
        assert_close_ulps(out["input"], by_hand(lambda v: model(v)[:, 0], td["input"], 0.1, n, -1.0, 1.0))
    assert activation_maximisation(f, p, td, target=0, n_steps=0)["input"].abs().max() > 1


def test_target_layers_and_cotangents() -> None:
    model, f, p, td = setup("cnn")
    layer = lambda o: TensorDict(act=o["[1]"][:, 2].sum((-1, -2)), batch_size=o.batch_size)
    out = activation_maximisation(f, p, td, target=layer, target_layers=["[1]"], n_steps=3)
    assert_close_ulps(out["input"], by_hand(lambda v: model[:2](v)[:, 2], td["input"], n_steps=3))
    doubled = lambda values: values.apply(lambda v: 2 * torch.ones_like(v))
    out = activation_maximisation(f, p, td, target=0, cotangents=doubled, n_steps=3)
    assert_close_ulps(out["input"], by_hand(lambda v: 2 * model(v)[:, 0], td["input"], n_steps=3))


def test_extra_keys_stay_and_reach_the_target() -> None:
    model, f, p, td = setup("mlp")
    td["y"] = torch.tensor([2, 0, 1])
    out = activation_maximisation(f, p, td, target=tdhook_fn.label("y"), n_steps=4)
    assert list(out.keys()) == ["input"]
    picked = lambda v: model(v).gather(1, td["y"][:, None])
    assert_close_ulps(out["input"], by_hand(picked, td["input"], n_steps=4))


def test_input_keys_choose_what_moves() -> None:
    torch.manual_seed(0)
    model = TwoInput().double().eval()
    f, p = tdhook_fn.functional(model, ["x", "y"], ["output"]), tdhook_fn.params(model)
    td = TensorDict(x=torch.randn(3, 4, dtype=torch.float64), y=torch.randn(3, 3, dtype=torch.float64),
                    batch_size=[3])
    both = activation_maximisation(f, p, td, target=1, n_steps=3)
    assert set(both.keys()) == {"x", "y"}
    only_x = activation_maximisation(f, p, td, target=1, n_steps=3, input_keys=["x"])
    assert list(only_x.keys()) == ["x"]
    assert_close_ulps(only_x["x"], by_hand(lambda v: model(v, td["y"])[:, 1], td["x"], n_steps=3))


# -- several objectives and seeds -----------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_per_target_is_one_ascent_per_target(name: str) -> None:
    model, f, p, td = setup(name)
    out = activation_maximisation(f, p, td, target=(2, 0), per_target=True, n_steps=3, max_value=0.8)
    assert out.batch_size == torch.Size([2, 3])
    for t, k in enumerate((2, 0)):
        alone = activation_maximisation(f, p, td, target=k, n_steps=3, max_value=0.8)
        assert_close_ulps(out["input"][t], alone["input"])
        assert_close_ulps(out["input"][t], by_hand(lambda v, k=k: model(v)[:, k], td["input"], 0.1, 3, high=0.8))


def test_per_target_with_a_callable_and_cotangents() -> None:
    _, f, p, td = setup("mlp")
    pair = lambda o: TensorDict(a=o["output"][:, :2], b=o["[0]"][:, 4:6], batch_size=o.batch_size)
    halved = lambda values: values.apply(lambda v: 0.5 * torch.ones_like(v))
    out = activation_maximisation(f, p, td, target=pair, target_layers=["[0]"], per_target=True, n_steps=3,
                                  cotangents=halved)
    for t in range(2):
        one = lambda o, t=t: pair(o).apply(lambda v: v[:, t])
        alone = activation_maximisation(f, p, td, target=one, target_layers=["[0]"], n_steps=3, cotangents=halved)
        assert_close_ulps(out["input"][t], alone["input"])


def test_seeds_under_vmap_equal_a_loop_and_a_batch() -> None:
    _, f, p, _ = setup("cnn")
    seeds = TensorDict(input=torch.randn(3, 2, 1, 5, 5, dtype=torch.float64), batch_size=[3, 2])
    run = lambda td: activation_maximisation(f, p, td, target=2, n_steps=3, min_value=-2.0, max_value=2.0)
    mapped = torch.func.vmap(run)(seeds)
    looped = torch.stack([run(seeds[s]) for s in range(3)])
    assert_close_ulps(mapped, looped)
    assert_close_ulps(run(seeds), looped)  # a seed dim is a batch dim


def test_any_batch_size() -> None:
    _, f, p, td = setup("mlp", batch=(2, 3))
    out = activation_maximisation(f, p, td, target=(0, 1), per_target=True, n_steps=3)
    assert out.batch_size == torch.Size([2, 2, 3])
    flat = activation_maximisation(f, p, td.reshape(-1), target=(0, 1), per_target=True, n_steps=3)
    assert_close_ulps(out["input"], flat["input"].reshape(2, 2, 3, 4))
    _, f, p, td = setup("mlp", batch=())
    assert activation_maximisation(f, p, td, target=1, n_steps=2)["input"].shape == torch.Size([4])


def test_grad_through_the_ascent() -> None:
    model, f, p, td = setup("mlp")
    score = lambda params: activation_maximisation(f, params, td, target=1, n_steps=2)["input"].sum()
    ours = torch.func.grad(score)(p)
    weights = dict(model.named_parameters())
    x = td["input"]
    for _ in range(2):
        x = x if x.requires_grad else x.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(model(x)[:, 1].sum(), x, create_graph=True)
        x = x + 0.1 * g
    expected = torch.autograd.grad(x.sum(), list(weights.values()), allow_unused=True)
    for (name, w), e in zip(weights.items(), expected, strict=True):
        assert_close_ulps(ours.get(tuple(name.split("."))), torch.zeros_like(w) if e is None else e, ulps=16)


# -- nothing changes --------------------------------------------------------------------------


def test_model_params_and_inputs_untouched() -> None:
    model, f, p, td = setup("cnn")
    before, params_before = snapshot(model), p.clone()
    leaves = {k: (v, v.clone(), v.requires_grad) for k, v in p.items(True, True)}
    x, x_before = td["input"], td["input"].clone()
    out = activation_maximisation(f, p, td, target=(0, 1), per_target=True, n_steps=3)
    zero = activation_maximisation(f, p, td, target=0, n_steps=0)
    assert same(before, snapshot(model))
    assert (p == params_before).all()
    for k, (v, value, grad) in leaves.items():
        assert p.get(k) is v and torch.equal(v, value) and v.requires_grad == grad
    assert td["input"] is x and torch.equal(x, x_before) and not x.requires_grad
    assert list(td.keys()) == ["input"]
    assert zero["input"] is not x and torch.equal(zero["input"], x)
    assert not out["input"].requires_grad


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "error", "match"), [
    ({"alpha": "0.1"}, TypeError, "alpha must be a number"),
    ({"alpha": True}, TypeError, "alpha must be a number"),
    ({"alpha": math.nan}, ValueError, "alpha is NaN"),
    ({"n_steps": 2.0}, TypeError, "n_steps must be an int"),
    ({"n_steps": -1}, ValueError, "n_steps must be >= 0"),
    ({"min_value": None}, TypeError, "min_value must be a number"),
    ({"min_value": 1.0, "max_value": 0.0}, ValueError, "min_value .* above max_value"),
    ({"max_value": math.nan}, ValueError, "max_value is NaN"),
    ({"per_target": 1}, TypeError, "per_target must be a bool"),
    ({"target_layers": "[0]"}, TypeError, r"target_layers=\['\[0\]'\]"),
    ({"input_keys": ["image"]}, KeyError, "no attributed key 'image'"),
    ({"input_keys": "input"}, TypeError, r"write \['input'\]"),
    ({"target": "output"}, TypeError, "target"),
])
def test_bad_options(options: dict, error: type[Exception], match: str) -> None:
    _, f, p, td = setup("mlp")
    kwargs = {"target": 1, **options}
    with pytest.raises(error, match=match):
        activation_maximisation(f, p, td, **kwargs)


def test_bad_arguments() -> None:
    model, f, p, td = setup("mlp")
    with pytest.raises(TypeError, match="activation_maximisation: f is the module Sequential"):
        activation_maximisation(model, p, td, target=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="params must be a TensorDict"):
        activation_maximisation(f, dict(model.named_parameters()), td, target=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="inputs must be a TensorDict"):
        activation_maximisation(f, p, [td["input"]], target=1)  # type: ignore[arg-type]
    ids = TensorDict(input=torch.zeros(3, 4, dtype=torch.long), batch_size=[3])
    with pytest.raises(TypeError, match="input 'input' is torch.int64"):
        activation_maximisation(f, p, ids, target=1, input_keys=["input"])
    with pytest.raises(ValueError, match="no floating-point input to optimise"):
        activation_maximisation(lambda params, td: td, p, ids, target=1)
    uneven = lambda o: TensorDict(a=o["output"][:, :2], b=o["output"], batch_size=o.batch_size)
    with pytest.raises(ValueError, match="same number of targets"):
        activation_maximisation(f, p, td, target=uneven, per_target=True)
    with pytest.raises(ValueError, match="does not depend differentiably"):
        activation_maximisation(f, p, td, target=lambda o: o.apply(lambda v: v.detach()), n_steps=1)


def test_train_mode_is_named() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    td = TensorDict(input=torch.randn(3, 4), batch_size=[3])
    with pytest.warns(RuntimeWarning, match="activation_maximisation: modules .* apply dropout in training mode"):
        activation_maximisation(tdhook_fn.functional(model), tdhook_fn.params(model), td, target=1)


def test_a_plain_tensor_input_gives_a_tensor_like_the_other_methods() -> None:
    model, f, p, td = setup("mlp")
    as_td = activation_maximisation(f, p, td, target=1, n_steps=3)["input"]
    assert torch.equal(activation_maximisation(f, p, td["input"], target=1, n_steps=3), as_td)
