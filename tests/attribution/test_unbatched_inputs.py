"""Inputs without batch dims (NOTE [unbatched inputs]): a model that does not read a leading dim as the batch raises.

The methods run a sample as a batch of one; before, a model that reads the leading dim
otherwise (attention with ``batch_first=False`` on ``[T, D]``, a reduction over dim 0)
gave silently wrong maps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _tolerance import assert_close_ulps
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import EpsilonPlus, integrated_gradients, lrp, saliency


class SumsDimZero(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).tanh().sum(0)


class _SumDimZero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(0)


METHODS: dict[str, Any] = {
    "saliency": lambda f, p, td, target: saliency(f, p, td, target=target),
    "integrated_gradients": lambda f, p, td, target: integrated_gradients(f, p, td, 0.0, target=target, n_steps=4),
    "lrp": lambda f, p, td, target: lrp(f, p, td, target=target, rules=EpsilonPlus(), warn_on_missing_rule=False),
}


@pytest.mark.parametrize("method", list(METHODS))
def test_a_forward_reducing_over_dim_zero_raises(method: str) -> None:
    torch.manual_seed(0)
    f, p = tdhook_fn.pure(SumsDimZero().double())
    td = TensorDict(input=torch.randn(3, 4, dtype=torch.float64), batch_size=[])
    with pytest.raises(ValueError, match=r"no batch dims .* does not read a leading dim as the batch"):
        METHODS[method](f, p, td, lambda out: out["output"][0])


def test_attention_given_positions_first_raises() -> None:
    """``batch_first=False`` on ``[T, D]``: as a batch of one it would attend over one position per sequence."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=False).double().eval()
    f, p = tdhook_fn.pure(layer)
    td = TensorDict(input=torch.randn(5, 8, dtype=torch.float64), batch_size=[])
    with pytest.raises(ValueError, match="another 'target'"):
        saliency(f, p, td, target=lambda out: out["output"][..., -1, 0])
    batched = TensorDict(input=td["input"][:, None], batch_size=[])  # [T, 1, D]: the batch where the model reads it
    with pytest.raises(ValueError, match="raises on it as a batch of one"):
        saliency(f, p, batched, target=lambda out: out["output"][-1].sum())


@pytest.mark.parametrize("method", list(METHODS))
def test_batch_first_models_give_the_batched_maps(method: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.Flatten(-3), nn.Linear(48, 2)).double()
    f, p = tdhook_fn.pure(model)
    x = torch.randn(1, 4, 4, dtype=torch.float64)  # a conv's unbatched [C, H, W]
    alone = METHODS[method](f, p, TensorDict(input=x, batch_size=[]), 1)["input"]
    assert_close_ulps(alone, METHODS[method](f, p, TensorDict(input=x[None], batch_size=[1]), 1)["input"][0])
    sums_rows = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.Flatten(-2), _SumDimZero()).double()
    f, p = tdhook_fn.pure(sums_rows)  # [C, H*W] summed over C; as a batch of one, over the batch
    with pytest.raises(ValueError, match="'target' of shape \\(3,\\) on it as a batch of one"):
        METHODS[method](f, p, TensorDict(input=x, batch_size=[]), lambda out: out["output"][..., 0])
    mlp = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)).double()
    f, p = tdhook_fn.pure(mlp)
    v = torch.randn(4, dtype=torch.float64)
    one = METHODS[method](f, p, TensorDict(input=v, batch_size=[]), 1)["input"]
    assert_close_ulps(one, METHODS[method](f, p, TensorDict(input=v[None], batch_size=[1]), 1)["input"][0])


def test_dropout_in_training_mode_is_no_false_alarm() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 2)).double().train()
    f, p = tdhook_fn.pure(model)
    td = TensorDict(input=torch.randn(4, dtype=torch.float64), batch_size=[])
    torch.manual_seed(1)
    first = saliency(f, p, td, target=1)["input"]
    torch.manual_seed(1)
    assert torch.equal(first, saliency(f, p, td, target=1)["input"])  # the check leaves the random state as it was


def test_a_batched_only_model_reads_the_sample_as_a_batch_of_one() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).double().eval()  # BatchNorm1d refuses a 1-d input
    f, p = tdhook_fn.pure(model)
    v = torch.randn(4, dtype=torch.float64)
    one = saliency(f, p, TensorDict(input=v, batch_size=[]), target=0)["input"]
    assert_close_ulps(one, saliency(f, p, TensorDict(input=v[None], batch_size=[1]), target=0)["input"][0])


def test_per_sample_vmap_is_not_checked() -> None:
    torch.manual_seed(0)
    f, p = tdhook_fn.pure(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double())
    x = TensorDict(input=torch.randn(6, 4, dtype=torch.float64), batch_size=[6])
    per_sample = torch.func.vmap(lambda td: saliency(f, p, td, target=1))(x)
    assert_close_ulps(per_sample, saliency(f, p, x, target=1))


class _WithExtras(nn.Module):
    """Outputs a NaN-holding log, a mean over dim 0 the target does not read, and noise of its own generator."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.linear(x)
        noise = torch.randn(y.shape, generator=self.generator, dtype=y.dtype)
        return {"y": y, "log": torch.log(y), "mean": y.mean(0), "noisy": y + noise}


@pytest.mark.parametrize("target_key", ["y", "log", "noisy"])
def test_what_the_target_does_not_read_raises_no_false_alarm(target_key: str) -> None:
    torch.manual_seed(0)
    f = tdhook_fn.functional(_WithExtras().double(), out_keys=["y", "log", "mean", "noisy"])
    p = tdhook_fn.params(f.model)
    td = TensorDict(input=torch.randn(4, dtype=torch.float64), batch_size=[])
    maps = saliency(f, p, td, target=lambda out: out[target_key][..., 0])
    assert maps["input"].shape == (4,)
