"""DeepLift's maps carry no graph, also where the inputs require grad.

The multipliers come from a modified backward with no graph of their own; had the final
product with ``inputs - baselines`` kept one, ``torch.autograd.grad`` of a map would see
only that factor and return a wrong gradient silently. Without a graph it raises.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import deeplift, deeplift_shap, layer_deeplift

D = torch.float64


class _Residual(nn.Module):  # (not a chain: the general path)
    def __init__(self) -> None:
        super().__init__()
        self.a, self.act, self.out = nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(x + self.a(x)))


def _models() -> dict[str, tuple[nn.Module, str]]:
    torch.manual_seed(0)
    chain = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    return {"chain": (chain.to(D), "[0]"), "residual": (_Residual().to(D), "a")}


CALLS: dict[str, Callable[..., torch.Tensor]] = {
    "deeplift": lambda f, p, x, b, layer: deeplift(f, p, x, b, target=0),
    "deeplift, zero baseline": lambda f, p, x, b, layer: deeplift(f, p, x, target=0),
    "deeplift, no multiply": lambda f, p, x, b, layer: deeplift(f, p, x, b, target=0, multiply_by_inputs=False),
    "deeplift_shap": lambda f, p, x, b, layer: deeplift_shap(f, p, x, b[:3], target=0),
    "layer_deeplift": lambda f, p, x, b, layer: layer_deeplift(f, p, x, b, target=0, layers=[layer]),
}


@pytest.mark.parametrize("model", ["chain", "residual"])
@pytest.mark.parametrize("call", list(CALLS))
def test_maps_of_inputs_that_require_grad_have_no_graph(model: str, call: str) -> None:
    net, layer = _models()[model]
    f, p = tdhook_fn.pure(net)
    x = torch.randn(5, 3, dtype=D, requires_grad=True)
    b = torch.randn(5, 3, dtype=D)
    maps = CALLS[call](f, p, x, b, layer)
    assert not maps.requires_grad and maps.grad_fn is None
    with pytest.raises(RuntimeError, match="does not require grad"):
        torch.autograd.grad(maps.sum(), x)
    # the same numbers as with inputs that do not require grad
    torch.testing.assert_close(maps, CALLS[call](f, p, x.detach(), b, layer), rtol=0, atol=0)


@pytest.mark.parametrize("model", ["chain", "residual"])
def test_the_refusals_name_the_deeplift_method(model: str) -> None:
    net, layer = _models()[model]
    f, p = tdhook_fn.pure(net)
    x, b = torch.randn(5, 3, dtype=D), torch.randn(5, 3, dtype=D)
    live = TensorDict.from_module(net)
    with pytest.raises(NotImplementedError, match=r"^deeplift: params require grad"):
        deeplift(f, live, x, b, target=0)
    with pytest.raises(NotImplementedError, match=r"^layer_deeplift: params require grad"):
        layer_deeplift(f, live, x, b, target=0, layers=[layer])
    with pytest.raises(NotImplementedError, match=r"^deeplift: its maps cannot be differentiated"):
        torch.func.grad(lambda q: deeplift(f, q, x, b, target=0).square().sum())(p)
    with pytest.raises(NotImplementedError, match=r"^layer_deeplift: its maps cannot be differentiated"):
        torch.func.grad(lambda q: layer_deeplift(f, q, x, b, target=0, layers=[layer]).square().sum())(p)
    with pytest.raises(NotImplementedError, match=r"^deeplift_shap: params require grad"):
        deeplift_shap(f, live, x, b[:3], target=0)
    with pytest.raises(NotImplementedError, match=r"^deeplift_shap: its maps cannot be differentiated"):
        torch.func.grad(lambda q: deeplift_shap(f, q, x, b[:3], target=0).square().sum())(p)


def test_deeplift_shap_names_itself_for_a_batch_norm_in_training_mode() -> None:
    """It ran `deeplift` on the pairs, whose refusals said ``deeplift:``."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2)).to(D).train()
    f, p = tdhook_fn.pure(net)
    with pytest.raises(ValueError, match=r"^deeplift_shap: modules \['1'\] are batch norms"):
        deeplift_shap(f, p, torch.randn(5, 3, dtype=D), torch.randn(3, 3, dtype=D), target=0)
