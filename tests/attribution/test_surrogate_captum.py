"""lime and kernel_shap against captum 0.9's Lime and KernelShap, given the same interpretable samples.

captum explains one input sample at a time; the tests hand it, sample by sample, the
interpretable samples ours used (a generator ``perturb_func``, which captum's LimeBase
accepts), or seed torch's global generator alike where the draws coincide (LIME, one
sample). captum fits its surrogate in float32 (it casts to ``.float()``) and its default
lasso stops at scikit-learn's ``tol=1e-4``: the comparisons use captum's lasso with a
tight ``tol`` and a float32-sized tolerance.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from captum._utils.models.linear_model import SkLearnLasso, SkLearnLinearRegression, SkLearnRidge
from captum.attr import KernelShap, Lime
from captum.attr._core.lime import get_exp_kernel_similarity_function
from tensordict import TensorDict
from torch import nn
from zoo import TwoInput, tiny_gpt2

import tdhook_fn
from tdhook_fn.attribution._kernel_shap import kernel_shap, shapley_kernel_samples
from tdhook_fn.attribution._lime import lime

TIGHT_LASSO = {"alpha": 0.01, "tol": 1e-9, "max_iter": 5_000}


def close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to captum's float32 fit."""
    scale = float(ref.abs().max()) + 1e-3
    torch.testing.assert_close(ours.to(ref.dtype), ref, rtol=1e-4, atol=2e-5 * scale)


class TokenTransformer(nn.Module):
    """Token ids -> embedding -> one encoder layer (batch first) -> mean -> 3 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.encoder = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)).mean(1))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).double().eval()


def cnn() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64, 10))
    return net.double().eval()


def digits(n: int) -> torch.Tensor:
    from sklearn.datasets import load_digits

    return torch.as_tensor(load_digits().data[:n] / 16.0).reshape(n, 1, 8, 8)


def patches() -> torch.Tensor:
    """16 features: the 2x2 patches of an 8x8 image, captum's ``[1, 1, 8, 8]`` mask layout."""
    rows = torch.arange(8) // 2
    return (rows[:, None] * 4 + rows[None, :]).reshape(1, 1, 8, 8)


