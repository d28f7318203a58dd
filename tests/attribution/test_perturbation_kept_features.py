"""The default features kept between calls (NOTE [feature masks]): keyed by keys, sample shapes and devices."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import feature_ablation, feature_permutation, shapley_value_sampling
from tdhook_fn.attribution._feature_masks import _kept_default


def _net(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(width, 3)).eval()


def _calls() -> dict[str, torch.Tensor]:
    f, p = tdhook_fn.pure(_net(12))
    f_small, p_small = tdhook_fn.pure(_net(6))
    x = torch.randn(4, 3, 4, generator=torch.Generator().manual_seed(1))
    small = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(3)
    shapley = shapley_value_sampling(f_small, p_small, small, target=1, n_samples=3)
    torch.manual_seed(4)
    return {
        "ablation": feature_ablation(f, p, x, target=1),
        "ablation, other shape": feature_ablation(f_small, p_small, small, target=1),
        "ablation float64": feature_ablation(f, p.double(), x.double(), target=1),
        "ablation per target": feature_ablation(f, p, x, target=(0, 2), per_target=True),
        "shapley": shapley,
        "permutation": feature_permutation(f, p, x, target=1),
    }


def test_kept_features_give_the_numbers_of_fresh_ones() -> None:
    _kept_default.cache_clear()
    fresh = _calls()  # each call builds its features
    kept = _calls()  # each call reads them back
    assert _kept_default.cache_info().hits > 0
    for name, value in fresh.items():
        assert torch.equal(kept[name], value), name


def test_kept_features_spread_each_key_on_its_own_elements() -> None:
    """Two keys: the second key's features come after the first's (slices, not a gather, spread them)."""
    _kept_default.cache_clear()
    lin = nn.Linear(5, 2)
    f, p = tdhook_fn.pure(lin)
    x = torch.randn(3, 5)
    plain = feature_ablation(f, p, x, target=0)
    with torch.no_grad():
        columns = [lin(x) - lin(torch.where(torch.arange(5) == i, 0.0, x)) for i in range(5)]
    expected = torch.stack([c[:, 0] for c in columns], -1)
    torch.testing.assert_close(plain, expected)
    class Two(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return lin(torch.cat([a, b], -1))
    f2, p2 = tdhook_fn.pure(Two(), in_keys=["a", "b"])
    td = TensorDict(a=x[:, :2], b=x[:, 2:], batch_size=[3])
    for _ in range(2):  # built, then kept
        both = feature_ablation(f2, p2, td, target=0)
        torch.testing.assert_close(torch.cat([both["a"], both["b"]], -1), expected)


def test_features_under_vmap_are_not_kept() -> None:
    _kept_default.cache_clear()
    f, p = tdhook_fn.pure(nn.Linear(12, 3))
    x = TensorDict(input=torch.randn(3, 12), batch_size=[3])
    per_sample = torch.vmap(lambda one: feature_ablation(f, p, one, target=1))(x)
    assert _kept_default.cache_info().currsize == 0
    torch.testing.assert_close(per_sample["input"], feature_ablation(f, p, x, target=1)["input"])
