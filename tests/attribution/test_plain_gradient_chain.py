"""The plain gradient by the chain walk (NOTE [plain gradients on a chain]): the engine's maps, bitwise, for every
method whose maps are plain gradients (saliency, input x gradient, integrated gradients, SmoothGrad, GradientSHAP);
where the walk cannot give autograd's numbers, or where the map must carry a graph, the engine's own way runs."""

import attr_zoo
import pytest
import torch
from tensordict import TensorDict
from torch import nn
from zoo import same, snapshot

import tdhook_fn
from tdhook_fn.attribution import (
    _gradient_chain,
    gradient_shap,
    integrated_gradients,
    saliency,
    smoothgrad,
)


@pytest.fixture(autouse=True)
def _one_thread():
    yield from attr_zoo.one_thread()


def _chains() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    """Chains whose every link the walk pulls back by autograd's own kernel, each with one sample's input shape."""
    torch.manual_seed(0)
    return {
        "mlp": (nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), (5,)),
        "activations": (nn.Sequential(nn.Linear(5, 6), nn.LeakyReLU(0.3), nn.Linear(6, 6), nn.Sigmoid(),
                                      nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3)), (5,)),
        "softmax last": (nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 4), nn.Softmax(dim=-1)), (5,)),
        "sigmoid last": (nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3), nn.Sigmoid()), (5,)),
        "nested, dropout, no bias": (nn.Sequential(nn.Sequential(nn.Linear(5, 6, bias=False), nn.ReLU()),
                                                   nn.Dropout(0.5), nn.Sequential(nn.Linear(6, 3))), (5,)),
        "flatten first": (nn.Sequential(nn.Flatten(), nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, 3)), (3, 4)),
        "linear on 3-d": (nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Flatten(), nn.Linear(18, 3)), (3, 4)),
    }


CHAINS = tuple(_chains())


def _case(name: str, dtype: torch.dtype, batch: tuple[int, ...]):
    model, shape = _chains()[name]
    model = model.to(dtype).eval()
    x = torch.randn(*batch, *shape, dtype=dtype)
    f, p = tdhook_fn.pure(model)
    return model, f, p, TensorDict(input=x, batch_size=list(batch))


_walks = attr_zoo.plain_walks


def _seeded(call, seed: int = 7):
    def run():
        torch.manual_seed(seed)
        return call()

    return run


def _methods(f, p, td, target, per_target=False):
    """Each plain-gradient method's call on ``td``, by name."""
    refs = torch.randn(3, *td["input"].shape[td.batch_dims:], dtype=td["input"].dtype)
    options = {"target": target, "per_target": per_target}
    return {
        "saliency": lambda: saliency(f, p, td, **options),
        "input_x_gradient": lambda: saliency(f, p, td, multiply_by_inputs=True, **options),
        "integrated_gradients": lambda: integrated_gradients(f, p, td, 0.0, n_steps=7, **options),
        "integrated_gradients riemann chunks": lambda: integrated_gradients(
            f, p, td, 0.5, n_steps=6, method="riemann_trapezoid", chunk_size=4, **options),
        "smoothgrad": _seeded(lambda: smoothgrad(f, p, td, nt_samples=5, stdevs=0.3, **options)),
        "vargrad chunks": _seeded(lambda: smoothgrad(f, p, td, nt_type="vargrad", nt_samples=5, stdevs=0.3,
                                                     chunk_size=2, **options)),
        "gradient_shap": _seeded(lambda: gradient_shap(f, p, td, refs, n_samples=4, **options)),
    }


METHODS = tuple(_methods(None, None, TensorDict(input=torch.zeros(2, 3), batch_size=[2]), 0))


@pytest.mark.parametrize("batch", [(4,), (2, 3)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", CHAINS)
def test_the_walk_gives_the_engines_maps_bitwise(name, method, dtype, batch, monkeypatch):
    model, f, p, td = _case(name, dtype, batch)
    before = snapshot(model)
    call = _methods(f, p, td, target=1)[method]
    taken = _walks(monkeypatch)
    walked = call()
    assert taken and all(taken)
    general = attr_zoo.on_general_path(model, call)
    assert same(before, snapshot(model))
    assert walked.batch_size == general.batch_size
    torch.testing.assert_close(walked, general, rtol=0, atol=0)  # (same call, same shapes: the same kernels)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("target", ["per target", "one per target", "one-tuple", "labels", "negative",
                                    "0-d tensor"])
