"""Bilinear probes: the maps of nn.Bilinear and tdhook's LowRankBilinearEstimator, trained as torch.optim.Adam."""

import math

import pytest
import torch
from tensordict import TensorDict

from tdhook_fn.latent.probing import fit_bilinear_probes, predict_bilinear_probes


def _pairs(n=60, d1=4, d2=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x1 = torch.randn(n, d1, generator=g, dtype=torch.float64)
    x2 = torch.randn(n, d2, generator=g, dtype=torch.float64)
    labels = ((x1[:, 0] * x2[:, 0] > 0).long() + (x1[:, 1] > 1).long())  # three classes, a product rule
    return x1, x2, labels


def _reference(model, x1, x2, labels, *, epochs, lr, batch_size, generator, loss=torch.nn.functional.cross_entropy):
    """torch.optim.Adam on an nn.Module, the batches in the generator's order."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(epochs):
        order = torch.randperm(x1.shape[0], generator=generator)
        for start in range(0, x1.shape[0], batch_size):
            rows = order[start:start + batch_size]
            optimizer.zero_grad()
            loss(model(x1[rows], x2[rows]), labels[rows]).backward()
            optimizer.step()
    return model


def test_full_probe_trains_as_adam_on_nn_bilinear():
    x1, x2, labels = _pairs()
    probes = fit_bilinear_probes(x1, x2, labels, epochs=3, lr=0.05, batch_size=16, seed=7)
    g = torch.Generator().manual_seed(7)  # the documented draws: weight, bias, then each epoch's order
    model = torch.nn.Bilinear(4, 3, 3, dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_((2 * torch.rand(3, 4, 3, generator=g, dtype=torch.float64) - 1) / 2)
        model.bias.copy_((2 * torch.rand(3, generator=g, dtype=torch.float64) - 1) / 2)
    _reference(model, x1, x2, labels, epochs=3, lr=0.05, batch_size=16, generator=g)
    torch.testing.assert_close(probes["weight"], model.weight.detach(), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(probes["bias"], model.bias.detach(), rtol=1e-9, atol=1e-10)
    assert (predict_bilinear_probes(probes, x1, x2) == model(x1, x2).argmax(-1)).all()


def test_rank_one_is_tdhooks_low_rank_estimator():
    estimators = pytest.importorskip("tdhook.latent.probing.estimators")
    x1, x2, labels = _pairs(seed=1)
    probes = fit_bilinear_probes(x1, x2, labels, rank=1, epochs=3, lr=0.05, batch_size=16, seed=3)
    g = torch.Generator().manual_seed(3)
    model = estimators.LowRankBilinearEstimator(4, 3, num_classes=3).double()

    def uniform(bound, *size):
        return (2 * torch.rand(size, generator=g, dtype=torch.float64) - 1) * bound

    with torch.no_grad():
        model.linear1.weight.copy_(uniform(1 / 2, 3, 1, 4)[:, 0])
        model.linear1.bias.copy_(uniform(1 / 2, 3, 1)[:, 0])
        model.linear2.weight.copy_(uniform(1 / math.sqrt(3), 3, 1, 3)[:, 0])
        model.linear2.bias.copy_(uniform(1 / math.sqrt(3), 3, 1)[:, 0])
        model.bias.zero_()
    _reference(model, x1, x2, labels, epochs=3, lr=0.05, batch_size=16, generator=g)
    torch.testing.assert_close(probes["u"][:, 0], model.linear1.weight.detach(), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(probes["v_bias"][:, 0], model.linear2.bias.detach(), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(probes["bias"], model.bias.detach(), rtol=1e-9, atol=1e-10)
    assert (predict_bilinear_probes(probes, x1, x2) == model.predict(x1, x2)).all()


def test_regression_trains_as_adam_on_mse():
    x1, x2, _ = _pairs(seed=2)
    target = (x1[:, :1] * x2[:, :1]) * 2.0
    probes = fit_bilinear_probes(x1, x2, target, rank=2, epochs=4, lr=0.02, batch_size=20, seed=5)
    assert "classes" not in probes.keys() and probes["u"].shape == (1, 2, 4)
    assert predict_bilinear_probes(probes, x1, x2).shape == (60, 1)


def test_stacked_pairs_equal_each_pair_alone():
    x1, x2, labels = _pairs(seed=4)
    acts1 = TensorDict(p=x1, q=x1 * 2, r=x1[:, :2], batch_size=[60])
    acts2 = TensorDict(p=x2, q=-x2, r=x2, batch_size=[60])
    both = fit_bilinear_probes(acts1, acts2, labels, rank=2, epochs=3, lr=0.05, batch_size=16)
    predicted = predict_bilinear_probes(both, acts1, acts2)
    for key in ("p", "q", "r"):
        alone = fit_bilinear_probes(acts1[key], acts2[key], labels, rank=2, epochs=3, lr=0.05, batch_size=16)
        for name in ("u", "u_bias", "v", "v_bias", "bias"):
            torch.testing.assert_close(both[key, name], alone[name], rtol=1e-10, atol=1e-12)
        assert (predicted[key] == predict_bilinear_probes(alone, acts1[key], acts2[key])).all()
    leading = fit_bilinear_probes(torch.stack([x1, x1 * 2]), torch.stack([x2, -x2]), labels, rank=2, epochs=3,
                                  lr=0.05, batch_size=16)
    torch.testing.assert_close(leading["u"][1], both["q", "u"], rtol=1e-10, atol=1e-12)


def test_seeded_and_inputs_untouched():
    x1, x2, labels = _pairs(seed=6)
    copies = x1.clone(), x2.clone(), labels.clone()
    a = fit_bilinear_probes(x1, x2, labels, epochs=2, seed=1)
    b = fit_bilinear_probes(x1, x2, labels, epochs=2, seed=1)
    c = fit_bilinear_probes(x1, x2, labels, epochs=2, seed=2)
    assert torch.equal(a["weight"], b["weight"]) and not torch.equal(a["weight"], c["weight"])
    assert all(torch.equal(u, v) for u, v in zip((x1, x2, labels), copies, strict=True))


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"rank": 0}, "rank must be"),
    ({"epochs": 0}, "must be positive"),
])
def test_bad_options(kwargs, words):
    x1, x2, labels = _pairs()
    with pytest.raises(ValueError, match=words):
        fit_bilinear_probes(x1, x2, labels, **kwargs)


def test_bad_pairs():
    x1, x2, labels = _pairs()
    with pytest.raises(ValueError, match="same leading dims"):
        fit_bilinear_probes(x1, x2[:10], labels)
    with pytest.raises(ValueError, match="same pair keys"):
        fit_bilinear_probes(TensorDict(a=x1), TensorDict(b=x2), labels)
    with pytest.raises(ValueError, match="N=60"):
        fit_bilinear_probes(x1, x2, labels[:5])
