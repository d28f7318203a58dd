"""After ``del model`` nothing of tdhook_fn keeps a model alive, whatever it refers to."""

import functools
import gc
import weakref

import pytest
import torch
from accelerate.hooks import ModelHook, add_hook_to_module
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import integrated_gradients, saliency


class SelfHooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_forward_hook(self.hook)

    def hook(self, module, args, output):
        return output

    def forward(self, x):
        return self.lin(x)


class Child(nn.Module):
    def __init__(self, parent):
        super().__init__()
        object.__setattr__(self, "parent", parent)
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x)


class BackRef(nn.Module):
    def __init__(self):
        super().__init__()
        self.child = Child(self)

    def forward(self, x):
        return self.child(x)


def _accelerate():
    net = nn.Sequential(nn.Linear(3, 2))
    add_hook_to_module(net[0], ModelHook())
    return net


def _partial_forward():
    net = nn.Sequential(nn.Linear(3, 2))
    net.forward = functools.partial(nn.Sequential.forward, net)
    return net


MODELS = {
    "plain": lambda: nn.Sequential(nn.Linear(3, 2)),
    "self-hooked": SelfHooked,
    "back-reference": BackRef,
    "accelerate": _accelerate,
    "partial-forward": _partial_forward,
}


def _use(model):
    p = tdhook_fn.params(model)
    tdhook_fn.call(model, p, torch.ones(1, 3))
    f = tdhook_fn.functional(model)
    td = TensorDict(input=torch.ones(2, 3), batch_size=[2])
    saliency(f, p, td, target=0)
    integrated_gradients(f, p, td, 0.0, target=0, n_steps=4)
    torch.func.vmap(tdhook_fn.call, (None, 0, None))(model, torch.stack([p, p]), torch.ones(3))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_is_freed(name):
    model = MODELS[name]()
    _use(model)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_freed_after_error():
    model = SelfHooked()
    with pytest.raises(ValueError):
        tdhook_fn.call(model, TensorDict({}, []), torch.ones(1, 3))
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_a_shadow_whose_refresh_raises_is_cleared_and_pooled_again():
    from tdhook_fn._functional import _pools

    net = nn.Sequential(nn.Linear(3, 2))
    p, x = tdhook_fn.params(net), torch.randn(4, 3)
    tdhook_fn.call(net, p, x)
    (shadow,) = _pools[False][net]
    net[0].gradient_checkpointing = True  # refused in training mode, while the shadow is refreshed
    with pytest.raises(RuntimeError, match="activation checkpointing"):
        tdhook_fn.call(net, p, x)
    assert _pools[False][net] == [shadow]  # given back, not lost nor doubled
    assert all(slots[name] is None for slots, name, _, _ in shadow.param_slots)  # and unloaded
    net[0].gradient_checkpointing = False
    torch.testing.assert_close(tdhook_fn.call(net, p, x), net(x))
