from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vjp, vmap
from zoo import same, snapshot, zoo

import tdhook_fn

MODELS = zoo()


@pytest.mark.parametrize("name", MODELS)
def test_call_equals_forward_and_functional_call(name):
    model, inputs = MODELS[name]
    p = tdhook_fn.params(model)
    with torch.no_grad():  # detached params take the same kernels as a no-grad forward
        expected = model(*inputs)
    plain = {".".join(k): v for k, v in p.items(include_nested=True, leaves_only=True)}
    assert torch.equal(tdhook_fn.call(model, p, *inputs), expected)
    assert torch.equal(functional_call(model, plain, inputs), expected)


@pytest.mark.parametrize("name", MODELS)
def test_call_uses_the_given_params(name):
    model, inputs = MODELS[name]
    p = tdhook_fn.params(model)
    shifted = p.apply(lambda t: t * 0.5 if t.is_floating_point() else t)
    plain = {".".join(k): v for k, v in shifted.items(include_nested=True, leaves_only=True)}
    before = snapshot(model)
    out = tdhook_fn.call(model, shifted, *inputs)
    assert torch.allclose(out, functional_call(model, plain, inputs), atol=1e-6)
    assert not torch.allclose(out, model(*inputs))
    assert same(before, snapshot(model))


@pytest.mark.parametrize("name", ["mlp", "cnn", "two_input", "tied", "blocks"])
def test_vmap_over_stacked_params_equals_a_loop(name):
    model, inputs = MODELS[name]
    p = tdhook_fn.params(model)
    stacked = torch.stack([p.apply(lambda t, i=i: t * (1 + 0.1 * i) if t.is_floating_point() else t)
                           for i in range(5)])
    assert stacked.batch_size == torch.Size([5])
    batched = vmap(tdhook_fn.call, (None, 0, *[None] * len(inputs)))(model, stacked, *inputs)
    looped = torch.stack([tdhook_fn.call(model, stacked[i], *inputs) for i in range(5)])
    torch.testing.assert_close(batched, looped)


@pytest.mark.parametrize("name", ["mlp", "cnn", "two_input", "tied", "blocks", "transformer"])
def test_grad_wrt_params_equals_autograd(name):
    model, inputs = MODELS[name]
    model.zero_grad()
    model(*inputs).square().sum().backward()
    expected = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    before = snapshot(model)
    p = tdhook_fn.params(model)
    weights = p.select(*[tuple(n.split(".")) for n in expected])  # integer buffers are not differentiable
    frozen = p.exclude(*[tuple(n.split(".")) for n in expected])
    loss = lambda w: tdhook_fn.call(model, w.clone(False).update(frozen), *inputs).square().sum()
    g = grad(loss)(weights)
    for n, value in expected.items():
        torch.testing.assert_close(g.get(tuple(n.split("."))), value)
    assert same(before, snapshot(model))


def test_grad_vjp_jacrev_wrt_inputs():
    model, (x,) = MODELS["mlp"]
    p = tdhook_fn.params(model)
    xr = x.clone().requires_grad_(True)
    model(xr)[:, 1].sum().backward()
    torch.testing.assert_close(grad(lambda x: tdhook_fn.call(model, p, x)[:, 1].sum())(x), xr.grad)
    out, pullback = vjp(lambda x: tdhook_fn.call(model, p, x), x)
    (vx,) = pullback(torch.ones_like(out))
    jac = jacrev(lambda x: tdhook_fn.call(model, p, x))(x[0])
    torch.testing.assert_close(vx[0], jac.sum(0))


def test_kwargs_are_passed_to_the_forward():
    model = nn.MultiheadAttention(4, 2, batch_first=True).eval()
    x = torch.randn(2, 3, 4)
    p = tdhook_fn.params(model)
    out, weights = tdhook_fn.call(model, p, x, x, x, need_weights=True, average_attn_weights=False)
    with torch.no_grad():  # detached params take MHA's fused fast path, as a no-grad forward does
        ref_out, ref_weights = model(x, x, x, need_weights=True, average_attn_weights=False)
    assert torch.equal(out, ref_out) and torch.equal(weights, ref_weights)


