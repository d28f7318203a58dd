"""``torch.compile(fullgraph=True)`` of the core and the gradient methods (NOTE [compiled calls])."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import TensorDict, TensorDictBase

import tdhook_fn
from tdhook_fn.attribution import DimsConfig, grad_cam, guided_backprop, integrated_gradients, saliency


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).eval()


def _cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(2 * 4 * 4, 3)).eval()


MODELS = {"mlp": (_mlp, (5, 3)), "cnn": (_cnn, (2, 1, 6, 6))}


def _methods(net: torch.nn.Module) -> dict[str, Callable[[TensorDictBase, TensorDictBase], Any]]:
    f = tdhook_fn.functional(net)
    return {
        "call": lambda p, td: tdhook_fn.call(net, p, td["input"]),
        "functional": lambda p, td: f(p, td)["output"],
        "capture": lambda p, td: f.with_taps(tdhook_fn.capture("[1]"))(p, td)["1"],
        "saliency": lambda p, td: saliency(f, p, td, target=1)["input"],
        "saliency_per_target": lambda p, td: saliency(f, p, td, target=(0, 1), per_target=True)["input"],
        "layer_saliency": lambda p, td: saliency(f, p, td, target=1, layers=["[1]"])["[1]"],
        "integrated_gradients": lambda p, td: integrated_gradients(
            f, p, td, 0.0, target=1, n_steps=4, return_convergence_delta=True),
        "layer_integrated_gradients": lambda p, td: integrated_gradients(
            f, p, td, 0.0, target=1, n_steps=4, layers=["[1]"])["[1]"],
        **{f"ig_{q}": (lambda q: lambda p, td: integrated_gradients(f, p, td, 0.0, target=1, n_steps=3, method=q)[
            "input"])(q) for q in ("riemann_left", "riemann_right", "riemann_middle", "riemann_trapezoid")},
        "ig_per_target_chunked": lambda p, td: integrated_gradients(
            f, p, td, 0.0, target=(0, 1), per_target=True, n_steps=4, chunk_size=2)["input"],
        "grad_cam": lambda p, td: grad_cam(f, p, td, target=1, layers={"[1]": DimsConfig()})["[1]"],
        "guided_backprop": lambda p, td: guided_backprop(f, p, td, target=1)["input"],
    }


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("method", list(_methods(torch.nn.Linear(1, 1))))
def test_fullgraph_equals_eager_without_retrace(model: str, method: str) -> None:
    build, shape = MODELS[model]
    net = build()
    before = copy.deepcopy(net.state_dict())
    ids = [id(t) for t in net.parameters()]
    p = tdhook_fn.params(net)
    fn = _methods(net)[method]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    x = TensorDict(input=torch.randn(shape), batch_size=shape[:1])
    torch.testing.assert_close(compiled(p, x), fn(p, x))
    y = TensorDict(input=torch.randn(shape), batch_size=shape[:1])
    torch.testing.assert_close(compiled(p, y), fn(p, y))  # new values, same shapes: no re-trace
    assert _graphs() == 1
    assert [id(t) for t in net.parameters()] == ids
    assert all(torch.equal(a, b) for a, b in zip(before.values(), net.state_dict().values(), strict=True))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in net.modules())


def test_new_params_values_do_not_retrace() -> None:
    net = _mlp()
    p = tdhook_fn.params(net)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(lambda p, x: tdhook_fn.call(net, p, x), fullgraph=True, backend="eager")
    x = torch.randn(4, 3)
    compiled(p, x)
    q = p.apply(lambda t: t * 2)
    torch.testing.assert_close(compiled(q, x), tdhook_fn.call(net, q, x))
    assert _graphs() == 1
    assert not torch.equal(p["0", "weight"], q["0", "weight"])  # the caller's params are not written


def test_mode_change_retraces() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.5)).eval()
    p = tdhook_fn.params(net)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(lambda p, x: tdhook_fn.call(net, p, x), fullgraph=True, backend="eager")
    x = torch.randn(64, 3)
    torch.testing.assert_close(compiled(p, x), tdhook_fn.call(net, p, x))
    net.train()
    out = compiled(p, x)
    assert _graphs() == 2
    assert (out == 0).any()  # dropout active after the re-trace
    net.eval()


def test_aot_eager_matches_eager() -> None:
    net = _cnn()
    p = tdhook_fn.params(net)
    fn = _methods(net)["saliency"]
    torch._dynamo.reset()
    x = TensorDict(input=torch.randn(2, 1, 6, 6), batch_size=[2])
    torch.testing.assert_close(torch.compile(fn, fullgraph=True, backend="aot_eager")(p, x), fn(p, x))


@pytest.mark.parametrize("change", ["setting", "replaced", "appended", "mode"])
def test_a_model_changed_after_compiling_is_traced_again_never_stale(change: str) -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LeakyReLU(0.1), torch.nn.Dropout(0.0),
                              torch.nn.Linear(4, 2)).eval()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(lambda p, x: tdhook_fn.call(net, p, x), fullgraph=True, backend="eager")
    x = torch.randn(5, 3)
    compiled(tdhook_fn.params(net), x)
    if change == "setting":
        net[1].negative_slope = 0.7
    elif change == "replaced":
        net[1] = torch.nn.Tanh()
    elif change == "appended":
        net.append(torch.nn.Softplus())
    else:
        net[2].p = 0.5
        net.train()
    p = tdhook_fn.params(net)
    torch.manual_seed(1)
    got = compiled(p, x)
    torch.manual_seed(1)
    torch.testing.assert_close(got, tdhook_fn.call(net, p, x))
    assert _graphs() == 2


def test_threads_sharing_one_compiled_method_and_model_get_their_own_maps() -> None:
    from concurrent.futures import ThreadPoolExecutor

    net = _mlp()
    f = tdhook_fn.functional(net)
    torch._dynamo.reset()
    compiled = torch.compile(lambda p, td: saliency(f, p, td, target=1)["input"], fullgraph=True, backend="eager")
    base = tdhook_fn.params(net)
    td = TensorDict(input=torch.randn(5, 3), batch_size=[5])
    compiled(base, td)  # traced once, before the threads start
    params = [base.apply(lambda t, k=k: t * (1 + 0.1 * k)) for k in range(4)]
    expected = [saliency(f, p, td, target=1)["input"] for p in params]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            got = list(pool.map(lambda p: compiled(p, td), params))
            for g, e in zip(got, expected, strict=True):
                torch.testing.assert_close(g, e)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in net.modules())


def _rule_calls() -> dict[str, Callable[..., torch.Tensor]]:
    from tdhook_fn.attribution import EpsilonPlus, deeplift, deeplift_shap, layer_deeplift, lrp

    refs = torch.randn(3, 1, 6, 6)
    return {
        "lrp": lambda f, q, td: lrp(f, q, td, target=1, rules=EpsilonPlus(), warn_on_missing_rule=False)["input"],
        "deeplift": lambda f, q, td: deeplift(f, q, td, 0.0, target=1)["input"],
        "deeplift_shap": lambda f, q, td: deeplift_shap(f, q, td, refs, target=1)["input"],
        "layer_deeplift": lambda f, q, td: layer_deeplift(f, q, td, 0.0, target=1, layers=["1"])["1"],
    }


@pytest.mark.parametrize("method", ["lrp", "deeplift", "deeplift_shap", "layer_deeplift"])
def test_rule_methods_inside_compiled_code_run_eagerly_and_fullgraph_names_them(method: str) -> None:
    """NOTE [lrp is never traced]: a graph-broken trace of the rule taps failed on an internal assertion; the
    DeepLift methods, on the same taps, failed inside torch even on a chain."""
    call = _rule_calls()[method]
    net = _cnn()
    f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
    x = TensorDict(input=torch.randn(2, 1, 6, 6), batch_size=[2])
    fn = lambda q, td: call(f, q, td) * 2
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, backend="eager")(p, x), fn(p, x), rtol=0, atol=0)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="disable"):
        torch.compile(fn, fullgraph=True, backend="eager")(p, x)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in net.modules())


class _Scaled(torch.nn.Module):
    """A forward that reads attributes the shadow shares with the model: a tensor, a function, an object."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.scale = torch.tensor(2.0)
        self.act = torch.relu
        self.config = type("Config", (), {"shift": 1.0})()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x)) * self.scale + self.config.shift


