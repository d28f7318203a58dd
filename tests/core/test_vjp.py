"""The engine's vjp (NOTE [eager vjp]): plain autograd where it is exact, torch.func.vjp where it is not."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn._vjp import vjp
from tdhook_fn.attribution import integrated_gradients, saliency


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _forward(net: nn.Module, w: torch.Tensor | None = None) -> Any:
    def forward(diff: tuple[TensorDict, list[torch.Tensor]]) -> tuple[TensorDict, dict[str, torch.Tensor]]:
        td, (shift,) = diff
        hidden = net[1](net[0](td["x"]) + shift)
        out = net[2](hidden) if w is None else net[2](hidden) * w
        return TensorDict(y=out, z=td["x"].sum(-1), batch_size=td.batch_size), {"hidden": hidden}
    return forward


def _primals() -> tuple[TensorDict, list[torch.Tensor]]:
    torch.manual_seed(1)
    return TensorDict(x=torch.randn(5, 4, dtype=torch.float64), batch_size=[5]), [torch.zeros(8, dtype=torch.float64)]


def _cotangent() -> TensorDict:
    torch.manual_seed(2)
    return TensorDict(y=torch.randn(5, 3, dtype=torch.float64), z=torch.randn(5, dtype=torch.float64), batch_size=[5])


def test_plain_path_equals_functorch_and_pulls_back_more_than_once(monkeypatch: pytest.MonkeyPatch) -> None:
    net, primals = _net().requires_grad_(False), _primals()
    ref_out, ref_pull, ref_aux = torch.func.vjp(_forward(net), primals, has_aux=True)
    monkeypatch.setattr(torch.func, "vjp", None)  # the plain path must not need it
    out, pull, aux = vjp(_forward(net), primals)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(aux["hidden"], ref_aux["hidden"], rtol=0, atol=0)
    assert not out["y"].requires_grad and not aux["hidden"].requires_grad
    for scale in (1.0, -2.0):  # the graph is kept for another pullback
        (got_td, [got_shift]), = pull(_cotangent() * scale)
        (ref_td, [ref_shift]), = ref_pull(_cotangent() * scale)
        torch.testing.assert_close(got_td["x"], ref_td["x"], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_shift, ref_shift, rtol=1e-12, atol=1e-12)


def test_the_model_s_own_parameters_are_closed_over_and_get_no_grad() -> None:
    net, primals = _net(), _primals()  # its parameters require grad: functorch's path, as before
    out, pull, _ = vjp(_forward(net), primals)
    pull(_cotangent())
    assert out["y"].requires_grad and all(p.grad is None for p in net.parameters())


def test_an_output_that_reads_no_primal_gets_zero_gradients() -> None:
    net, primals = _net().requires_grad_(False), _primals()

    def forward(diff: Any) -> tuple[TensorDict, dict[str, torch.Tensor]]:
        return TensorDict(y=net(torch.ones(5, 4, dtype=torch.float64)).detach(), batch_size=[5]), {}

    _, pull, _ = vjp(forward, primals)
    (td, [shift]), = pull(TensorDict(y=torch.ones(5, 3, dtype=torch.float64), batch_size=[5]))
    assert torch.equal(td["x"], torch.zeros(5, 4, dtype=torch.float64)) and torch.equal(shift, torch.zeros(8).double())


def test_a_closed_over_tensor_that_requires_grad_keeps_the_result_differentiable() -> None:
    net, primals = _net().requires_grad_(False), _primals()
    w = torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64, requires_grad=True)
    _, pull, _ = vjp(_forward(net, w), primals)
    (td, _), = pull(_cotangent())
    (dw,) = torch.autograd.grad(td["x"].sum(), w)
    w2 = w.detach().clone().requires_grad_()
    _, ref_pull, _ = torch.func.vjp(_forward(net, w2), primals, has_aux=True)
    (ref_td, _), = ref_pull(_cotangent())
    (ref_dw,) = torch.autograd.grad(ref_td["x"].sum(), w2)
    torch.testing.assert_close(dw, ref_dw)
    assert dw.abs().sum() > 0


def test_a_saliency_map_stays_differentiable_in_inputs_that_require_grad() -> None:
    net = _net()
    f, p = tdhook_fn.pure(net)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    attr = saliency(f, p, TensorDict(input=x, batch_size=[5]), target=1, abs=False)["input"]
    (got,) = torch.autograd.grad(attr.pow(2).sum(), x)

    def reference(xs: torch.Tensor) -> torch.Tensor:
        (g,) = torch.autograd.grad(net(xs)[:, 1].sum(), xs, create_graph=True)
        return g

    (want,) = torch.autograd.grad(reference(x).pow(2).sum(), x)
    torch.testing.assert_close(got, want)


def test_params_that_require_grad_give_maps_differentiable_in_them() -> None:
    net = _net()
    f = tdhook_fn.functional(net)
    p = tdhook_fn.params(net).apply(lambda t: t.detach().requires_grad_())
    x = torch.randn(5, 4, dtype=torch.float64)
    attr = saliency(f, p, TensorDict(input=x, batch_size=[5]), target=0, abs=False)["input"]
    weight = p["0", "weight"]
    (got,) = torch.autograd.grad(attr.sum(), weight)

    def reference(w: torch.Tensor) -> torch.Tensor:
        params = p.clone()
        params["0", "weight"] = w
        return torch.func.grad(lambda xs: f(params, TensorDict(input=xs, batch_size=[5]))["output"][:, 0].sum())(x)

    torch.testing.assert_close(got, torch.func.grad(lambda w: reference(w).sum())(weight.detach()))


@pytest.mark.parametrize("context", ["no_grad", "vmap"])
def test_the_methods_agree_under_no_grad_and_vmap(context: str) -> None:
    net = _net()
    f, p = tdhook_fn.pure(net)
    x = TensorDict(input=torch.randn(6, 4, dtype=torch.float64), batch_size=[6])
    want = integrated_gradients(f, p, x, target=2, baselines=0.0, n_steps=8)
    if context == "no_grad":
        with torch.no_grad():
            got = integrated_gradients(f, p, x, target=2, baselines=0.0, n_steps=8)
    else:
        got = torch.func.vmap(lambda td: integrated_gradients(f, p, td, target=2, baselines=0.0, n_steps=8))(x)
    torch.testing.assert_close(got["input"], want["input"])


def test_nested_tensordicts_come_back_with_their_structure_and_batch_sizes() -> None:
    inner = TensorDict(b=torch.randn(3, 2, 4, dtype=torch.float64), batch_size=[3, 2])
    primals = TensorDict(a=inner, c=torch.randn(3, dtype=torch.float64), batch_size=[3])

    def forward(td: TensorDict) -> tuple[torch.Tensor, tuple[()]]:
        return (td["a", "b"].sin().sum((1, 2)) * td["c"]), ()

    _, pull, _ = vjp(forward, primals)
    (grads,) = pull(torch.ones(3, dtype=torch.float64))
    _, ref_pull, _ = torch.func.vjp(forward, primals, has_aux=True)
    (want,) = ref_pull(torch.ones(3, dtype=torch.float64))
    assert grads["a"].batch_size == torch.Size([3, 2])
    torch.testing.assert_close(grads, want)


def test_a_forward_redone_under_func_vjp_draws_as_the_first_run_did() -> None:
    """A forward that reaches a closed-over tensor requiring grad runs again under `torch.func.vjp`
    (NOTE [eager vjp]); the second run draws what the first drew, and the generator ends where one forward leaves it
    (NOTE [a forward run again draws the same numbers])."""
    x = torch.randn(4, 3)
    w = torch.randn(3)
    results, after = [], []
    for closed in (w.clone().requires_grad_(), w):
        def forward(p: torch.Tensor, closed: torch.Tensor = closed) -> tuple[torch.Tensor, list[torch.Tensor]]:
            return (p + torch.rand_like(p)) @ closed, []

        torch.manual_seed(0)
        out, pullback, _ = vjp(forward, x)
        results.append((out.detach(), pullback(torch.ones(4))[0].detach()))
        after.append(torch.rand(2))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    assert torch.equal(after[0], after[1])