class Exploding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.seen = x  # a forward that writes attributes writes them on the private copy
        self.count.add_(1)
        if x.sum() > 0:
            raise RuntimeError("boom")
        return self.lin(x)


def test_model_unchanged_after_a_forward_that_raises():
    model = Exploding()
    model.lin.register_forward_hook(lambda *a: None)
    before = snapshot(model)
    p = tdhook_fn.params(model)
    with pytest.raises(RuntimeError, match="boom"):
        tdhook_fn.call_with_taps(model, p, [tdhook_fn.capture("lin"), tdhook_fn.map_grad("lin", torch.neg)],
                                 torch.ones(3))
    assert same(before, snapshot(model))
    assert not hasattr(model, "seen")
    assert model.count.item() == 0 and p["count"].item() == 0  # in-place buffer updates hit private copies
    # and the next call works, with no leftover taps
    out = tdhook_fn.call(model, p, -torch.ones(3))
    assert torch.equal(out, model.lin(-torch.ones(3)))


def test_user_hooks_on_the_model_still_run_and_stay_registered():
    model, (x,) = MODELS["mlp"]
    seen = []
    handle = model[0].register_forward_hook(lambda m, a, o: seen.append(o.shape))
    try:
        tdhook_fn.call(model, tdhook_fn.params(model), x)
        assert seen == [torch.Size([2, 8])]
        assert len(model[0]._forward_hooks) == 1
    finally:
        handle.remove()


def test_mode_flags_and_structure_changes_are_seen():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    x = torch.ones(64, 4)
    p = tdhook_fn.params(model)
    model.eval()
    assert torch.equal(tdhook_fn.call(model, p, x), model(x))
    model.train()
    torch.manual_seed(0)
    out = tdhook_fn.call(model, p, x)
    assert (out == 0).any()
    assert model.training and model[1].training
    model.eval()
    model[1] = nn.Tanh()  # a replaced submodule is seen at the next call
    assert torch.equal(tdhook_fn.call(model, p, x), model(x))
    model.add_module("2", nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"missing \['2.bias', '2.weight'\]"):
        tdhook_fn.call(model, p, x)
    assert torch.equal(tdhook_fn.call(model, tdhook_fn.params(model), x), model(x))


def test_a_class_or_parameter_replaced_between_calls_is_seen():
    """The shadow's structure check (one loop over the modules, `Shadow.is_current`) sees a module's class assigned
    anew and a parameter replaced, also once the shadow was pooled by earlier calls."""

    class Doubled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    x = torch.randn(3, 4)
    p = tdhook_fn.params(model)
    for _ in range(2):
        assert torch.equal(tdhook_fn.call(model, p, x), model(x))
    model[2].__class__ = Doubled
    assert torch.equal(tdhook_fn.call(model, p, x), model(x))
    model[2].weight = model[0].weight  # tied: its key is now the first name's only
    with pytest.raises(ValueError, match=r"unexpected \['2.weight'\]"):
        tdhook_fn.call(model, p, x)
    assert torch.equal(tdhook_fn.call(model, tdhook_fn.params(model), x), model(x))


def test_missing_or_extra_params_are_named():
    model, (x,) = MODELS["mlp"]
    p = tdhook_fn.params(model)
    with pytest.raises(ValueError, match=r"missing \['0.bias'\], unexpected \[\]"):
        tdhook_fn.call(model, p.exclude(("0", "bias")), x)
    with pytest.raises(ValueError, match=r"unexpected \['extra.w'\]"):
        tdhook_fn.call(model, p.clone().set(("extra", "w"), torch.ones(1)), x)
    with pytest.raises(TypeError, match="TensorDict"):
        tdhook_fn.call(model, dict(model.named_parameters()), x)


