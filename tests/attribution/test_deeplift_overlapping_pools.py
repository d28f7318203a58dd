"""DeepLift at max pooling whose windows overlap (``stride < kernel_size``): complete, where captum 0.9 is not.

Captum 0.9 sends a window's change back with ``max_unpool``, which writes one value per
input element: where two windows share their maximum (overlapping windows do), only one
of their changes arrives and the map loses completeness. tdhook_fn adds every window's
change (a scatter-add, the adjoint of the pooling), so a map sums to ``F(x) - F(b)``.
The non-overlapping case, where the two agree, is compared with captum in ``test_deeplift.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from captum.attr import DeepLift
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import deeplift, deeplift_shap, layer_deeplift

D = torch.float64


class _Copy(nn.Module):  # (between the ReLU and the pooling: captum's hooks need it, captum #1104)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


def _overlapping(dims: int) -> nn.Sequential:
    torch.manual_seed(3)
    conv, pool = (nn.Conv1d, nn.MaxPool1d) if dims == 1 else (nn.Conv2d, nn.MaxPool2d)
    side = 3 if dims == 2 else 7  # (the pooled size: 8 -> 3 (3x3 windows, stride 2); 16 -> 7 in 1-d)
    return nn.Sequential(conv(2, 4, 3, padding=1), nn.ReLU(), _Copy(), pool(3, stride=2), nn.Flatten(),
                         nn.Linear(4 * side**dims, 3)).to(D).eval()


def _inputs(dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(4)
    shape = (5, 2, 8, 8) if dims == 2 else (5, 2, 16)
    return torch.randn(shape, dtype=D), 0.3 * torch.randn(shape, dtype=D)


@pytest.mark.parametrize("dims", [1, 2])
def test_deeplift_is_complete_where_pooling_windows_overlap(dims: int) -> None:
    model = _overlapping(dims)
    x, b = _inputs(dims)
    f, p = tdhook_fn.pure(model)
    with torch.no_grad():
        gap = model(x)[:, 1] - model(b)[:, 1]
    ours = deeplift(f, p, x, b, target=1)
    torch.testing.assert_close(ours.flatten(1).sum(1), gap, rtol=1e-10, atol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = DeepLift(model).attribute(x.clone(), b, target=1).detach()
    # captum drops the changes of all but one window at a shared maximum: off, and incomplete
    assert (theirs.flatten(1).sum(1) - gap).abs().max() > 1e-3
    assert (ours - theirs).abs().max() > 1e-3


def test_layer_deeplift_and_deeplift_shap_are_complete_where_pooling_windows_overlap() -> None:
    model = _overlapping(2)
    x, b = _inputs(2)
    f, p = tdhook_fn.pure(model)
    layer = layer_deeplift(f, p, x, b, target=1, layers=["[0]"])
    with torch.no_grad():
        gap = model(x)[:, 1] - model(b)[:, 1]
        refs = b[:3]
        shap_gap = model(x)[:, 1] - model(refs)[:, 1].mean()
    torch.testing.assert_close(layer.flatten(1).sum(1), gap, rtol=1e-10, atol=1e-12)
    shap = deeplift_shap(f, p, x, refs, target=1)
    torch.testing.assert_close(shap.flatten(1).sum(1), shap_gap, rtol=1e-10, atol=1e-12)