def _change(model: _Scaled, change: str) -> Any:
    """Change ``model`` after a compiled call as ``change`` says; return what undoes it (a hook's handle) or None."""
    if change == "forward hook":
        return model.lin.register_forward_hook(lambda _m, _a, out: out * 3)
    if change == "forward pre-hook":
        return model.lin.register_forward_pre_hook(lambda _m, args: (args[0] + 1,))
    if change == "global hook":
        return torch.nn.modules.module.register_module_forward_hook(lambda _m, _a, out: out * 0 + 7)
    if change == "tensor attribute":
        model.scale = torch.tensor(3.0)
    elif change == "tensor attribute in place":
        model.scale.fill_(5.0)
    elif change == "function attribute":
        model.act = torch.tanh
    elif change == "object attribute":
        model.config = type("Config", (), {"shift": -4.0})()
    elif change == "object's attribute":
        model.config.shift = 9.0
    elif change == "instance forward":
        model.forward = lambda x: model.lin(x) * 0 - 1  # type: ignore[method-assign]
    return None


@pytest.mark.parametrize("change", ["forward hook", "forward pre-hook", "global hook", "tensor attribute",
                                    "tensor attribute in place", "function attribute", "object attribute",
                                    "object's attribute", "instance forward"])
def test_what_the_forward_reads_changed_after_compiling_is_never_stale(change: str) -> None:
    """The shadow holds a copy of the model's state (NOTE [compiled calls]): each change re-traces or reads through."""
    torch.manual_seed(0)
    model = _Scaled()
    p, x = tdhook_fn.params(model), torch.randn(4, 3)
    torch._dynamo.reset()
    compiled = torch.compile(lambda p, x: tdhook_fn.call(model, p, x), fullgraph=True, backend="eager")
    before = compiled(p, x)
    handle = _change(model, change)
    try:
        expected = tdhook_fn.call(model, p, x)
        assert not torch.allclose(expected, before)  # the change changes the output
        torch.testing.assert_close(compiled(p, x), expected)
    finally:
        if handle is not None:
            handle.remove()
    if handle is not None:  # and removing the hook again
        torch.testing.assert_close(compiled(p, x), before)