def test_call_compiles():
    model, (x,) = MODELS["mlp"]
    p = tdhook_fn.params(model)
    compiled = torch.compile(lambda p, x: tdhook_fn.call(model, p, x), backend="aot_eager")
    torch.testing.assert_close(compiled(p, x), model(x))
    doubled = p.apply(lambda t: t * 2)
    torch.testing.assert_close(compiled(doubled, x), tdhook_fn.call(model, doubled, x))


def test_run_with_overrides_replaces_only_those_tensors():
    from tdhook_fn._functional import run

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 2))
    before = snapshot(model)
    x = torch.randn(4, 3)
    zero = torch.zeros(2, 3)
    out, _ = run(model, None, (), lambda root: root(x), overrides={("0", "weight"): zero})
    torch.testing.assert_close(out, model[2](torch.tanh(model[0].bias.expand(4, 2))), rtol=0, atol=0)
    assert same(before, snapshot(model))
    with pytest.raises(ValueError, match=r"'0.weight' has shape \(3, 3\), the model has \(2, 3\)"):
        run(model, None, (), lambda root: root(x), overrides={("0", "weight"): torch.zeros(3, 3)})
    with pytest.raises(ValueError, match=r"'9.weight', which is not a parameter"):
        run(model, None, (), lambda root: root(x), overrides={("9", "weight"): zero})
    with pytest.raises(ValueError, match="params=None"):
        run(model, tdhook_fn.params(model), (), lambda root: root(x), overrides={("0", "weight"): zero})
    assert same(before, snapshot(model))


@pytest.mark.parametrize("entry", ["call", "call_with_taps", "functional"])
def test_params_none_is_refused_and_the_model_is_not_run(entry):
    from tensordict import TensorDict

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).train()
    before = snapshot(model)
    x = torch.randn(5, 3)
    calls = {
        "call": lambda: tdhook_fn.call(model, None, x),
        "call_with_taps": lambda: tdhook_fn.call_with_taps(model, None, [tdhook_fn.capture("[0]")], x),
        "functional": lambda: tdhook_fn.functional(model)(None, TensorDict(input=x, batch_size=[5])),
    }
    with pytest.raises(TypeError, match=rf"{entry}: params is None; pass tdhook_fn.params\(model\)"):
        calls[entry]().sum().backward()
    assert same(before, snapshot(model))  # no running statistics updated
    assert model[0].weight.grad is None


def test_shadow_structure_check_is_signature_of():
    """`Shadow.is_current` writes `signature_of` inline (it runs per module on every call): the two agree on an
    unchanged model (any field one has and the other lacks makes every shadow stale) and both see each change."""
    from tdhook_fn._shadow import Shadow
    from tdhook_fn._shadow_node import signature_of

    def build() -> nn.Module:
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2)))
        model.register_buffer("scale", torch.ones(1))
        return model

    def changes(model: nn.Module) -> list[Callable[[], None]]:
        return [lambda: model.add_module("extra", nn.ReLU()),
                lambda: model[2].__setitem__(1, nn.Linear(4, 2)),
                lambda: setattr(model[0], "weight", nn.Parameter(torch.zeros(4, 4))),
                lambda: model[0].register_parameter("extra", nn.Parameter(torch.zeros(1))),
                lambda: setattr(model, "scale", torch.zeros(1)),
                lambda: model[1].register_buffer("extra", torch.zeros(1)),
                lambda: setattr(model[2][0], "__class__", nn.GELU)]

    for i in range(len(changes(build()))):
        model = build()
        shadow = Shadow(model, False)
        assert shadow.is_current()
        before = [signature_of(m) for m in model.modules()]
        changes(model)[i]()
        assert [signature_of(m) for m in model.modules()] != before, i
        assert not shadow.is_current(), i
