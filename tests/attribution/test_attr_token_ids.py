"""Integer inputs (token ids) cannot be differentiated or interpolated: our error, or the embedding layer."""

import pytest
import torch
from captum.attr import LayerIntegratedGradients
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import integrated_gradients, saliency


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids)).mean(-2))


@pytest.fixture
def setup():
    torch.manual_seed(0)
    model = Classifier().eval()
    ids = torch.randint(1, 10, (2, 5))
    td = TensorDict(ids=ids, batch_size=[2])
    return model, tdhook_fn.functional(model, in_keys=["ids"]), tdhook_fn.params(model), ids, td


def test_interpolating_token_ids_raises(setup):
    _, f, p, _, td = setup
    with pytest.raises(TypeError, match=r"'ids' is torch.int64 and cannot be interpolated.*interpolate='layers'"):
        integrated_gradients(f, p, td, 0.0, target=0)
    with pytest.raises(TypeError, match=r"'ids' is torch.int64 and cannot be interpolated"):
        integrated_gradients(f, p, td, 0.0, target=0, layers=["embed"], interpolate="inputs", use_inputs=False)


def test_gradients_of_token_ids_raise(setup):
    _, f, p, _, td = setup
    with pytest.raises(TypeError, match=r"saliency: input 'ids' is torch.int64.*embedding layer"):
        saliency(f, p, td, target=0)


def test_embedding_layer_ig_matches_captum(setup):
    model, f, p, ids, td = setup
    ours = integrated_gradients(f, p, td, 0, target=1, layers=["embed"], n_steps=20)["embed"]
    theirs = LayerIntegratedGradients(model, model.embed).attribute(ids, torch.zeros_like(ids), target=1, n_steps=20)
    torch.testing.assert_close(ours, theirs)


def test_embedding_layer_saliency_works(setup):
    _, f, p, _, td = setup
    out = saliency(f, p, td, target=1, layers=["embed"], use_inputs=False)
    assert out["embed"].shape == (2, 5, 4) and set(out.keys()) == {"embed"}


def test_guided_backprop_at_the_embedding_of_token_ids(setup):
    """use_inputs=False: the ids are not differentiated; pure and compat give the embedding's guided gradients."""
    from tdhook_fn.attribution import guided_backprop
    from tdhook_fn.compat.attribution import GuidedBackpropagation

    model, f, p, ids, td = setup
    pure = guided_backprop(f, p, td, target=1, layers=["embed"], use_inputs=False)
    assert set(pure.keys()) == {"embed"} and pure["embed"].shape == (2, 5, 4)
    with pytest.raises(TypeError, match=r"'ids' is torch.int64.*use_inputs=False"):
        guided_backprop(f, p, td, target=1, layers=["embed"])
    factory = GuidedBackpropagation(use_inputs=False, input_modules=["embed"],
                                    init_attr_targets=lambda out, _: TensorDict(t=out["output"][..., 1],
                                                                                batch_size=out.batch_size))
    with factory.prepare(model, in_keys=["ids"], out_keys=["output"]) as hooked:
        out = hooked(td.clone())
    assert ("attr", "ids") not in out.keys(True)
    torch.testing.assert_close(out["attr", "embed"], pure["embed"])
