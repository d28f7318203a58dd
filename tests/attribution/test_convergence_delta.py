"""The convergence delta (NOTE [convergence delta]): the maps of the path's space, the change weighted.

Oracle: captum's ``compute_convergence_delta`` for :func:`convergence_delta` on the same
maps; completeness (the delta goes to zero with the steps) for what
``integrated_gradients`` counts.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import convergence_delta, integrated_gradients


def smooth() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Softplus(), nn.Linear(5, 3)).double()


def data() -> tuple[TensorDict, TensorDict]:
    torch.manual_seed(1)
    x = TensorDict(input=torch.randn(7, 4, dtype=torch.float64), batch_size=[7])
    return x, TensorDict(input=torch.randn(7, 4, dtype=torch.float64) * 0.1, batch_size=[7])


def test_the_public_delta_is_captums_on_the_same_maps() -> None:
    from captum.attr import IntegratedGradients as CaptumIG

    net = smooth()
    f, p = tdhook_fn.pure(net)
    x, b = data()
    attr = integrated_gradients(f, p, x, b, target=2, n_steps=3, method="riemann_left")  # a delta far from zero
    ours = convergence_delta(f, p, x, b, attr, target=2)
    theirs = CaptumIG(net).compute_convergence_delta(attr["input"], b["input"], x["input"], target=2)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    assert ours.abs().max() > 1e-6


def test_integrated_gradients_returns_that_delta() -> None:
    f, p = tdhook_fn.pure(smooth())
    x, b = data()
    attr, delta = integrated_gradients(f, p, x, b, target=(0, 2), n_steps=3, method="riemann_left",
                                       return_convergence_delta=True)
    torch.testing.assert_close(delta, convergence_delta(f, p, x, b, attr, target=(0, 2)), rtol=0, atol=0)
    maps, deltas = integrated_gradients(f, p, x, b, target=(0, 2), n_steps=3, method="riemann_left",
                                        per_target=True, return_convergence_delta=True)
    assert deltas.shape == (2, 7)
    torch.testing.assert_close(deltas, convergence_delta(f, p, x, b, maps, target=(0, 2), per_target=True),
                               rtol=0, atol=0)


def test_gradients_read_at_layers_while_the_inputs_move_do_not_count() -> None:
    """interpolate="inputs": the layer's path-averaged gradients are no shares of the change."""
    f, p = tdhook_fn.pure(smooth())
    x, b = data()
    attr, delta = integrated_gradients(f, p, x, b, target=1, n_steps=64, layers=["[2]"], interpolate="inputs",
                                       return_convergence_delta=True)
    assert set(attr.keys()) == {"input", "[2]"} and attr["[2]"].abs().sum() > 0.1
    _, inputs_only = integrated_gradients(f, p, x, b, target=1, n_steps=64, return_convergence_delta=True)
    torch.testing.assert_close(delta, inputs_only, rtol=1e-12, atol=1e-12)
    assert delta.abs().max() < 1e-6  # completeness
    everything = convergence_delta(f, p, x, b, attr, target=1)  # captum's formula over every map given
    assert (everything - delta).abs().max() > 0.1


def test_in_layer_space_the_layers_maps_count() -> None:
    f, p = tdhook_fn.pure(smooth())
    x, b = data()
    _, delta = integrated_gradients(f, p, x, b, target=1, n_steps=64, layers=["[2]"], return_convergence_delta=True)
    assert delta.abs().max() < 1e-6


def test_constant_cotangents_weight_the_change() -> None:
    f, p = tdhook_fn.pure(smooth())
    x, b = data()
    weights = torch.tensor([0.5, -2.0, 3.0], dtype=torch.float64)
    weighted = lambda values: values.apply(lambda v: weights.expand_as(v))
    attr, delta = integrated_gradients(f, p, x, b, target=(0, 1, 2), n_steps=64, cotangents=weighted,
                                       return_convergence_delta=True)
    assert delta.abs().max() < 1e-6  # sum(attr) = sum_t w_t (F_t(x) - F_t(b))
    _, unweighted = integrated_gradients(f, p, x, b, target=(0, 1, 2), n_steps=64, return_convergence_delta=True)
    change = f(p, x)["output"] - f(p, b)["output"]
    torch.testing.assert_close(attr["input"].sum(-1), (change * weights).sum(-1), rtol=1e-6, atol=1e-6)
    assert unweighted.abs().max() < 1e-6


def test_cotangents_that_depend_on_the_values_refuse_the_delta() -> None:
    f, p = tdhook_fn.pure(smooth())
    x, b = data()
    by_value = lambda values: values.apply(torch.sign)
    integrated_gradients(f, p, x, b, target=1, n_steps=4, cotangents=by_value)  # the maps alone are fine
    with pytest.raises(ValueError, match="cotangents that depend on the target values"):
        integrated_gradients(f, p, x, b, target=1, n_steps=4, cotangents=lambda v: v.apply(lambda t: t * 1.0),
                             return_convergence_delta=True)


