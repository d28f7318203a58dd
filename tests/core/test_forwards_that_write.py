"""Forwards that write their inputs or their parameters in place: the caller's tensors stay, or the call raises."""

from __future__ import annotations

import pytest
import torch
from tensordict import NonTensorData, TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import DimsConfig, grad_cam, guided_backprop, integrated_gradients, saliency


class AddPos(nn.Module):
    """``x += pos``: a positional embedding added in place, as many models do."""

    def __init__(self, data_dependent: bool = False) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.ones(4))
        self.data_dependent = data_dependent

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.data_dependent or bool(x.abs().sum() > 0):  # (meta tensors cannot decide this)
            x += self.pos
        return x


def model(data_dependent: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(AddPos(data_dependent), nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).eval()


METHODS = {
    "grad_cam": lambda f, p, td: grad_cam(f, p, td, target=0, layers={"[2]": DimsConfig()})["[2]"],
    "saliency": lambda f, p, td: saliency(f, p, td, target=0, use_inputs=False, layers=["[2]"])["[2]"],
    "guided_backprop": lambda f, p, td: guided_backprop(f, p, td, target=0, use_inputs=False, layers=["[2]"])["[2]"],
}


@pytest.mark.parametrize("method", list(METHODS))
def test_a_sample_without_batch_dims_is_not_written_by_the_check(method: str) -> None:
    """NOTE [unbatched inputs]: the comparison runs the model on copies, and the map is the batch of one's."""
    f, p = tdhook_fn.pure(model())
    x = torch.randn(4)
    before = x.clone()
    alone = METHODS[method](f, p, TensorDict(input=x, batch_size=[]))
    assert torch.equal(x, before)
    one = METHODS[method](f, p, TensorDict(input=x.unsqueeze(0), batch_size=[1]))
    torch.testing.assert_close(alone, one[0])


def test_the_real_run_of_a_failed_shape_probe_is_on_copies() -> None:
    """A forward meta tensors cannot run is run for real to learn the layers' shapes: not on the caller's tensors."""
    f, p = tdhook_fn.pure(model(data_dependent=True))
    x = torch.randn(3, 4)
    before = x.clone()
    first = METHODS["grad_cam"](f, p, TensorDict(input=x, batch_size=[3]))
    assert torch.equal(x, before)
    torch.testing.assert_close(METHODS["grad_cam"](f, p, TensorDict(input=x, batch_size=[3])), first, rtol=0, atol=0)


def test_a_compat_cache_in_does_not_run_on_the_callers_inputs() -> None:
    import tdhook.attribution

    import tdhook_fn.compat.attribution

    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.head = nn.Linear(4, 5), nn.Linear(3, 5), nn.Linear(5, 2)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            y += 1.0
            return self.head(torch.tanh(self.a(x) + self.b(y)))

    torch.manual_seed(0)
    net, x, y = TwoInputs().eval(), torch.randn(3, 4), torch.randn(3, 3)
    maps = []
    first = lambda t, _e: TensorDict(o=t["output"][..., 0], batch_size=t.batch_size)
    for lib in (tdhook.attribution, tdhook_fn.compat.attribution):
        factory = lib.Saliency(input_modules=["a"], init_attr_inputs=lambda i, _e: i.select("x"),
                               init_attr_targets=first, init_attr_cache_in=lambda c, _e: c)
        with factory.prepare(net, in_keys=["x", "y"], out_keys=["output"]) as hooked:
            maps.append(hooked(TensorDict(x=x.clone(), y=y.clone(), batch_size=[3]))["attr", "x"])
    torch.testing.assert_close(maps[1], maps[0])


class Moded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, mode: str = "linear") -> torch.Tensor:
        y = self.lin(x)
        return torch.tanh(y) if mode == "tanh" else y


def test_a_non_tensor_input_reaches_the_forward_as_its_value() -> None:
    from captum.attr import IntegratedGradients, Saliency

    torch.manual_seed(0)
    net = Moded()
    f, p = tdhook_fn.pure(net, in_keys={"input": "x", "mode": "mode"})
    x = torch.randn(3, 2)
    td = TensorDict(input=x, batch_size=[3])
    td["mode"] = NonTensorData("tanh")
    tanh = lambda v: net(v, mode="tanh")
    torch.testing.assert_close(f(p, td)["output"], tanh(x).detach())
    torch.testing.assert_close(saliency(f, p, td, target=0, input_keys=["input"])["input"],
                               Saliency(tanh).attribute(x, target=0, abs=False))
    torch.testing.assert_close(integrated_gradients(f, p, td, 0.0, target=0, input_keys=["input"])["input"],
                               IntegratedGradients(tanh).attribute(x, target=0), rtol=1e-4, atol=1e-5)


def test_different_non_tensor_values_across_the_batch_are_refused() -> None:
    f, p = tdhook_fn.pure(Moded(), in_keys={"input": "x", "mode": "mode"})
    td = torch.stack([TensorDict(input=torch.randn(2), mode=NonTensorData(m), batch_size=[]) for m in ("tanh", "x")])
    with pytest.raises(TypeError, match="in_key 'mode' holds different non-tensor values"):
        f(p, td)


class Clamped(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.weight.clamp_(-0.2, 0.2)
        return super().forward(x)


class Renormed(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.weight.data = torch.renorm(self.weight.data, 2, 0, 0.5)
        return super().forward(x)


@pytest.mark.parametrize("layer", [Clamped, Renormed])
def test_a_forward_writing_its_parameter_is_named(layer: type[nn.Linear]) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(layer(3, 4), nn.Tanh(), nn.Linear(4, 2))
    f, p = tdhook_fn.pure(net)
    td = TensorDict(input=torch.randn(5, 3), batch_size=[5])
    with pytest.raises(RuntimeError, match=r"module '0' wrote its parameter 'weight' while it ran.*parametrize"):
        tdhook_fn.call(net, p.clone(), td["input"])
    with pytest.raises(RuntimeError, match=r"module '0' wrote its parameter 'weight'"):
        saliency(f, p.clone(), td, target=0)
