"""Modules whose instance holds references to the model: accelerate hooks, partials, bound methods.

The shadow copies each module's attributes; anything in them that still refers to an
original module must be rebound to its shadow (or refused), or the call silently runs the
model's own tensors instead of the given params.
"""

import copy
import functools
import types
import weakref
from typing import Any

import pytest
import torch
from accelerate.hooks import AlignDevicesHook, ModelHook, add_hook_to_module
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import saliency
from tdhook_fn.compat.modules import HookedModule


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _zeros(net):
    return tdhook_fn.params(net).apply(torch.zeros_like)


def _accelerate(net):
    add_hook_to_module(net[0], ModelHook())


def _accelerate_align(net):
    add_hook_to_module(net[0], AlignDevicesHook(execution_device="cpu", io_same_device=True))


def _partial(net):
    net[0].forward = functools.partial(nn.Linear.forward, net[0])


def _method(net):
    net[0].forward = types.MethodType(nn.Linear.forward, net[0])


def _parent(net):
    add_hook_to_module(net, ModelHook())


def _wrapped_partial(net):
    inner = net[0]
    net[0].forward = functools.update_wrapper(functools.partial(type(inner).forward, inner), inner.forward)


PATCHES = {
    "accelerate": _accelerate,
    "accelerate-align": _accelerate_align,
    "partial": _partial,
    "method": _method,
    "parent": _parent,
    "wrapped-partial": _wrapped_partial,
}


@pytest.fixture(params=sorted(PATCHES))
def patched(request):
    net = _net()
    PATCHES[request.param](net)
    return net


def test_params_are_used(patched):
    p = tdhook_fn.params(patched)
    p["0"] = p["0"].apply(torch.zeros_like)  # the patched module computes with the given zeros
    x = torch.ones(2, 4)
    expected = patched[2](torch.tanh(torch.zeros(2, 3)))
    assert torch.equal(tdhook_fn.call(patched, p, x), expected)


def test_matches_unpatched_model(patched):
    plain = _net()
    p = tdhook_fn.params(plain).apply(lambda t: t * 2)
    x = torch.randn(3, 4)
    torch.testing.assert_close(tdhook_fn.call(patched, p, x), tdhook_fn.call(plain, p, x), rtol=0, atol=0)


def test_grads_reach_params(patched):
    p = tdhook_fn.params(patched)
    x = torch.randn(3, 4)
    g = torch.func.grad(lambda q: tdhook_fn.call(patched, q, x).sum())(p)
    expected = torch.func.grad(lambda q: tdhook_fn.call(_net(), q, x).sum())(tdhook_fn.params(_net()))
    assert all(torch.equal(g.get(k), expected.get(k)) for k in expected.keys(True, True))
    assert g["0", "weight"].abs().sum() > 0


def _doubled(net):
    return tdhook_fn.params(net).apply(lambda t: t * 2)


def test_taps_inside_fire(patched):
    f = tdhook_fn.functional(patched).with_taps(tdhook_fn.capture("[0]"), tdhook_fn.intervene("[1]", torch.zeros_like))
    p, x = _doubled(patched), torch.randn(3, 4)
    out = f(p, TensorDict(input=x, batch_size=[3]))
    torch.testing.assert_close(out["0"], nn.functional.linear(x, p["0", "weight"], p["0", "bias"]), rtol=0, atol=0)
    assert torch.equal(out["output"], p["2", "bias"].expand(3, 2))


def test_saliency_on_patched(patched):
    f, p = tdhook_fn.functional(patched), _doubled(patched)
    x = TensorDict(input=torch.randn(3, 4), batch_size=[3])
    plain = _net()
    expected = saliency(tdhook_fn.functional(plain), _doubled(plain), x, target=0)
    assert torch.equal(saliency(f, p, x, target=0)["input"], expected["input"])


def test_model_untouched(patched):
    forward = patched[0].__dict__.get("forward")
    before = {k: v.clone() for k, v in patched.state_dict().items()}
    tdhook_fn.call(patched, _zeros(patched), torch.ones(1, 4))
    assert patched[0].__dict__.get("forward") is forward
    assert all(torch.equal(before[k], v) for k, v in patched.state_dict().items())


