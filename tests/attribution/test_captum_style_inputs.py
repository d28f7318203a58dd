"""What a captum user passes: tensors as inputs, targets and baselines, and a module.

Every method takes them through one normalisation (NOTE [captum-style calls] in
``tdhook_fn/attribution/_engine.py``); these tests hold it to the TensorDict path and to
captum 0.9.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _tolerance import assert_close_ulps
from captum.attr import IntegratedGradients
from tensordict import TensorDict

import tdhook_fn
from tdhook_fn.attribution import (
    DimsConfig,
    Epsilon,
    grad_cam,
    guided_backprop,
    integrated_gradients,
    lrp,
    saliency,
)

N, F, C = 5, 4, 3


def mlp(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(F, 8), torch.nn.ReLU(), torch.nn.Linear(8, C)).to(dtype).eval()


def batch(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(N, F, generator=torch.Generator().manual_seed(1), dtype=dtype)


# each method on (f, params, inputs, target): the one map it gives for the MLP
METHODS: dict[str, Callable[..., Any]] = {
    "saliency": lambda f, p, x, t: saliency(f, p, x, target=t),
    "input_x_gradient": lambda f, p, x, t: saliency(f, p, x, target=t, multiply_by_inputs=True),
    "integrated_gradients": lambda f, p, x, t: integrated_gradients(f, p, x, 0.0, target=t, n_steps=8),
    "layer_integrated_gradients": lambda f, p, x, t: integrated_gradients(f, p, x, 0.0, target=t, n_steps=8,
                                                                          layers=["[1]"]),
    "grad_cam": lambda f, p, x, t: grad_cam(f, p, x, target=t, layers={"[1]": DimsConfig()}),
    "guided_backprop": lambda f, p, x, t: guided_backprop(f, p, x, target=t),
    "lrp": lambda f, p, x, t: lrp(f, p, x, target=t, rules={torch.nn.Linear: Epsilon()}, warn_on_missing_rule=False),
}


def the_map(result: Any) -> torch.Tensor:
    (key,) = list(result.keys(True, True))
    return result.get(key)


@pytest.mark.parametrize("name", list(METHODS))
def test_a_tensor_input_gives_the_tensordict_path_as_a_tensor(name):
    model, x = mlp(), batch()
    f, p = tdhook_fn.pure(model)
    target = model(x).argmax(-1)
    ours = METHODS[name](f, p, x, target)
    expected = METHODS[name](f, p, TensorDict(input=x, batch_size=[N]), target)
    assert isinstance(ours, torch.Tensor)
    assert torch.equal(ours, the_map(expected))


def test_a_tensor_input_keeps_the_convergence_delta_and_per_target_dims():
    model, x = mlp(), batch()
    f, p = tdhook_fn.pure(model)
    td = TensorDict(input=x, batch_size=[N])
    attr, delta = integrated_gradients(f, p, x, 0.0, target=(0, 2), per_target=True, return_convergence_delta=True)
    ref, ref_delta = integrated_gradients(f, p, td, 0.0, target=(0, 2), per_target=True,
                                          return_convergence_delta=True)
    assert attr.shape == (2, N, F) and torch.equal(attr, ref["input"]) and torch.equal(delta, ref_delta)


def test_a_tensor_input_uses_the_one_in_key_of_f():
    model, x = mlp(), batch()
    f, p = tdhook_fn.functional(model, in_keys=["pixels"]), tdhook_fn.params(model)
    ours = saliency(f, p, x, target=1)
    assert torch.equal(ours, saliency(f, p, TensorDict(pixels=x, batch_size=[N]), target=1)["pixels"])


@pytest.mark.parametrize("name", list(METHODS))
def test_a_tensor_of_class_indices_equals_the_label_and_one_int_per_sample(name):
    model, x = mlp(torch.float64), batch(torch.float64)
    f, p = tdhook_fn.pure(model)
    classes = torch.tensor([2, 0, 1, 1, 2])
    ours = METHODS[name](f, p, TensorDict(input=x, batch_size=[N]), classes)
    labelled = METHODS[name](f, p, TensorDict(input=x, y=classes, batch_size=[N]), tdhook_fn.label("y"))
    assert torch.equal(the_map(ours), the_map(labelled))
    one_by_one = torch.cat([the_map(METHODS[name](f, p, TensorDict(input=x[i : i + 1], batch_size=[1]), int(c)))
                            for i, c in enumerate(classes)])
    torch.testing.assert_close(the_map(ours), one_by_one)  # other batch sizes: other roundings (lrp divides)


def test_class_indices_may_count_from_the_end_and_be_one_for_all():
    model, x = mlp(), batch()
    f, p = tdhook_fn.pure(model)
    assert torch.equal(saliency(f, p, x, target=torch.full((N,), -1)), saliency(f, p, x, target=C - 1))
    assert torch.equal(saliency(f, p, x, target=torch.tensor(1)), saliency(f, p, x, target=1))


@pytest.mark.parametrize("shape", [(), (2, 3)], ids=str)
def test_class_indices_follow_any_batch_shape_and_vmap(shape):
    model = mlp()
    f, p = tdhook_fn.pure(model)
    x = torch.randn(*shape, F)
    td = TensorDict(input=x, batch_size=list(shape))
    classes = torch.arange(td.numel()).remainder(C).reshape(shape)
    ours = integrated_gradients(f, p, td, 0.0, target=classes, n_steps=4)["input"]
    labelled = integrated_gradients(f, p, td.clone().set("y", classes), 0.0, target=tdhook_fn.label("y"), n_steps=4)
    assert torch.equal(ours, labelled["input"])
    flat = td.reshape(-1)
    per_sample = torch.func.vmap(lambda s, t: saliency(f, p, s, target=t))(flat, classes.reshape(-1))
    assert_close_ulps(per_sample["input"].reshape(x.shape), saliency(f, p, td, target=classes)["input"])


def test_a_target_may_return_a_plain_tensor():
    model, x = mlp(), batch()
    f, p = tdhook_fn.pure(model)
    as_tensor = lambda out: out["output"][..., 0] - out["output"][..., 2]
    as_td = lambda out: TensorDict(score=as_tensor(out), batch_size=out.batch_size)
    assert torch.equal(saliency(f, p, x, target=as_tensor), saliency(f, p, x, target=as_td))
    several = lambda out: out["output"][..., :2]  # [*B, T]: one map per target
    per = saliency(f, p, x, target=several, per_target=True)
    assert per.shape == (2, N, F) and torch.equal(per, saliency(f, p, x, target=(0, 1), per_target=True))
    attr, delta = integrated_gradients(f, p, x, 0.0, target=as_tensor, return_convergence_delta=True)
    ref, ref_delta = integrated_gradients(f, p, x, 0.0, target=as_td, return_convergence_delta=True)
    assert torch.equal(attr, ref) and torch.equal(delta, ref_delta)


def test_a_baseline_may_be_a_number_or_a_tensor():
    model, x = mlp(), batch()
    f, p = tdhook_fn.pure(model)
    td = TensorDict(input=x, batch_size=[N])
    b = torch.randn(N, F)
    from_td = integrated_gradients(f, p, td, TensorDict(input=b, batch_size=[N]), target=1)["input"]
    assert torch.equal(integrated_gradients(f, p, x, b, target=1), from_td)
    assert torch.equal(integrated_gradients(f, p, td, b, target=1)["input"], from_td)
    zeros = integrated_gradients(f, p, x, torch.zeros(N, F), target=1)
    for same in (0, 0.0, torch.zeros(F), torch.zeros(1, F)):  # a number, one sample's shape, [1, ...]
        assert torch.equal(integrated_gradients(f, p, x, same, target=1), zeros)
    half = integrated_gradients(f, p, x, 0.5, target=1)
    assert torch.equal(half, integrated_gradients(f, p, x, torch.full((N, F), 0.5), target=1))


def test_a_baseline_in_a_tensordict_broadcasts_as_a_tensor_does():
    from tdhook_fn.attribution import feature_ablation

    model, x = mlp(), batch()
    f, p = tdhook_fn.pure(model)
    td = TensorDict(input=x, batch_size=[N])
    one = torch.randn(1, F)
    for method in (lambda b: integrated_gradients(f, p, td, b, target=1), lambda b: feature_ablation(f, p, td, b,
                                                                                                     target=1)):
        want = method(one.expand(N, F).clone())["input"]
        for given in (one, one[0]):  # [1, F] and one sample's [F], unbatched TensorDicts
            assert torch.equal(method(TensorDict(input=given))["input"], want)
    with pytest.raises(ValueError, match=r"baselines for input 'input' have shape \[2, 4\], which does not broadcast"):
        integrated_gradients(f, p, td, TensorDict(input=torch.zeros(2, F)), target=1)


def test_pure_is_functional_and_params_in_one_call():
    model, x = mlp(), batch()
    f, p = tdhook_fn.pure(model)
    assert isinstance(f, tdhook_fn.Functional) and f.model is model and f.in_keys == ("input",)
    assert (p == tdhook_fn.params(model)).all()
    g, _ = tdhook_fn.pure(model, in_keys=["pixels"], out_keys=["logits"])
    assert g.in_keys == ("pixels",) and g.out_keys == ("logits",)
    assert torch.equal(f(p, TensorDict(input=x, batch_size=[N]))["output"], model(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_three_lines_equal_captum_integrated_gradients(dtype):
    model, x = mlp(dtype), batch(dtype)
    f, params = tdhook_fn.pure(model)
    pred = model(x).argmax(-1)
    if dtype == torch.float32:  # captum's defaults: 50 Gauss-Legendre steps
        attr = integrated_gradients(f, params, x, 0.0, target=pred)
        torch.testing.assert_close(attr, IntegratedGradients(model).attribute(x, target=pred))
    else:  # 16 Riemann steps: captum's float32 step weights are exact, so only the sum's order differs
        attr = integrated_gradients(f, params, x, 0.0, target=pred, method="riemann_left", n_steps=16)
        theirs = IntegratedGradients(model).attribute(x, target=pred, method="riemann_left", n_steps=16)
        assert_close_ulps(attr, theirs)


def test_multiply_by_inputs_defaults_differ_between_pure_and_compat():
    from tdhook_fn.compat.attribution import IntegratedGradients as CompatIG

    model, x = mlp(), batch()
    f, p = tdhook_fn.pure(model)
    td = TensorDict(input=x, batch_size=[N])
    td.set(("baseline", "input"), torch.zeros_like(x))
    with CompatIG(init_attr_targets=lambda out, _: TensorDict(o=out["output"][..., 1], batch_size=out.batch_size)
                  ).prepare(model) as hooked:
        compat = hooked(td)[("attr", "input")]
    averaged = integrated_gradients(f, p, x, 0.0, target=1, multiply_by_inputs=False)
    torch.testing.assert_close(compat, averaged)
    torch.testing.assert_close(integrated_gradients(f, p, x, 0.0, target=1), averaged * x)


# -- errors --------------------------------------------------------------------------


def _fp() -> tuple[Any, Any, torch.Tensor]:
    model = mlp()
    f, p = tdhook_fn.pure(model)
    return f, p, batch()


ERRORS: list[tuple[str, Callable[[Any, Any, torch.Tensor], Any], type[Exception], tuple[str, ...]]] = [
    ("target-too-short", lambda f, p, x: saliency(f, p, x, target=torch.tensor([0, 1])),
     ValueError, ("target", "[2]", "[5]", "one index per sample")),
    ("target-2d", lambda f, p, x: integrated_gradients(f, p, x, 0.0, target=torch.zeros(N, 1, dtype=torch.long)),
     ValueError, ("target", "[5, 1]", "[5]")),
    ("target-float", lambda f, p, x: saliency(f, p, x, target=torch.tensor([0.0, 1, 2, 0, 1])),
     TypeError, ("target", "integer class indices", "float32")),
    ("target-bool", lambda f, p, x: saliency(f, p, x, target=torch.ones(N, dtype=torch.bool)),
     TypeError, ("target", "torch.bool")),
    ("target-out-of-range", lambda f, p, x: saliency(f, p, x, target=torch.tensor([0, 1, 3, 0, 1])),
     IndexError, ("target", "class index 3", "3 classes")),
    ("target-below-range", lambda f, p, x: grad_cam(f, p, x, target=torch.tensor([0, -4, 1, 0, 1]),
                                                    layers={"[1]": DimsConfig()}),
     IndexError, ("target", "-4", "3 classes")),
    ("target-tensor-of-wrong-batch", lambda f, p, x: saliency(f, p, x, target=lambda out: out["output"][:2, 0]),
     ValueError, ("target returned a tensor", "[2]", "batch [5]")),
    ("module-as-f", lambda f, p, x: saliency(f.model, p, x, target=0),
     TypeError, ("module sequential", "tdhook_fn.pure(model)")),
    ("scalar-input", lambda f, p, x: saliency(f, p, torch.tensor(1.0), target=0),
     ValueError, ("saliency", "0-d", "first dim")),
    ("two-in-keys", lambda f, p, x: saliency(tdhook_fn.functional(f.model, in_keys=["a", "b"]), p, x, target=0),
     TypeError, ("inputs is a tensor", "['a', 'b']", "tensordict")),
    ("several-maps", lambda f, p, x: saliency(f, p, x, target=0, layers=["[1]"]),
     ValueError, ("saliency", "2 maps", "'[1]'", "tensordict")),
    ("baseline-shape", lambda f, p, x: integrated_gradients(f, p, x, torch.zeros(3), target=0),
     ValueError, ("baselines", "[3]", "[5, 4]")),
    ("baseline-ints", lambda f, p, x: integrated_gradients(f, p, x, torch.zeros(F, dtype=torch.long), target=0),
     TypeError, ("baselines", "torch.int64")),
    ("baseline-a-list", lambda f, p, x: integrated_gradients(f, p, x, [0.0], target=0),
     TypeError, ("baselines", "list")),
]


@pytest.mark.parametrize(("call", "exc", "words"), [pytest.param(c, e, w, id=i) for i, c, e, w in ERRORS])
def test_captum_style_mistakes_get_clear_errors(call, exc, words):
    f, p, x = _fp()
    with pytest.raises(exc) as info:
        call(f, p, x)
    message = str(info.value).lower()
    assert not [w for w in words if w.lower() not in message], str(info.value)


def test_a_tensor_baseline_needs_one_attributed_input():
    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(F, C)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.lin(a + b)

    f, p = tdhook_fn.pure(Two(), in_keys=["a", "b"])
    td = TensorDict(a=batch(), b=batch(), batch_size=[N])
    with pytest.raises(TypeError, match="a tensor baseline fits one attributed input"):
        integrated_gradients(f, p, td, torch.zeros(N, F), target=0)
    one = integrated_gradients(f, p, td, torch.zeros(N, F), target=0, input_keys=["a"])
    assert set(one.keys()) == {"a"}