def captum_per_sample(explainer: Any, inputs: tuple[torch.Tensor, ...], samples: torch.Tensor,
                      **kwargs: Any) -> tuple[torch.Tensor, ...]:
    """captum's maps of each input sample in turn, its perturb_func yielding that sample's rows of ``samples``."""
    outs: list[tuple[torch.Tensor, ...]] = []
    for b in range(samples.shape[0]):
        rows = samples[b].long()

        def given(_inputs: Any, **_: Any) -> Iterator[torch.Tensor]:
            for row in rows:
                yield row.unsqueeze(0)

        explainer.perturb_func = given
        one = {k: (v[b:b + 1] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == samples.shape[0] else v)
               for k, v in kwargs.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = explainer.attribute(tuple(x[b:b + 1] for x in inputs), n_samples=rows.shape[0], **one)
        outs.append(got)
    return tuple(torch.cat([o[i] for o in outs]) for i in range(len(inputs)))


def test_lime_seeded_like_captum_on_one_sample() -> None:
    net = mlp()
    f, p = tdhook_fn.pure(net)
    x = torch.randn(1, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = Lime(net, interpretable_model=SkLearnLasso(**TIGHT_LASSO)).attribute(x, target=1, n_samples=60)
    torch.manual_seed(5)
    close(lime(f, p, x, target=1, n_samples=60), ref)


def test_lime_default_lasso_is_captums_up_to_its_tolerance() -> None:
    net = mlp()
    f, p = tdhook_fn.pure(net)
    x = torch.randn(1, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = Lime(net).attribute(x, target=0, n_samples=80)
    torch.manual_seed(3)
    torch.testing.assert_close(lime(f, p, x, target=0, n_samples=80).float(), ref, rtol=0, atol=2e-3)


@pytest.mark.parametrize("model", ["linear", "ridge", "lasso"])
def test_lime_mlp_batch_models(model: str) -> None:
    net = mlp()
    f, p = tdhook_fn.pure(net)
    x = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    samples = torch.bernoulli(torch.full((3, 40, 6), 0.5), generator=torch.Generator().manual_seed(4))
    surrogate = {"linear": SkLearnLinearRegression(), "ridge": SkLearnRidge(alpha=1.0),
                 "lasso": SkLearnLasso(**TIGHT_LASSO)}[model]
    target = torch.tensor([0, 2, 1])
    (ref,) = captum_per_sample(Lime(net, interpretable_model=surrogate), (x,), samples, target=target)
    close(lime(f, p, x, target=target, samples=samples, interpretable_model=model), ref)


def test_lime_euclidean_kernel_and_baselines() -> None:
    net = mlp()
    f, p = tdhook_fn.pure(net)
    x = torch.randn(2, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    base = torch.full((1, 6), 0.25, dtype=torch.float64)
    samples = torch.bernoulli(torch.full((2, 30, 6), 0.5), generator=torch.Generator().manual_seed(6))
    explainer = Lime(net, interpretable_model=SkLearnLinearRegression(),
                     similarity_func=get_exp_kernel_similarity_function("euclidean", 0.75))
    (ref,) = captum_per_sample(explainer, (x,), samples, target=2, baselines=base)
    ours = lime(f, p, x, base, target=2, samples=samples, interpretable_model="linear", distance_mode="euclidean",
                kernel_width=0.75)
    close(ours, ref)


def test_lime_cnn_digits_patches() -> None:
    net = cnn()
    f, p = tdhook_fn.pure(net)
    x = digits(3)
    samples = torch.bernoulli(torch.full((3, 50, 16), 0.5), generator=torch.Generator().manual_seed(7))
    target = net(x).argmax(-1)
    (ref,) = captum_per_sample(Lime(net, interpretable_model=SkLearnLasso(**TIGHT_LASSO)), (x,), samples,
                               target=target, feature_mask=patches())
    close(lime(f, p, x, target=target, samples=samples, feature_mask=patches()), ref)


def test_kernel_shap_two_inputs_with_a_mask_across_keys() -> None:
    torch.manual_seed(0)
    net = TwoInput(3).double().eval()
    f = tdhook_fn.functional(net, ["x", "y"], ["output"])
    p = tdhook_fn.params(net)
    g = torch.Generator().manual_seed(8)
    x, y = torch.randn(2, 4, dtype=torch.float64, generator=g), torch.randn(2, 3, dtype=torch.float64, generator=g)
    masks = (torch.tensor([[0, 0, 1, 2]]), torch.tensor([[3, 3, 4]]))
    samples = shapley_kernel_samples(5, 30, (2,), generator=g)
    ref = captum_per_sample(KernelShap(net), (x, y), samples, target=1, feature_mask=masks)
    td = TensorDict(x=x, y=y, batch_size=[2])
    ours = kernel_shap(f, p, td, target=1, samples=samples, feature_mask={"x": masks[0][0], "y": masks[1][0]})
    close(ours["x"], ref[0])
    close(ours["y"], ref[1])


def test_kernel_shap_cnn_digits() -> None:
    net = cnn()
    f, p = tdhook_fn.pure(net)
    x = digits(2)
    samples = shapley_kernel_samples(16, 60, (2,), generator=torch.Generator().manual_seed(9))
    (ref,) = captum_per_sample(KernelShap(net), (x,), samples, target=3, feature_mask=patches(), baselines=0.1)
    close(kernel_shap(f, p, x, 0.1, target=3, samples=samples, feature_mask=patches()), ref)


def test_transformer_on_token_ids_with_a_pad_baseline() -> None:
    torch.manual_seed(0)
    net = TokenTransformer().double().eval()
    f, p = tdhook_fn.pure(net)
    ids = torch.randint(1, 20, (2, 5), generator=torch.Generator().manual_seed(10))
    shap_samples = shapley_kernel_samples(5, 24, (2,), generator=torch.Generator().manual_seed(11))
    (ref,) = captum_per_sample(KernelShap(net), (ids,), shap_samples, target=0)
    close(kernel_shap(f, p, ids, 0, target=0, samples=shap_samples), ref)
    lime_samples = torch.bernoulli(torch.full((2, 24, 5), 0.5), generator=torch.Generator().manual_seed(12))
    (ref,) = captum_per_sample(Lime(net, interpretable_model=SkLearnLasso(**TIGHT_LASSO)), (ids,), lime_samples,
                               target=2)
    close(lime(f, p, ids, 0, target=2, samples=lime_samples), ref)


def test_gpt2_token_positions_with_an_attention_mask_passed_unchanged() -> None:
    """Hugging Face GPT-2 (random init): the ids are perturbed, the attention mask is captum's extra argument."""
    transformers = pytest.importorskip("transformers")
    model = tiny_gpt2(transformers).double()
    f = tdhook_fn.functional(model, in_keys={"input_ids": "input_ids", "attention_mask": "attention_mask"},
                             out_keys=["logits"])
    ids = torch.randint(1, 40, (2, 6), generator=torch.Generator().manual_seed(13))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    last = lambda out: TensorDict(logits=out["logits"][..., -1, 3], batch_size=out.batch_size)
    samples = shapley_kernel_samples(6, 30, (2,), generator=torch.Generator().manual_seed(14))
    ours = kernel_shap(f, tdhook_fn.params(model), TensorDict(input_ids=ids, attention_mask=mask, batch_size=[2]), 0,
                       target=last, samples=samples, input_keys=["input_ids"])["input_ids"]
    forward = lambda i, m: model(input_ids=i, attention_mask=m).logits[:, -1, 3]
    explainer = KernelShap(forward)
    for b in range(2):
        rows = samples[b].long()

        def given(_inputs: Any, **_: Any) -> Iterator[torch.Tensor]:
            for row in rows:
                yield row.unsqueeze(0)

        explainer.perturb_func = given
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = explainer.attribute(ids[b:b + 1], baselines=0, additional_forward_args=(mask[b:b + 1],),
                                      n_samples=30)
        close(ours[b:b + 1], ref)
