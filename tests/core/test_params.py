import pytest
import torch
from tensordict import TensorDict
from torch import nn
from zoo import same, snapshot, zoo

import tdhook_fn

MODELS = zoo()


@pytest.mark.parametrize("name", MODELS)
def test_params_mirror_named_parameters_and_buffers(name):
    model, _ = MODELS[name]
    p = tdhook_fn.params(model)
    expected = dict(model.named_parameters()) | dict(model.named_buffers())
    got = {".".join(k): v for k, v in p.items(include_nested=True, leaves_only=True)}
    assert got.keys() == expected.keys()
    for key, value in got.items():
        assert torch.equal(value, expected[key])
        assert not value.requires_grad
    assert p.batch_size == torch.Size([])


def test_params_are_nested_like_the_module_tree():
    model = MODELS["blocks"][0]
    p = tdhook_fn.params(model)
    assert isinstance(p["layers"], TensorDict)
    assert torch.equal(p["layers", "1", "weight"], model.layers[1].weight)
    assert torch.equal(p["block0/module", "0", "bias"], getattr(model, "block0/module")[0].bias)


def test_parameters_share_storage_and_buffers_are_copies():
    model = MODELS["cnn"][0]
    p = tdhook_fn.params(model)
    assert p["0", "weight"].data_ptr() == model[0].weight.data_ptr()
    assert p["1", "running_mean"].data_ptr() != model[1].running_mean.data_ptr()


def test_tied_weights_appear_once():
    model = MODELS["tied"][0]
    keys = {".".join(k) for k in tdhook_fn.params(model).keys(include_nested=True, leaves_only=True)}
    assert keys == {"enc.weight"}


def test_params_leave_the_model_alone():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    before = snapshot(model)
    tdhook_fn.params(model).apply_(lambda t: t.add_(1) if t.is_floating_point() and t.dim() == 1 else t)
    # parameters share storage by design; buffers are copies
    assert torch.equal(before["tensors"]["1.running_mean"][1], model[1].running_mean)
    assert not same(before, snapshot(model))  # the 1-d bias params did change in place



def test_leaf_values_are_the_leaves_in_order_without_keys():
    from tdhook_fn._params import leaf_values, leaves

    net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Sequential(nn.Linear(3, 1)))
    td = tdhook_fn.params(net)
    for case in (td, td.exclude(("1", "running_mean")), td.clone().lock_()):
        expected = list(leaves(case).values())
        got = leaf_values(case)
        assert len(got) == len(expected) == len(list(case.keys(True, True)))
        assert all(g is e for g, e in zip(got, expected, strict=True))
    lazy = torch.stack([td, td], 0)  # a lazy stack, not a plain TensorDict: read through items()
    assert [v.shape for v in leaf_values(lazy)] == [v.shape for v in leaves(lazy).values()]
