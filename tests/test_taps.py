import copy

import pytest
import torch
from torch import nn
from torch.func import grad, jacrev, vjp, vmap
from zoo import Blocks, TwoInput, mlp, same, snapshot

import tdhook_fn
from tdhook_fn import capture, intervene, map_grad, perturb


def _setup():
    torch.manual_seed(0)
    model = mlp().eval()
    return model, tdhook_fn.params(model), torch.randn(3, 4)


def test_capture_output_and_input():
    model, p, x = _setup()
    out, seen = tdhook_fn.call_with_taps(
        model, p, [capture("[0]", key="pre"), capture("[2]", site="input", key="mid"), capture("[2]")], x
    )
    h = model[0](x)
    assert torch.equal(seen["pre"], h) and torch.equal(seen["mid"], torch.relu(h))
    assert torch.equal(seen["2"], out) and torch.equal(out, model(x))


def test_capture_with_fn_and_multi_argument_input():
    model = TwoInput().eval()
    x, y = torch.randn(2, 4), torch.randn(2, 3)
    _, seen = tdhook_fn.call_with_taps(model, tdhook_fn.params(model),
                                       [capture("head", site="input", fn=lambda v: v * 2)], x, y)
    assert torch.equal(seen["head"], 2 * torch.tanh(model.a(x) + model.b(y)))


def test_intervene_replaces_the_activation():
    model, p, x = _setup()
    out, _ = tdhook_fn.call_with_taps(model, p, [intervene("[1]", torch.zeros_like)], x)
    assert torch.equal(out, model[2].bias.expand(3, 3).detach())
    out, _ = tdhook_fn.call_with_taps(model, p, [intervene("[2]", lambda v: -v, site="input")], x)
    assert torch.equal(out, model[2](-torch.relu(model[0](x))))


def test_perturb_gives_layer_gradients():
    model, p, x = _setup()
    delta = torch.zeros(3, 8)
    g = grad(lambda d: tdhook_fn.call_with_taps(model, p, [perturb("[0]", d)], x)[0][:, 1].sum())(delta)
    h = model[0](x).detach().requires_grad_(True)
    model[2](model[1](h))[:, 1].sum().backward()
    torch.testing.assert_close(g, h.grad)
    # the same, one sample at a time
    per = vmap(grad(lambda d, xi: tdhook_fn.call_with_taps(model, p, [perturb("[0]", d)], xi)[0][1]))(delta, x)
    torch.testing.assert_close(per, h.grad)


def _torch_hooked(model, path_module, fn, site):
    ref = copy.deepcopy(model)
    target = ref.get_submodule(path_module)
    if site == "output":
        target.register_full_backward_pre_hook(lambda m, go: (fn(go[0]),))
    else:
        target.register_full_backward_hook(lambda m, gi, go: (fn(gi[0]),))
    return ref


@pytest.mark.parametrize("site", ["output", "input"])
def test_map_grad_matches_torch_backward_hooks(site):
    model, p, x = _setup()
    fn = lambda g: g.clamp(min=0) * 2
    ref = _torch_hooked(model, "2", fn, site)
    xr = x.clone().requires_grad_(True)
    ref(xr)[:, 0].sum().backward()
    f = lambda x: tdhook_fn.call_with_taps(model, p, [map_grad("[2]", fn, site=site)], x)[0][:, 0].sum()
    torch.testing.assert_close(grad(f)(x), xr.grad)
    # under vjp, jacrev and vmap too
    out, pull = vjp(lambda x: tdhook_fn.call_with_taps(model, p, [map_grad("[2]", fn, site=site)], x)[0], x)
    torch.testing.assert_close(pull(torch.eye(3)[0].expand(3, 3))[0], xr.grad)
    jac = jacrev(lambda xi: tdhook_fn.call_with_taps(model, p, [map_grad("[2]", fn, site=site)], xi)[0])(x[0])
    torch.testing.assert_close(jac[0], xr.grad[0])
    per = vmap(grad(lambda xi: tdhook_fn.call_with_taps(model, p, [map_grad("[2]", fn, site=site)], xi)[0][0]))(x)
    torch.testing.assert_close(per, xr.grad)
    # forward value unchanged
    assert torch.equal(tdhook_fn.call_with_taps(model, p, [map_grad("[2]", fn, site=site)], x)[0], model(x))


def test_taps_on_paths_of_every_form():
    torch.manual_seed(0)
    model = Blocks().eval()
    p = tdhook_fn.params(model)
    x = torch.randn(2, 4)
    before = snapshot(model)
    taps = [capture("layers[-1]"), capture("heads['aux']"), capture("<block0/module>[1]"), capture("fn(0)"),
            capture("layers.1")]
    _, seen = tdhook_fn.call_with_taps(model, p, taps, x)
    assert set(seen) == {"layers[-1]", "heads.aux", "block0/module.1", "fn(0)", "layers.1"}
    h0 = getattr(model, "block0/module")(x)
    assert torch.equal(seen["block0/module.1"], h0)
    assert torch.equal(seen["fn(0)"], model.layers[0](h0))
    assert same(before, snapshot(model))


def test_bad_tap_paths():
    model, p, x = _setup()
    with pytest.raises(ValueError, match=r"'\[7\]'"):
        tdhook_fn.call_with_taps(model, p, [capture("[7]")], x)
    with pytest.raises(ValueError, match="not to a submodule"):
        tdhook_fn.call_with_taps(model, p, [capture("[0:2]")], x)
    with pytest.raises(ValueError, match="site"):
        capture("[0]", site="grad")
    with pytest.raises(ValueError, match="dunder"):
        tdhook_fn.call_with_taps(model, p, [capture("__class__")], x)


def test_tap_errors_leave_no_hooks():
    model, p, x = _setup()
    before = snapshot(model)

    def explode(v):
        raise RuntimeError("tap failed")

    with pytest.raises(RuntimeError, match="tap failed"):
        tdhook_fn.call_with_taps(model, p, [capture("[0]"), intervene("[1]", explode)], x)
    assert same(before, snapshot(model))
    out, seen = tdhook_fn.call_with_taps(model, p, [], x)
    assert seen == {} and torch.equal(out, model(x))


def test_map_grad_on_tuple_outputs():
    model = nn.LSTM(3, 4, batch_first=True).eval()
    p = tdhook_fn.params(model)
    x = torch.randn(2, 5, 3)
    f = lambda x, s: tdhook_fn.call_with_taps(model, p, [map_grad("", lambda g: g * s)], x)[0][0].sum()
    torch.testing.assert_close(grad(f)(x, 3.0), 3 * grad(f)(x, 1.0))
