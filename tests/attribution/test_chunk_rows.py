"""The perturbation methods' default chunks: sized by the model's widest activation, probed once per ``f``."""

from __future__ import annotations

import attr_zoo
import pytest
import torch
from _tolerance import assert_close_ulps
from torch import nn

import tdhook_fn
from tdhook_fn.attribution._chunk_rows import _ACTIVATION_BYTES, _INPUT_ELEMENTS
from tdhook_fn.attribution._feature_ablation import feature_ablation

F64 = torch.float64
ROWS = 31  # 30 features of 10 elements, and the unablated inputs
MASK = (torch.arange(300) // 10).reshape(1, 1, 300)


@pytest.fixture(autouse=True)
def _one_thread():
    yield from attr_zoo.one_thread()


def wide(channels: int) -> nn.Module:
    """``[1, 300] -> [channels, 300]`` (``channels * 2400`` bytes a sample in float64) -> 2 classes."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(1, channels, 1), nn.Tanh(), nn.Flatten(), nn.Linear(channels * 300, 2)).double()


class Recording:
    """A pure ``f`` that records the batch size of every call."""

    def __init__(self, f: tdhook_fn.Functional) -> None:
        self.f, self.sizes = f, []

    def __call__(self, params, td):
        self.sizes.append(td.batch_size[0])
        return self.f(params, td)


def ablate(f, p, x, chunk_size=None):
    return feature_ablation(f, p, x, target=1, feature_mask=MASK, chunk_size=chunk_size)


def test_a_narrow_model_runs_every_row_in_one_forward():
    f, p = tdhook_fn.pure(wide(2))
    recording, x = Recording(f), torch.randn(5, 1, 300, dtype=F64)
    first = ablate(recording, p, x)
    assert recording.sizes == [1, ROWS * 5]  # the probe on one sample, then every row at once
    recording.sizes.clear()
    again = ablate(recording, p, x)
    assert recording.sizes == [ROWS * 5]  # probed once per f and shape of a sample
    assert torch.equal(first, again)


def test_a_wide_model_runs_in_equal_chunks_whose_widest_activation_fits():
    channels = 64
    f, p = tdhook_fn.pure(wide(channels))
    recording, x = Recording(f), torch.randn(5, 1, 300, dtype=F64)
    ours = ablate(recording, p, x)
    sizes = recording.sizes[1:]
    assert recording.sizes[0] == 1 and sum(sizes) == ROWS * 5 and len(sizes) > 1
    assert max(sizes) * channels * 300 * 8 <= _ACTIVATION_BYTES
    assert max(sizes) - min(sizes) <= 5  # equal chunks: no chunk of a few rows left over
    assert_close_ulps(ours, ablate(f, p, x, chunk_size=ROWS), scale=10.0)


def test_a_new_shape_of_sample_is_probed_again():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv1d(1, 4, 1), nn.Tanh(), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(4, 2))
    f, p = tdhook_fn.pure(net.double())
    recording = Recording(f)
    feature_ablation(recording, p, torch.randn(4, 1, 6, dtype=F64), target=0)
    feature_ablation(recording, p, torch.randn(7, 1, 6, dtype=F64), target=0)  # same sample: no probe
    assert recording.sizes.count(1) == 1
    feature_ablation(recording, p, torch.randn(4, 1, 9, dtype=F64), target=0)
    assert recording.sizes.count(1) == 2


class Unreferenced:
    """A pure ``f`` no weak reference can point to: nowhere to keep a probe's figure."""

    __slots__ = ("f", "sizes")

    def __init__(self, f: tdhook_fn.Functional) -> None:
        self.f, self.sizes = f, []

    def __call__(self, params, td):
        self.sizes.append(td.batch_size[0])
        return self.f(params, td)


def test_without_a_probe_the_rows_are_sized_by_the_input():
    """(15 samples: 31 rows of them hold more than ``_INPUT_ELEMENTS``.)"""
    f, p = tdhook_fn.pure(wide(2))
    unreferenced, x = Unreferenced(f), torch.randn(15, 1, 300, dtype=F64)
    ours = ablate(unreferenced, p, x)
    assert 1 not in unreferenced.sizes and sum(unreferenced.sizes) == ROWS * 15 and len(unreferenced.sizes) > 1
    assert max(unreferenced.sizes) * 300 <= _INPUT_ELEMENTS
    assert_close_ulps(ours, ablate(f, p, x, chunk_size=ROWS), scale=10.0)


def test_a_probe_that_raises_leaves_the_rows_sized_by_the_input():
    f, p = tdhook_fn.pure(wide(2))
    calls = []

    def no_single_samples(params, td):
        calls.append(td.batch_size[0])
        if td.batch_size[0] == 1:
            raise RuntimeError("one sample")
        return f(params, td)

    x = torch.randn(15, 1, 300, dtype=F64)
    ours = ablate(no_single_samples, p, x)
    assert calls[0] == 1 and max(calls[1:]) * 300 <= _INPUT_ELEMENTS and sum(calls[1:]) == ROWS * 15
    assert_close_ulps(ours, ablate(f, p, x, chunk_size=ROWS), scale=10.0)


def test_under_vmap_nothing_is_probed():
    f, p = tdhook_fn.pure(wide(2))
    recording, x = Recording(f), torch.randn(3, 5, 1, 300, dtype=F64)
    ours = torch.vmap(lambda s: ablate(recording, p, s))(x)
    assert 1 not in recording.sizes
    assert_close_ulps(ours, ablate(f, p, x.reshape(15, 1, 300)).reshape(3, 5, 1, 300), scale=10.0)


class _Noisy(nn.Module):
    """Draws from torch's global generator in its forward (no module marks it stochastic)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(300, 2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.flatten(1) + 1e-3 * torch.randn_like(x.flatten(1)))


def test_the_probe_leaves_the_random_state_as_it_found_it():
    x = torch.randn(2, 1, 300, dtype=F64)
    f, p = tdhook_fn.pure(_Noisy())
    torch.manual_seed(5)
    first = ablate(f, p, x)  # (probed on this call)
    torch.manual_seed(5)
    again = ablate(f, p, x)
    assert torch.equal(first, again)
