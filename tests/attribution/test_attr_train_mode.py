"""Training mode: pure calls, a clear error for batch norms in attributions, a warning for dropout."""

import copy
import warnings

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import DimsConfig, grad_cam, integrated_gradients, saliency


def _bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2)).train()


def test_call_in_training_mode_never_writes_params():
    net = _bn_net()
    p = tdhook_fn.params(net)
    before = p.clone()
    versions = {k: v._version for k, v in p.items(True, True)}
    x = torch.randn(5, 4)
    out = tdhook_fn.call(net, p, x)
    assert (p == before).all()
    assert versions == {k: v._version for k, v in p.items(True, True)}
    assert net[1].num_batches_tracked.item() == 0
    torch.testing.assert_close(out, copy.deepcopy(net)(x))  # training-mode output: batch statistics


def test_vmapped_ensemble_in_training_mode_never_writes_params():
    net = _bn_net()
    stack = torch.stack([tdhook_fn.params(net), tdhook_fn.params(net)])
    before = stack.clone()
    torch.func.vmap(tdhook_fn.call, (None, 0, None))(net, stack, torch.randn(5, 4))
    assert (stack == before).all()


@pytest.mark.parametrize("method", ["saliency", "integrated_gradients", "grad_cam"])
def test_attribution_with_training_batchnorm_raises(method):
    net = _bn_net()
    f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
    td = TensorDict(input=torch.randn(5, 4), batch_size=[5])
    call = {
        "saliency": lambda: saliency(f, p, td, target=0),
        "integrated_gradients": lambda: integrated_gradients(f, p, td, 0.0, target=0),
        "grad_cam": lambda: grad_cam(f, p, td, target=0, layers={"[0]": DimsConfig()}),
    }[method]
    with pytest.raises(ValueError, match=rf"{method}: modules \['1'\].*model\.eval\(\)"):
        call()
    net.eval()
    call()  # fine once in eval mode


def test_dropout_in_training_mode_warns_once_naming_the_module():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2)).train()
    f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
    td = TensorDict(input=torch.randn(5, 4), batch_size=[5])
    with pytest.warns(RuntimeWarning, match=r"saliency: modules \['1'\] apply dropout"):
        saliency(f, p, td, target=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        saliency(f, p, td, target=0)  # once per module
        net.eval()
        saliency(f, p, td, target=0)


def test_functional_dropout_attribute_warns():
    class Attention(nn.Module):  # as transformers' attention modules: a float rate, functional dropout
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 2)
            self.attention_dropout = 0.1

        def forward(self, x):
            return nn.functional.dropout(self.proj(x), p=self.attention_dropout, training=self.training)

    net = Attention().train()
    td = TensorDict(input=torch.randn(3, 4), batch_size=[3])
    with pytest.warns(RuntimeWarning, match=r"\['<root>'\] apply dropout"):
        saliency(tdhook_fn.functional(net), tdhook_fn.params(net), td, target=0)