def test_no_map_of_the_paths_space_refuses_the_delta() -> None:
    f, p = tdhook_fn.pure(smooth())
    x, b = data()
    with pytest.raises(ValueError, match="needs the maps of the path's space"):
        integrated_gradients(f, p, x, b, target=1, layers=["[2]"], interpolate="inputs", use_inputs=False,
                             return_convergence_delta=True)


def test_baselines_with_another_batch_are_refused() -> None:
    f, p = tdhook_fn.pure(smooth())
    x, b = data()
    attr = integrated_gradients(f, p, x, b, target=1, n_steps=4)
    refused = r"convergence_delta: baselines for input 'input' have shape \[3, 4\], which does not broadcast"
    with pytest.raises(ValueError, match=refused):
        convergence_delta(f, p, x, b[:3], attr, target=1)


def test_baselines_are_taken_as_integrated_gradients_takes_them() -> None:
    """A number, a tensor (one sample's broadcasts) or a TensorDict: the same delta as the full path start."""
    f, p = tdhook_fn.pure(smooth())
    x, _ = data()
    attr = integrated_gradients(f, p, x, 0.5, target=1, n_steps=3, method="riemann_left")
    full = convergence_delta(f, p, x, x.apply(lambda v: torch.full_like(v, 0.5)), attr, target=1)
    assert full.abs().max() > 1e-6  # few steps: a delta to compare
    row = torch.full((1, 4), 0.5, dtype=torch.float64)
    for baselines in (0.5, row, row.expand(7, 4)):
        torch.testing.assert_close(convergence_delta(f, p, x, baselines, attr, target=1), full, rtol=0, atol=0)


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(4, 6), nn.Linear(3, 6), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.a(x) + self.b(y)))


def two_inputs() -> tuple[nn.Module, TensorDict]:
    torch.manual_seed(0)
    model = TwoInputs().double().eval()
    return model, TensorDict(x=torch.randn(3, 4, dtype=torch.float64), y=torch.randn(3, 3, dtype=torch.float64),
                             batch_size=[3])


def test_baselines_for_the_attributed_inputs_only() -> None:
    """Baselines holding only ``y``: with ``input_keys=["y"]`` x stays; without, the missing baseline is named."""
    model, td = two_inputs()
    f, p = tdhook_fn.functional(model, in_keys=["x", "y"]), tdhook_fn.params(model)
    only_y = td.select("y").apply(torch.zeros_like)
    attr = integrated_gradients(f, p, td, only_y, target=0, n_steps=200, input_keys=["y"])
    delta = convergence_delta(f, p, td, only_y, attr, target=0, input_keys=["y"])
    assert delta.abs().max() < 1e-6  # the path moved y alone
    start = td.clone()
    start["y"] = torch.zeros_like(td["y"])
    torch.testing.assert_close(delta, convergence_delta(f, p, td, start, attr, target=0), rtol=0, atol=0)
    with pytest.raises(KeyError, match="convergence_delta: no baseline for input 'x'.*input_keys"):
        convergence_delta(f, p, td, only_y, attr, target=0)


def test_compat_delta_starts_only_the_attributed_inputs_at_their_baselines() -> None:
    """tdhook's formula, with a baseline given for an input that is not attributed (it never moves)."""
    from tdhook_fn.compat.attribution import IntegratedGradients

    model, inputs = two_inputs()
    x, y = inputs["x"], inputs["y"]
    base = TensorDict(x=torch.zeros_like(x), y=torch.zeros_like(y), note=torch.zeros(3), batch_size=[3])
    td = TensorDict(x=x, y=y, baseline=base, batch_size=[3])
    factory = IntegratedGradients(n_steps=200, init_attr_inputs=lambda i, _e: i.select("y"), multiply_by_inputs=True,
                                  compute_convergence_delta=True,
                                  init_attr_targets=lambda t, _e: TensorDict(out=t["output"][..., 0],
                                                                             batch_size=t.batch_size))
    with factory.prepare(model, in_keys=["x", "y"]) as hooked:
        out = hooked(td.clone())
    assert out["convergence_delta"].abs().max() < 1e-6  # only y moved, from its baseline


def test_input_keys_the_inputs_do_not_hold_are_named() -> None:
    f, p = tdhook_fn.pure(smooth())
    x, b = data()
    attr = integrated_gradients(f, p, x, b, target=1, n_steps=4)
    with pytest.raises(KeyError, match=r"convergence_delta: input_keys names \['inputs'\].*they hold \['input'\]"):
        convergence_delta(f, p, x, 0.0, attr, target=1, input_keys=["inputs"])
    with pytest.raises(KeyError, match=r"integrated_gradients: input_keys names \['inputs'\]"):
        integrated_gradients(f, p, x, 0.0, target=1, input_keys=["inputs"])
