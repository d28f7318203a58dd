"""Occlusion's windows kept between calls (NOTE [kept windows]): keyed by shape, window, stride and device."""

from __future__ import annotations

import torch
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import occlusion
from tdhook_fn.attribution._occlusion import _kept_windows


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Flatten(), nn.Linear(2 * 6 * 6, 3)).eval()


def _calls() -> dict[str, torch.Tensor]:
    f, p = tdhook_fn.pure(_net())
    x = torch.randn(4, 1, 6, 6, generator=torch.Generator().manual_seed(1))
    small = torch.randn(4, 1, 5, 5, generator=torch.Generator().manual_seed(2))
    f_small, p_small = tdhook_fn.pure(nn.Sequential(nn.Flatten(), nn.Linear(25, 3)))
    return {
        "2x2": occlusion(f, p, x, target=1, sliding_window_shapes=(1, 2, 2)),
        "3x3": occlusion(f, p, x, target=1, sliding_window_shapes=(1, 3, 3)),
        "3x3 stride 2": occlusion(f, p, x, target=1, sliding_window_shapes=(1, 3, 3), strides=2),
        "2x2 on 5x5": occlusion(f_small, p_small, small, target=1, sliding_window_shapes=(1, 2, 2)),
        "2x2 float64": occlusion(f, p.double(), x.double(), target=1, sliding_window_shapes=(1, 2, 2)),
    }


def test_kept_windows_give_the_numbers_of_fresh_ones() -> None:
    _kept_windows.cache_clear()
    fresh = _calls()  # each call builds its windows
    kept = _calls()  # each call reads them back
    again = dict(reversed(list(_calls().items())))  # (the same calls: any order reads its own windows)
    assert _kept_windows.cache_info().hits > 0
    for name, value in fresh.items():
        assert torch.equal(kept[name], value), name
        assert torch.equal(again[name], value), name


def test_windows_built_in_inference_mode_are_not_kept() -> None:
    """Inference tensors cannot be saved for a backward: a later call differentiating the params must still run."""
    _kept_windows.cache_clear()
    f, p = tdhook_fn.pure(_net())
    x = torch.randn(2, 1, 6, 6)
    with torch.inference_mode():
        occlusion(f, p, x, target=0, sliding_window_shapes=(1, 2, 2))
    assert _kept_windows.cache_info().currsize == 0
    weights = p.clone().requires_grad_(True)
    attr = occlusion(f, weights, x, target=0, sliding_window_shapes=(1, 2, 2))
    (grad,) = torch.autograd.grad(attr.sum(), [weights["0", "weight"]])
    assert grad.abs().sum() > 0


def test_windows_under_vmap_are_not_kept() -> None:
    _kept_windows.cache_clear()
    f, p = tdhook_fn.pure(_net())
    x = torch.randn(3, 1, 6, 6)
    torch.vmap(lambda s: occlusion(f, p, s[None], target=2, sliding_window_shapes=(1, 2, 2))[0])(x)
    assert _kept_windows.cache_info().currsize == 0
