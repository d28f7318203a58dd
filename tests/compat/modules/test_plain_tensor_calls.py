"""A plain hooked module takes a tensor as tdhook's does (tensordict dispatch); attribution contexts refuse it."""

import pytest
import tdhook.modules
import torch
from tensordict import TensorDict
from torch import nn

from tdhook_fn.compat.attribution import Saliency
from tdhook_fn.compat.modules import HookedModule


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


@pytest.mark.parametrize("cls", [HookedModule, tdhook.modules.HookedModule], ids=["compat", "tdhook"])
def test_plain_hooked_module_on_a_tensor_runs_its_hooks(cls):
    net = _net()
    hooked = cls.from_module(net, in_keys=["input"], out_keys=["output"])
    x = torch.randn(5, 3)
    cache = TensorDict()
    _, proxy = hooked.get(cache, "module[0]")
    out = hooked(x)
    torch.testing.assert_close(out, net(x))
    torch.testing.assert_close(proxy.resolve(), net[0](x))


def test_attribution_context_refuses_a_tensor():
    targets = lambda td, _: TensorDict(o=td["output"][..., 0], batch_size=td.batch_size)
    with Saliency(init_attr_targets=targets).prepare(_net()) as hooked, pytest.raises(
            TypeError, match=r"Saliency: call the hooked module on a TensorDict.*got Tensor"):
        hooked(torch.randn(5, 3))
