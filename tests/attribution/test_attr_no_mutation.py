"""No method touches the model, the params or the inputs: bitwise, hooks and attributes included."""

import attr_zoo
import pytest
import torch
from attr_zoo import NAMES, build
from tensordict import TensorDict
from torch import nn
from torch.func import grad, vmap
from zoo import same, snapshot

import tdhook_fn
from tdhook_fn.attribution import DimsConfig, grad_cam, guided_backprop, integrated_gradients, saliency

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")


@pytest.fixture(autouse=True)
def _one_thread():
    yield from attr_zoo.one_thread()


def _calls(e, td, base):
    f = e.f
    layer = next(iter(e.layers))
    cam_layers = {p: DimsConfig(tuple(range(1, len(e.shapes[0]))), (0,)) for p in e.conv_layers} or {
        layer: DimsConfig(None, None)
    }
    halve = {layer: lambda g: 0.5 * g}
    layer_sum = lambda o: TensorDict(h=o[layer].flatten(len(o.batch_size)).sum(-1), batch_size=o.batch_size)
    return {
        "saliency": lambda p: saliency(f, p, td, target=1, abs=True),
        "input_x_gradient": lambda p: saliency(f, p, td, target=(0, 1), multiply_by_inputs=True, per_target=True),
        "layer_saliency": lambda p: saliency(f, p, td, target=1, layers=[layer], multiply_by_inputs=True),
        "target_layers": lambda p: saliency(f, p, td, target=layer_sum, target_layers=[layer]),
        "grad_fns": lambda p: saliency(f, p, td, target=0, grad_fns=halve, taps=[tdhook_fn.map_grad(layer, abs)]),
        "ig": lambda p: integrated_gradients(f, p, td, base, target=2, n_steps=4, return_convergence_delta=True),
        "ig_chunked_per_target": lambda p: integrated_gradients(
            f, p, td, base, target=(0, 2), n_steps=5, chunk_size=2, per_target=True
        ),
        "layer_ig": lambda p: integrated_gradients(f, p, td, base, target=1, n_steps=4, layers=[layer]),
        "layer_ig_inputs": lambda p: integrated_gradients(
            f, p, td, base, target=1, n_steps=4, layers=[layer], interpolate="inputs", multiply_by_inputs=False
        ),
        "grad_cam": lambda p: grad_cam(f, p, td, target=1, layers=cam_layers, absolute=True),
        "guided_backprop": lambda p: guided_backprop(f, p, td, target=1),
        "guided_backprop_relu_only": lambda p: guided_backprop(
            f, p, td, target=(1, 2), per_target=True, classes_to_skip=e.non_relu_classes()
        ),
    }


# the calls whose backward replaces modules' derivatives (NOTE [replaced derivatives are not differentiated])
_REPLACED_DERIVATIVES = {"grad_fns", "guided_backprop", "guided_backprop_relu_only"}


def _first_leaf(result):
    result = result[0] if isinstance(result, tuple) else result
    return next(iter(result.values(True, True)))


@pytest.mark.parametrize("name", NAMES)
def test_every_method_leaves_model_params_and_inputs_untouched(name):
    e = build(name)
    td, base = e.inputs((2, 3)), e.baselines((2, 3))
    params = e.params
    saved = [td.clone(), base.clone(), params.clone()]
    before = snapshot(e.model)
    for method, call in _calls(e, td, base).items():
        assert torch.isfinite(_first_leaf(call(params))).all(), method
        assert same(before, snapshot(e.model)), method
    for now, then in zip([td, base, params], saved, strict=True):
        assert (now == then).all()
        assert not any(t.requires_grad for t in now.values(True, True))


@pytest.mark.parametrize("name", ["mlp", "cnn", "two_input"])  # CPU attention has no double backward
def test_methods_under_vmap_and_grad_leave_the_model_untouched(name):
    e = build(name)
    td, base = e.inputs((3,)), e.baselines((3,))
    before = snapshot(e.model)
    for method, call in _calls(e, td, base).items():
        vmap(lambda p, call=call: _first_leaf(call(p)))(torch.stack([e.params, e.params]))
        if method in _REPLACED_DERIVATIVES:  # (maps of values: an outer grad raises, the model kept all the same)
            with pytest.raises(NotImplementedError, match="cannot be differentiated"):
                grad(lambda p, call=call: _first_leaf(call(p)).square().sum())(e.params)
        else:
            grad(lambda p, call=call: _first_leaf(call(p)).square().sum())(e.params)
        assert same(before, snapshot(e.model)), method


def test_a_model_in_training_mode_keeps_its_batchnorm_statistics():
    """BatchNorm in training mode normalises with the attribution's own batch: every method
    refuses, naming the module and saying to call eval(); the model and params keep their state."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 5 * 5, 4)
    )
    model.train()
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    td = TensorDict(input=torch.randn(4, 1, 5, 5), batch_size=[4])
    before = snapshot(model)
    for call in (
        lambda: saliency(f, p, td, target=1, layers=["[1]"]),
        lambda: integrated_gradients(f, p, td, 0.0, target=1, n_steps=3, layers=["[1]"]),
        lambda: grad_cam(f, p, td, target=1, layers={"[0]": DimsConfig((1, 2), (0,))}),
        lambda: guided_backprop(f, p, td, target=1),
    ):
        with pytest.raises(ValueError, match=r"\['1'\].*model\.eval\(\)"):
            call()
        assert model.training
        assert same(before, snapshot(model))
        assert model[1].num_batches_tracked.item() == 0
