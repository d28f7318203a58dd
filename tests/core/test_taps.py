import copy

import pytest
import torch
from tensordict import TensorDict
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


class _WithSpare(nn.Module):
    """``lin`` runs; ``spare`` is never called by the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.spare = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.parametrize("tap", [
    intervene("spare", torch.zeros_like), perturb("spare", torch.zeros(3)), map_grad("spare", lambda g: 0 * g),
    capture("spare"), capture("spare", site="input"),
], ids=["intervene", "perturb", "map_grad", "capture", "capture-input"])
def test_a_tap_on_a_module_the_forward_never_calls_is_refused(tap):
    """It did nothing (an intervention changed nothing): an error naming the path, as latent's sites."""
    model = _WithSpare().eval()
    before = snapshot(model)
    never = r"'spare'(, site='input')?\) never ran: the forward never called module 'spare'"
    with pytest.raises(ValueError, match=never):
        tdhook_fn.call_with_taps(model, tdhook_fn.params(model), [tap], torch.randn(2, 4))
    f = tdhook_fn.functional(model).with_taps(tap)
    with pytest.raises(ValueError, match="never called module 'spare'"):
        f(tdhook_fn.params(model), TensorDict(input=torch.randn(2, 4), batch_size=[2]))
    assert same(before, snapshot(model))


def test_a_tap_at_a_run_the_module_never_makes_is_refused():
    model, p, x = _setup()
    with pytest.raises(ValueError, match=r"call=1, but the forward ran module '\[0\]' once"):
        tdhook_fn.call_with_taps(model, p, [intervene("[0]", torch.zeros_like, call=1)], x)
    out, _ = tdhook_fn.call_with_taps(model, p, [intervene("[0]", torch.zeros_like, call=0)], x)  # the one run
    assert torch.equal(out, model[2].bias.expand(3, 3).detach())


def test_guided_backprop_still_taps_every_module_including_those_never_called():
    from tdhook_fn.attribution import guided_backprop

    model = _WithSpare().eval()
    td = TensorDict(input=torch.randn(2, 4), batch_size=[2])
    assert guided_backprop(tdhook_fn.functional(model), tdhook_fn.params(model), td, target=0)["input"].shape == (2, 4)


def test_a_capture_keyed_like_an_output_is_refused():
    """It would replace the model's output in f's result (a method would then differentiate the capture)."""
    from tdhook_fn.attribution import saliency

    model, p, x = _setup()
    f = tdhook_fn.functional(model)
    with pytest.raises(ValueError, match=r"capture\('\[0\]'\) stores under key 'output', which holds an output"):
        f.with_taps(capture("[0]", key="output"))
    with pytest.raises(ValueError, match="key 'output', which holds an output"):
        saliency(f, p, TensorDict(input=x, batch_size=[3]), target=0, taps=[capture("[0]", key="output")])
    g = tdhook_fn.functional(model, out_keys=["logits"])
    with pytest.raises(ValueError, match="key 'logits'"):
        g.with_taps(capture("[0]", key="logits"))
    assert set(g.with_taps(capture("[0]", key="output"))(p, TensorDict(input=x, batch_size=[3])).keys()) == {
        "logits", "output"}
    nested = tdhook_fn.functional(model, out_keys=[("out", "logits")])
    with pytest.raises(ValueError, match="key 'out', which holds an output"):  # it would replace the nested output
        nested.with_taps(capture("[0]", key="out"))


def test_two_captures_with_one_key_are_refused():
    model, p, x = _setup()
    taps = [capture("[0]", key="h"), capture("[2]", key="h")]
    with pytest.raises(ValueError, match=r"2 captures store under one key 'h' \(paths \['\[0\]', '\[2\]'\]\)"):
        tdhook_fn.call_with_taps(model, p, taps, x)
    with pytest.raises(ValueError, match="one key 'h'"):
        tdhook_fn.functional(model).with_taps(*taps)
    with pytest.raises(ValueError, match="one key '0'"):  # the default keys clash too
        tdhook_fn.functional(model).with_taps(capture("[0]", call=0), capture("[0]"))