def test_every_target_form_the_walk_takes(method, target, monkeypatch):
    model, f, p, td = _case("activations", torch.float64, (4,))
    given = {"per target": (2, 0, -1), "one per target": 1, "one-tuple": (2,), "labels": torch.tensor([2, 0, 1, 1]),
             "negative": -2, "0-d tensor": torch.tensor(1)}[target]
    call = _methods(f, p, td, given, per_target=target in ("per target", "one per target"))[method]
    taken = _walks(monkeypatch)
    walked = call()
    assert taken and all(taken)
    torch.testing.assert_close(walked, attr_zoo.on_general_path(model, call), rtol=0, atol=0)


def test_a_tensor_input_takes_the_walk(monkeypatch):
    model, f, p, td = _case("mlp", torch.float32, (6,))
    taken = _walks(monkeypatch)
    walked = saliency(f, p, td["input"], target=torch.tensor([0, 1, 2, 3, 0, 1]))
    assert taken == [True]
    expected = attr_zoo.on_general_path(model, lambda: saliency(f, p, td, target=torch.tensor([0, 1, 2, 3, 0, 1])))
    torch.testing.assert_close(walked, expected["input"], rtol=0, atol=0)


def test_live_params_that_require_grad_keep_their_graph_on_the_engines_way(monkeypatch):
    """The model's own params (``params(model, detach=False)``) make a map the engine differentiates for them: the
    walk declines under grad mode, and may walk under no_grad."""
    model, _, _, td = _case("mlp", torch.float32, (4,))
    f, live = tdhook_fn.functional(model), tdhook_fn.params(model, detach=False)
    taken = _walks(monkeypatch)
    grad_map = saliency(f, live, td, target=2)["input"]
    assert taken == [False] and grad_map.requires_grad
    (d_weight,) = torch.autograd.grad(grad_map.sum(), model[0].weight, allow_unused=True)
    assert d_weight is not None
    with torch.no_grad():
        value = saliency(f, live, td, target=2)["input"]
    assert taken[-1] and not value.requires_grad
    torch.testing.assert_close(value, grad_map.detach(), rtol=0, atol=0)


def test_inputs_that_require_grad_keep_their_graph_on_the_engines_way(monkeypatch):
    """A map of inputs that require grad is differentiable (a gradient penalty): the walk, which gives values,
    declines; under no_grad it may walk."""
    model, f, p, td = _case("activations", torch.float64, (4,))
    x = td["input"].requires_grad_()
    taken = _walks(monkeypatch)
    grad_map = saliency(f, p, td, target=1)["input"]
    assert taken == [False] and grad_map.requires_grad
    (second,) = torch.autograd.grad(grad_map.square().sum(), x)
    expected = attr_zoo.on_general_path(model, lambda: torch.autograd.grad(
        saliency(f, p, td, target=1)["input"].square().sum(), x)[0])
    torch.testing.assert_close(second, expected, rtol=0, atol=0)
    with torch.no_grad():
        value = saliency(f, p, td, target=1)["input"]
    assert taken[-1] and not value.requires_grad
    torch.testing.assert_close(value, grad_map.detach(), rtol=0, atol=0)


def test_transforms_take_the_engines_way(monkeypatch):
    model, f, p, td = _case("mlp", torch.float32, (4,))
    taken = _walks(monkeypatch)
    per_sample = torch.func.vmap(lambda one: saliency(f, p, one, target=1))(td)
    assert taken == [False]
    torch.testing.assert_close(per_sample["input"], saliency(f, p, td, target=1)["input"])
    taken.clear()
    d_params = torch.func.grad(lambda q: saliency(f, q, td, target=1)["input"].sum())(p)
    assert taken == [False]
    expected = attr_zoo.on_general_path(model, lambda: torch.func.grad(
        lambda q: saliency(f, q, td, target=1)["input"].sum())(p))
    torch.testing.assert_close(d_params, expected, rtol=0, atol=0)


def test_inference_mode_raises_as_the_engine_does(monkeypatch):
    _, f, p, td = _case("mlp", torch.float32, (4,))
    taken = _walks(monkeypatch)
    with torch.inference_mode(), pytest.raises(ValueError, match="autograd is off"):
        saliency(f, p, td, target=0)
    assert taken == [False]


@pytest.mark.parametrize("model", [
    nn.Sequential(nn.Conv1d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4, 3)),
    nn.Sequential(nn.Linear(6, 6), nn.Unflatten(1, (1, 6)), nn.MaxPool1d(2), nn.Flatten(), nn.Linear(3, 3)),
], ids=["convolution", "max pool"])
def test_links_without_autograds_kernel_take_the_engines_way(model, monkeypatch):
    x = torch.randn(4, 2, 6) if isinstance(model[0], nn.Conv1d) else torch.randn(4, 6)
    f, p = tdhook_fn.pure(model.eval())
    taken = _walks(monkeypatch)
    saliency(f, p, TensorDict(input=x, batch_size=[4]), target=1)
    assert taken == [False]


