"""The walks' max pooling (NOTE [max pooling in channels-last]) gives autograd's kernel's maxima and indices."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from zoo import pooled_layouts, pooling_planes

from tdhook_fn.attribution._lrp.max_pool import max_pool_with_indices


@pytest.mark.usefixtures("pools_of_any_size")  # (the channels-last copy, on inputs small enough to hold such cases)
@pytest.mark.parametrize("name", ["ties", "nans", "zeros", "float64"])
@pytest.mark.parametrize(("kernel", "stride", "padding", "dilation", "ceil"),
                         [(2, 2, 0, 1, False), (3, 2, 1, 1, False), (3, 1, 1, 1, True), (2, 2, 0, 2, True)])
def test_the_same_maxima_and_indices_as_the_plain_kernel(name: str, kernel: int, stride: int, padding: int,
                                                         dilation: int, ceil: bool) -> None:
    x = pooling_planes()[name]
    state = {"kernel_size": kernel, "stride": stride, "padding": padding, "dilation": dilation, "ceil_mode": ceil}
    out, indices = max_pool_with_indices((2, F.max_pool2d), x, state)
    want, want_indices = F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode=ceil, return_indices=True)
    assert torch.equal(indices, want_indices)
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
    assert out.is_contiguous() and indices.is_contiguous()


def test_other_pools_run_the_plain_kernel() -> None:
    x = torch.randn(2, 3, 8)
    state = {"kernel_size": 2, "stride": 2, "padding": 0, "dilation": 1, "ceil_mode": False}
    out, indices = max_pool_with_indices((1, F.max_pool1d), x, state)
    want, want_indices = F.max_pool1d(x, 2, 2, 0, 1, return_indices=True)
    assert torch.equal(out, want) and torch.equal(indices, want_indices)


def test_the_copy_runs_where_it_is_the_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """2^15 elements or more, four channels or more (NOTE [shadow max pooling])."""
    copied = pooled_layouts(monkeypatch)
    state = {"kernel_size": 2, "stride": 2, "padding": 0, "dilation": 1, "ceil_mode": False}
    for shape in [(8, 8, 16, 16), (16, 8, 16, 16), (16, 3, 32, 32)]:
        max_pool_with_indices((2, F.max_pool2d), torch.randn(shape), state)
    assert copied == [False, True, False]