def test_compat_set_applies_on_patched(patched):
    hooked = HookedModule.from_module(patched, in_keys=["input"], out_keys=["output"])
    td = TensorDict(input=torch.randn(2, 4), batch_size=[2])
    with hooked.run(td) as run:
        run.set("module[0]", torch.zeros(2, 3))
    expected = patched[2](torch.tanh(torch.zeros(2, 3)))
    torch.testing.assert_close(td["output"], expected)


def test_hook_bound_to_own_method_sees_params():
    class SelfHooked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.register_forward_hook(self.add_bias)

        def add_bias(self, module, args, output):
            return output + self.lin.bias  # reads its own submodule's tensor

        def forward(self, x):
            return self.lin(x)

    m = SelfHooked()
    out = tdhook_fn.call(m, _zeros(m), torch.ones(1, 3))
    assert torch.equal(out, torch.zeros(1, 3))


def test_back_reference_to_parent_sees_params():
    class Child(nn.Module):
        def __init__(self, parent):
            super().__init__()
            object.__setattr__(self, "parent", parent)  # not registered: a plain back-reference

        def forward(self, x):
            return x * self.parent.scale

    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(3.0))
            self.child = Child(self)

        def forward(self, x):
            return self.child(x)

    m = Parent()
    assert torch.equal(tdhook_fn.call(m, _zeros(m), torch.ones(2)), torch.zeros(2))


def test_closure_over_bound_method_is_rebound():
    net = _net()
    inner = net[0]
    original = inner.forward
    inner.forward = lambda x: original(x)  # a closure over the model's bound method
    expected = net[2](torch.tanh(torch.zeros(1, 3)))
    p = tdhook_fn.params(net)
    p["0"] = p["0"].apply(torch.zeros_like)
    assert torch.equal(tdhook_fn.call(net, p, torch.ones(1, 4)), expected)
    assert inner.forward.__closure__[0].cell_contents is original  # the model's closure is untouched


def test_closure_over_module_is_rebound():
    net = _net()
    inner = net[0]
    inner.forward = lambda x: torch.nn.functional.linear(x, inner.weight, inner.bias)
    p = tdhook_fn.params(net)
    p["0"] = p["0"].apply(torch.zeros_like)
    assert torch.equal(tdhook_fn.call(net, p, torch.ones(1, 4)), net[2](torch.tanh(torch.zeros(1, 3))))


def test_callable_object_referring_to_the_module_is_refused():
    class Caller:
        def __init__(self, module):
            self.module = module

        def __call__(self, x):
            return torch.nn.functional.linear(x, self.module.weight, self.module.bias)

    net = _net()
    net[0].forward = Caller(net[0])
    with pytest.raises(ValueError, match=r"module '0': its forward is a Caller object"):
        tdhook_fn.call(net, _zeros(net), torch.ones(1, 4))


def test_callable_object_hook_referring_to_the_model_is_refused():
    class Scale:
        def __init__(self, module):
            self.module = module

        def __call__(self, module, args, output):
            return output * self.module.weight.sum()

    net = _net()
    net[2].register_forward_hook(Scale(net[0]))
    with pytest.raises(ValueError, match=r"module '2': its _forward_hooks entry is a Scale object"):
        tdhook_fn.call(net, _zeros(net), torch.ones(1, 4))


def test_plain_function_forward_is_fine():
    net = _net()
    net[1].forward = torch.sigmoid  # no reference to any module
    x = torch.randn(2, 4)
    p = tdhook_fn.params(net)
    expected = net[2](torch.sigmoid(net[0](x)))
    torch.testing.assert_close(tdhook_fn.call(net, p, x), expected)


def test_offloading_hook_fails_loudly():
    """accelerate's offloading hook loads weights from its own store into the module: never silently."""
    net = _net()
    weights = {k: v.clone() for k, v in net[0].state_dict().items()}
    add_hook_to_module(net[0], AlignDevicesHook(execution_device="cpu", offload=True, weights_map=weights))
    with pytest.raises(RuntimeError, match=r"module '0' has an accelerate offloading hook"):
        tdhook_fn.call(net, tdhook_fn.params(net).apply(torch.zeros_like), torch.ones(1, 4))