@pytest.mark.parametrize("target", ["callable", "summed tuple", "out of range"])
def test_targets_the_walk_leaves_to_the_engine(target, monkeypatch):
    model, f, p, td = _case("mlp", torch.float32, (4,))
    given = {"callable": lambda out: out["output"][..., 1], "summed tuple": (0, 2), "out of range": 4}[target]
    taken = _walks(monkeypatch)
    if target == "out of range":
        with pytest.raises(IndexError):
            saliency(f, p, td, target=given)
        assert taken == [False]
        return
    walked = saliency(f, p, td, target=given)
    assert taken in ([], [False])
    torch.testing.assert_close(walked, attr_zoo.on_general_path(model, lambda: saliency(f, p, td, target=given)),
                               rtol=0, atol=0)


@pytest.mark.parametrize("where", ["another class", "the target's class"])
def test_a_non_finite_last_weight_gives_the_engines_numbers(where, monkeypatch):
    """autograd's one-hot product puts another class's NaN in: the walk's weight row would leave it out, so it
    declines (NOTE [seed rows])."""
    model, f, p, td = _case("mlp", torch.float32, (4,))
    row = 3 if where == "another class" else 1
    p = p.clone()
    p["4", "weight"][row, 2] = float("inf")
    taken = _walks(monkeypatch)
    walked = saliency(f, p, td, target=1)["input"]
    assert taken == [False]
    expected = attr_zoo.on_general_path(model, lambda: saliency(f, p, td, target=1)["input"])
    torch.testing.assert_close(walked, expected, rtol=0, atol=0, equal_nan=True)
    assert walked.isnan().any()  # (the walk's map would have been finite for another class's inf)


def test_params_in_another_dtype_raise_as_the_model_does():
    model, f, p, td = _case("mlp", torch.float32, (4,))
    td64 = td.to(torch.float64)
    with pytest.raises(RuntimeError) as walked:
        saliency(f, p, td64, target=1)
    with pytest.raises(RuntimeError) as general:
        attr_zoo.on_general_path(model, lambda: saliency(f, p, td64, target=1))
    assert "dtype" in str(walked.value) and "dtype" in str(general.value)


def test_a_model_changed_between_calls_is_walked_as_it_is_now(monkeypatch):
    model, f, p, td = _case("activations", torch.float32, (4,))
    saliency(f, p, td, target=1)
    model[3] = nn.Tanh()  # (the plan is rebuilt: NOTE [plans per model])
    taken = _walks(monkeypatch)
    walked = saliency(f, p, td, target=1)
    assert taken == [True]
    torch.testing.assert_close(walked, attr_zoo.on_general_path(model, lambda: saliency(f, p, td, target=1)),
                               rtol=0, atol=0)
    model[0].register_forward_hook(lambda _m, _a, out: out + 1.0)  # (a hook: the engine's way, which runs it)
    taken.clear()
    hooked = saliency(f, p, td, target=1)["input"]
    assert taken == [False]
    shifted = nn.Sequential(*model)
    shifted[0] = nn.Linear(5, 6).to(torch.float32)
    shifted[0].load_state_dict(model[0].state_dict())
    with torch.no_grad():
        shifted[0].bias += 1.0
    g, q = tdhook_fn.pure(shifted)
    # ((W x + b) + 1 and W x + (b + 1) round apart: close, not bitwise; the hook ran if they are close at all)
    torch.testing.assert_close(hooked, saliency(g, q, td, target=1)["input"])


def test_the_plain_gradient_step_is_autograd_exact_only_without_convolutions_and_pools():
    f, _ = tdhook_fn.pure(_chains()["activations"][0])
    plan = _gradient_chain.walk_plan(f)
    assert plan is not None and _gradient_chain._autograd_exact(plan)
    f, _ = tdhook_fn.pure(nn.Sequential(nn.Conv1d(2, 3, 3), nn.Flatten(), nn.Linear(12, 2)))
    plan = _gradient_chain.walk_plan(f)
    assert plan is not None and not _gradient_chain._autograd_exact(plan)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32], ids=str)
@pytest.mark.parametrize("method", ["saliency", "deconvolution"])
def test_labels_of_any_integer_dtype_on_the_walk(method, dtype, monkeypatch):
    """The walk indexes the weight's rows by the labels, which ``index_select`` takes in int64 only (an int16 label
    raised there, a uint8 one compared with a negative bound wrapped around)."""
    model, f, p, td = _case("mlp", torch.float32, (5,))
    labels = torch.tensor([0, 3, 2, 1, 0])
    call = getattr(tdhook_fn.attribution, method)
    walked = call(f, p, td, target=labels.to(dtype))
    torch.testing.assert_close(walked, attr_zoo.on_general_path(model, lambda: call(f, p, td, target=labels)),
                               rtol=0, atol=0)