def test_a_hook_replaced_under_its_key_retraces() -> None:
    torch.manual_seed(0)
    model = _Scaled()
    handle = model.lin.register_forward_hook(lambda _m, _a, out: out * 2)
    p, x = tdhook_fn.params(model), torch.randn(4, 3)
    torch._dynamo.reset()
    compiled = torch.compile(lambda p, x: tdhook_fn.call(model, p, x), fullgraph=True, backend="eager")
    compiled(p, x)
    model.lin._forward_hooks[handle.id] = lambda _m, _a, out: out**3
    torch.testing.assert_close(compiled(p, x), model(x).detach())
    handle.remove()


def test_a_module_given_another_class_gets_another_shadow_eager_and_compiled() -> None:
    class Negated(_Scaled):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return -super().forward(x)

    torch.manual_seed(0)
    model = torch.nn.Sequential(_Scaled(), torch.nn.Linear(2, 2))
    p, x = tdhook_fn.params(model), torch.randn(4, 3)
    torch._dynamo.reset()
    compiled = torch.compile(lambda p, x: tdhook_fn.call(model, p, x), fullgraph=True, backend="eager")
    tdhook_fn.call(model, p, x), compiled(p, x)  # a pooled shadow and a traced one, of the old class
    model[0].__class__ = Negated
    expected = model(x).detach()
    torch.testing.assert_close(tdhook_fn.call(model, p, x), expected)
    torch.testing.assert_close(compiled(p, x), expected)


def test_numpy_and_nan_attributes_compile_with_fullgraph() -> None:
    """A numpy float is a float subclass (Dynamo reads it as a tensor), NaN never equals itself: guarded by id."""
    import numpy as np

    class Odd(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)
            self.scale = np.sqrt(4.0)
            self.missing = float("nan")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * float(self.scale)

    model = Odd()
    p, x = tdhook_fn.params(model), torch.randn(4, 3)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(lambda p, x: tdhook_fn.call(model, p, x), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(p, x), tdhook_fn.call(model, p, x))
    compiled(p, x)
    assert _graphs() == 1
    model.scale = np.sqrt(9.0)
    torch.testing.assert_close(compiled(p, x), tdhook_fn.call(model, p, x))