def test_forward_replacing_its_parameter_is_refused():
    class Reloading(nn.Linear):
        def forward(self, x):
            self._parameters["weight"] = self.store  # as an offloading hook does
            return super().forward(x)

    net = nn.Sequential(Reloading(4, 3))
    object.__setattr__(net[0], "store", torch.ones(3, 4))
    with pytest.raises(RuntimeError, match=r"'0'.*replaced its parameter 'weight'"):
        tdhook_fn.call(net, _zeros(net), torch.ones(1, 4))


class _InAList(torch.nn.Module):
    """Registered submodules also kept in a plain list and dict, which the forward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)
        self.order, self.by_name = [self.a, self.b], {"first": self.a}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.order[1](self.by_name["first"](x))


class _Unregistered(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.hidden = torch.nn.Linear(3, 3), (torch.nn.Linear(3, 2),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hidden[0](self.a(x))


def test_modules_held_in_plain_lists_and_dicts_compute_with_the_given_params() -> None:
    torch.manual_seed(0)
    model = _InAList()
    params = tdhook_fn.params(model).apply(lambda t: 2.0 * t)
    x = torch.randn(4, 3)
    with torch.no_grad():
        expected = torch.nn.functional.linear(torch.nn.functional.linear(x, 2 * model.a.weight, 2 * model.a.bias),
                                              2 * model.b.weight, 2 * model.b.bias)
    torch.testing.assert_close(tdhook_fn.call(model, params, x), expected)
    assert model.order[0] is model.a and model.by_name["first"] is model.a  # the model's own lists untouched


def test_a_module_that_is_not_registered_is_refused() -> None:
    model = _Unregistered()
    with pytest.raises(ValueError, match=r"its attribute 'hidden' holds a Linear that is not a registered submodule"):
        tdhook_fn.call(model, tdhook_fn.params(model), torch.randn(4, 3))


class _KeepsItsModule(ModelHook):  # type: ignore[misc]
    """An accelerate hook that stores its module in init_hook and reads it later."""

    def init_hook(self, module: nn.Module) -> nn.Module:
        self.module = module
        return module

    def post_forward(self, module: nn.Module, output: torch.Tensor) -> torch.Tensor:
        return output + self.module.bias


def test_an_accelerate_hook_that_keeps_its_module_is_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    add_hook_to_module(model[2], _KeepsItsModule())
    with pytest.raises(ValueError, match=r"module '2': its _hf_hook \(_KeepsItsModule\) keeps a module or tensor of"):
        tdhook_fn.call(model, tdhook_fn.params(model).apply(lambda t: 0.5 * t), torch.randn(5, 4))


# ---------------------------------------------------------------- what still reaches the model after rebinding


class _Controller:
    """A forward object holding its module by weak reference, as nnsight's ``NNsight`` installs on every module."""

    def __init__(self, module: nn.Module) -> None:
        self.module_ref = weakref.ref(module)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return type(self.module_ref()).forward(self.module_ref(), x)


class _Box:
    def __init__(self, module: nn.Module) -> None:
        self.inner = {"module": module}


def _scaled_call(net: nn.Module) -> torch.Tensor:
    return tdhook_fn.call(net, tdhook_fn.params(net).apply(lambda t: 0.5 * t), torch.randn(2, 4))


def test_a_forward_object_holding_its_module_weakly_is_refused() -> None:
    net = _net()
    net[0].forward = _Controller(net[0])
    with pytest.raises(ValueError, match=r"module '0': its forward is a _Controller object that reaches module '0' "
                                         r"of the model \(through \.module_ref\(\)\).*copy"):
        _scaled_call(net)


def test_a_closure_over_an_object_holding_the_module_is_refused() -> None:
    net = _net()
    box = _Box(net[0])
    net[0].forward = lambda x: nn.functional.linear(x, box.inner["module"].weight)
    with pytest.raises(ValueError, match=r"module '0': its forward .* reaches module '0'.*closure variable 'box'"):
        _scaled_call(net)


