"""tdhook_fn.compat.metrics side by side with tdhook 0.1.3's metrics, from the same random state.

Both draw their perturbations from torch's global generator in the same order, so with
the same seed they score the same perturbations; the scores agree to rounding (ours sum
where tdhook averages, and run the perturbations as one batch).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import tdhook.attribution
import tdhook.metrics
import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn.compat.attribution
import tdhook_fn.compat.metrics

SEED = 11


def model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5)).to(dtype).eval()


def scores(lib: Any, metrics: Any, metric: Any, net: nn.Module, data: TensorDict, **saliency: Any) -> TensorDict:
    with lib.Saliency(clean_intermediate_keys=False, **saliency).prepare(net) as hooked:
        hooked(data)
        torch.manual_seed(SEED)
        return metric(hooked, data)


def both(name: str, batch: list[int], dtype: torch.dtype = torch.float32, **kwargs: Any) -> tuple[Any, Any]:
    net = model(dtype)
    torch.manual_seed(1)
    x = torch.randn(*batch, 10, dtype=dtype)
    theirs = scores(tdhook.attribution, tdhook.metrics, getattr(tdhook.metrics, name)(**kwargs), copy.deepcopy(net),
                    TensorDict(input=x.clone(), batch_size=batch))
    ours = scores(tdhook_fn.compat.attribution, tdhook_fn.compat.metrics,
                  getattr(tdhook_fn.compat.metrics, name)(**kwargs), net, TensorDict(input=x.clone(), batch_size=batch))
    return ours, theirs


@pytest.mark.parametrize("batch", [[4], [2, 3]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_infidelity_equals_tdhook(batch: list[int], dtype: torch.dtype) -> None:
    ours, theirs = both("InfidelityMetric", batch, dtype, n_perturb_samples=5)
    assert ours["input"].shape == tuple(batch) and ours["input"].dtype == dtype
    torch.testing.assert_close(ours["input"], theirs["input"], rtol=1e-4 if dtype == torch.float32 else 1e-10,
                               atol=1e-9 if dtype == torch.float32 else 1e-18)


@pytest.mark.parametrize("batch", [[4], [2, 3]])
@pytest.mark.parametrize("radius", [0.01, 0.5])
def test_sensitivity_equals_tdhook(batch: list[int], radius: float) -> None:
    ours, theirs = both("SensitivityMetric", batch, perturb_radius=radius)
    assert ours["input"].shape == tuple(batch)
    torch.testing.assert_close(ours["input"], theirs["input"], rtol=1e-5, atol=1e-7)


def test_the_data_are_left_alone() -> None:
    net = model()
    data = TensorDict(input=torch.randn(3, 10), batch_size=[3])
    with tdhook_fn.compat.attribution.Saliency().prepare(net) as hooked:
        hooked(data)
        before = data.clone()
        tdhook_fn.compat.metrics.InfidelityMetric(3)(hooked, data)
        tdhook_fn.compat.metrics.SensitivityMetric()(hooked, data)
    assert set(data.keys(True, True)) == set(before.keys(True, True))
    assert (data == before).all()


def test_a_module_outside_a_context_or_data_without_attributions_raise() -> None:
    net = model()
    data = TensorDict(input=torch.randn(3, 10), batch_size=[3])
    with pytest.raises(TypeError, match="InfidelityMetric: module must be the hooked module"):
        tdhook_fn.compat.metrics.InfidelityMetric()(net, data)
    with tdhook_fn.compat.attribution.Saliency().prepare(net) as hooked:
        with pytest.raises(KeyError, match="SensitivityMetric: the data hold no attributions of input 'input'"):
            tdhook_fn.compat.metrics.SensitivityMetric()(hooked, data)