def test_a_hook_object_reaching_the_model_through_another_object_is_refused() -> None:
    class Scale:
        def __init__(self, box: _Box) -> None:
            self.box = box

        def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            return output * self.box.inner["module"].weight.sum()

    net = _net()
    net[2].register_forward_hook(Scale(_Box(net[0])))
    with pytest.raises(ValueError, match=r"module '2': its _forward_hooks entry is a Scale object that reaches "
                                         r"module '0'"):
        _scaled_call(net)


def test_a_plain_attribute_object_holding_a_module_or_parameter_is_refused() -> None:
    class Helper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.helper = types.SimpleNamespace(weight=self.lin.weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.helper.weight

    model = Helper()
    with pytest.raises(ValueError, match=r"module '<root>': its attribute 'helper' is a SimpleNamespace object that "
                                         r"reaches tensor 'lin.weight'"):
        _scaled_call(model)


def test_an_object_assigned_after_a_call_is_checked() -> None:
    class Harmless:
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return x

    net = _net()
    net[1].forward = Harmless()
    _scaled_call(net)
    del net[1].forward  # (the new object may get the old one's id)
    net[1].forward = _Controller(net[0])
    with pytest.raises(ValueError, match=r"module '1': its forward is a _Controller object"):
        _scaled_call(net)


def test_state_dict_hooks_and_hook_handles_are_not_refused() -> None:
    class WithHandles(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)
            self.handle = self.register_forward_pre_hook(self.pre)  # a handle: weakly refers to the hook dict
            self._register_load_state_dict_pre_hook(self.on_load, with_module=True)  # never run by a forward

        def pre(self, module: nn.Module, args: Any) -> None:
            return None

        def on_load(self, *args: Any) -> None:
            return None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    model = WithHandles()
    p = tdhook_fn.params(model).apply(lambda t: 0.5 * t)
    x = torch.randn(2, 4)
    torch.testing.assert_close(tdhook_fn.call(model, p, x), nn.functional.linear(x, p["lin", "weight"],
                                                                                  p["lin", "bias"]))


def test_nnsight_wrapped_model_is_refused() -> None:
    import nnsight

    net = _net()
    wrapped = nnsight.NNsight(net)
    x = torch.randn(2, 4)
    with wrapped.trace(x):
        wrapped.output.save()
    with pytest.raises(ValueError, match=r"its forward is a Controller object that reaches module .* copy"):
        tdhook_fn.call(net, tdhook_fn.params(net).apply(lambda t: 0.5 * t), x)


# ---------------------------------------------------------------- the model's tensors held outside their slots


class _HandTied(nn.Module):
    """A hand-rolled tie: the weight read back through a plain dict, a list, a nested tuple and a bare alias."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.register_buffer("shift", torch.randn(4))
        self.tied = {"w": self.lin.weight}
        self.order = [self.lin.bias, (self.lin.weight,)]
        self.alias = self.shift  # a plain tensor attribute: the buffer itself

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) @ self.tied["w"] + self.order[0]
        return h @ self.order[1][0].T + self.alias


def _hand_tied_expected(w: torch.Tensor, b: torch.Tensor, shift: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (nn.functional.linear(x, w, b) @ w + b) @ w.T + shift


def test_parameters_held_in_plain_containers_are_the_given_ones() -> None:
    model = _HandTied()
    p = tdhook_fn.params(model).apply(lambda t: 2 * t)
    x = torch.randn(3, 4)
    expected = _hand_tied_expected(p["lin", "weight"], p["lin", "bias"], p["shift"], x)
    torch.testing.assert_close(tdhook_fn.call(model, p, x), expected)
    assert model.tied["w"] is model.lin.weight and model.alias is model.shift  # the model's own untouched


def test_gradient_through_a_hand_tied_parameter_equals_autograd() -> None:
    model = _HandTied()
    p = tdhook_fn.params(model).apply(lambda t: 2 * t)
    x = torch.randn(3, 4)
    g = torch.func.grad(lambda q: tdhook_fn.call(model, q, x).square().sum())(p)
    w, b = p["lin", "weight"].clone().requires_grad_(), p["lin", "bias"].clone().requires_grad_()
    _hand_tied_expected(w, b, p["shift"], x).square().sum().backward()
    torch.testing.assert_close(g["lin", "weight"], w.grad)
    torch.testing.assert_close(g["lin", "bias"], b.grad)


def test_a_hand_tied_parameter_is_refused_under_torch_compile() -> None:
    model = _HandTied()
    compiled = torch.compile(lambda p, x: tdhook_fn.call(model, p, x), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"module '<root>': its attribute 'tied' holds a parameter or buffer of the "
                                        r"model.*torch.compile"):
        compiled(tdhook_fn.params(model), torch.randn(2, 4))


def test_a_weak_back_reference_to_the_parent_is_rebound() -> None:
    class Child(nn.Module):
        def __init__(self, parent: nn.Module) -> None:
            super().__init__()
            self.parent_ref = weakref.ref(parent)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.parent_ref().scale

    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(3.0))
            self.child = Child(self)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.child(x)

    model = Parent()
    assert torch.equal(tdhook_fn.call(model, _zeros(model), torch.ones(2)), torch.zeros(2))
    assert model.child.parent_ref() is model


def test_an_lstm_keeping_weak_references_to_its_weights_computes_with_the_given_params() -> None:
    torch.manual_seed(0)
    model = nn.LSTM(3, 4, batch_first=True).eval()  # keeps _flat_weights and weak references to them
    p = tdhook_fn.params(model).apply(lambda t: 0.5 * t)
    x = torch.randn(2, 5, 3)
    expected = torch.func.functional_call(model, dict(p.flatten_keys(".").items()), (x,))[0]
    torch.testing.assert_close(tdhook_fn.call(model, p, x)[0], expected)


class _ProxiedChild(nn.Module):
    def __init__(self, parent: nn.Module) -> None:
        super().__init__()
        self.__dict__["parent"] = weakref.proxy(parent)  # unregistered (setattr would register the proxy as a child)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.parent.scale


class _ProxiedParent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.child = _ProxiedChild(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(x)


def test_a_weakref_proxy_back_to_the_model_is_refused() -> None:
    model = _ProxiedParent()
    with pytest.raises(ValueError, match=r"module 'child': its attribute 'parent' .*reaches module '<root>'"):
        tdhook_fn.call(model, tdhook_fn.params(model).apply(lambda t: 0.5 * t), torch.ones(2))



class _KeepsScale(ModelHook):
    def init_hook(self, module: nn.Module) -> nn.Module:
        self.scale = module.scale
        return module

    def post_forward(self, module: nn.Module, output: torch.Tensor) -> torch.Tensor:
        return output * self.scale


def test_an_accelerate_hook_keeping_a_tensor_of_the_model_is_refused() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(2.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale

    model = Scaled()
    add_hook_to_module(model, _KeepsScale())
    with pytest.raises(ValueError, match=r"_hf_hook \(_KeepsScale\) keeps a module or tensor of the model .*'scale'"):
        tdhook_fn.call(model, tdhook_fn.params(model).apply(lambda t: 0.5 * t), torch.ones(2))


def test_a_view_of_a_parameter_kept_as_an_attribute_is_refused() -> None:
    class Transposed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3, 2))
            self.weight_t = self.weight.detach().t()  # shares the parameter's memory, outside its slot

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight_t

    model = Transposed()
    with pytest.raises(ValueError, match=r"attribute 'weight_t' shares memory with the parameter 'weight'"):
        tdhook_fn.call(model, tdhook_fn.params(model).apply(lambda t: 0.5 * t), torch.ones(1, 2))


def test_a_tensor_a_pre_hook_rebuilds_before_each_forward_is_no_view_to_refuse() -> None:
    torch.manual_seed(0)
    model = torch.nn.utils.spectral_norm(nn.Linear(3, 2)).eval()  # sets .weight = weight_orig.data, then recomputes
    params, x = tdhook_fn.params(model).apply(lambda t: 0.5 * t), torch.randn(4, 3)
    expected = torch.func.functional_call(copy.deepcopy(model), dict(params.flatten_keys(".").items()), (x,))
    torch.testing.assert_close(tdhook_fn.call(model, params, x), expected)
