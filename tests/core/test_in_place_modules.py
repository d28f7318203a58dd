"""Models that write activations in place (``ReLU(inplace=True)``, ``out += identity``), as torchvision's do.

A tap that kept a reference to an activation, or a rule that read a module's input after
the module wrote it, gave the written values silently; each test compares a model with
in-place writes to the same model without them.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import (
    DimsConfig,
    Epsilon,
    EpsilonPlus,
    Pass,
    WSquare,
    grad_cam,
    guided_backprop,
    lrp,
    saliency,
)
from tdhook_fn.latent import Site, cache, patching_sweep


class _Block(nn.Module):
    """conv -> ReLU -> conv, plus the input: ``out += x`` in place when ``inplace``, as a ResNet block."""

    def __init__(self, inplace: bool):
        super().__init__()
        self.inplace = inplace
        self.conv1, self.relu, self.conv2 = nn.Conv2d(2, 2, 3, padding=1), nn.ReLU(inplace=inplace), nn.Conv2d(
            2, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv2(self.relu(self.conv1(x)))
        if self.inplace:
            out += x
            return out
        return out + x


def _pair() -> tuple[nn.Module, nn.Module]:
    def build(inplace: bool) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(inplace=inplace), _Block(inplace),
                             nn.ReLU(inplace=inplace), nn.Flatten(), nn.Linear(2 * 5 * 5, 3)).eval()

    return build(False), build(True)


def _x() -> TensorDict:
    return TensorDict(input=torch.randn(4, 1, 5, 5, generator=torch.Generator().manual_seed(1)), batch_size=[4])


def _both(method):  # type: ignore[no-untyped-def]
    plain, written = _pair()
    return [method(tdhook_fn.functional(m), tdhook_fn.params(m), m) for m in (plain, written)]


@pytest.mark.parametrize("path", ["[0]", "[2].conv2", "[2]", "[2].relu"])
def test_cached_and_captured_activations_are_the_values_before_the_write(path: str) -> None:
    for site in ("output", "input"):
        a, b = _both(lambda f, p, m: cache(f, p, _x(), Site(path, site=site))[Site(path, site=site).key])
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        a, b = _both(lambda f, p, m: tdhook_fn.call_with_taps(m, p, [tdhook_fn.capture(path, site=site)],
                                                              _x()["input"])[1])
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_layer_maps_and_grad_cam_read_the_activation_before_the_write() -> None:
    for layer in ("[0]", "[2].conv2", "[2]"):
        a, b = _both(lambda f, p, m: saliency(f, p, _x(), target=1, layers=[layer], multiply_by_inputs=True))
        torch.testing.assert_close(a, b)
        a, b = _both(lambda f, p, m: grad_cam(f, p, _x(), target=1, layers={layer: DimsConfig((1, 2), (0,))}))
        torch.testing.assert_close(a, b)


def test_guided_backprop_and_map_grad_before_an_in_place_module() -> None:
    a, b = _both(lambda f, p, m: guided_backprop(f, p, _x(), target=1, classes_to_skip=(nn.Conv2d, nn.Linear)))
    torch.testing.assert_close(a, b)
    a, b = _both(lambda f, p, m: saliency(f, p, _x(), target=1, taps=[tdhook_fn.map_grad("[0]", torch.relu)]))
    torch.testing.assert_close(a, b)


def test_lrp_pass_on_an_in_place_relu_passes_relevance_unchanged() -> None:
    """Pass followed by a rule whose relevance does not vanish at zero inputs (w²) tells the two apart."""
    rules = {"[0]": Epsilon(), "[1]": Pass(), "[3]": Pass(), "[5]": WSquare()}
    a, b = _both(lambda f, p, m: lrp(f, p, _x(), target=1, rules=rules, warn_on_missing_rule=False))
    torch.testing.assert_close(a, b)


def test_lrp_on_a_block_whose_ruled_output_is_written_in_place() -> None:
    """z+ on the block's last conv, whose output ``out += x`` writes (autograd refused it on a view)."""
    a, b = _both(lambda f, p, m: lrp(f, p, _x(), target=1, rules=EpsilonPlus(), warn_on_missing_rule=False))
    torch.testing.assert_close(a, b)


def test_a_sweep_on_a_model_with_in_place_writes_equals_the_plain_one() -> None:
    clean, corrupt = _x(), _x().apply(lambda t: t.flip(0))
    grid = [Site("[2].conv1", index=(c,)) for c in range(2)] + [Site("[1]", index=(0, i)) for i in range(5)]
    metric = lambda out: out["output"][..., 1]
    for batching in ("vmap", "fold"):
        a, b = _both(lambda f, p, m: patching_sweep(f, p, clean, corrupt, grid, metric, batching=batching))
        torch.testing.assert_close(a, b)


class _SharedReluBlock(nn.Module):
    """torchvision's BasicBlock pattern: one ReLU module run twice, the second time after ``out += x``."""

    def __init__(self, inplace: bool):
        super().__init__()
        self.inplace = inplace
        self.conv1, self.conv2 = nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 3, padding=1)
        self.relu = nn.ReLU(inplace=inplace)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv2(self.relu(self.conv1(x)))
        if self.inplace:
            out += x
        else:
            out = out + x
        return self.relu(out)


def test_a_shared_in_place_relu_run_twice() -> None:
    def build(inplace: bool) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), _SharedReluBlock(inplace), nn.Flatten(),
                             nn.Linear(50, 3)).eval()

    methods = [
        lambda f, p: lrp(f, p, _x(), target=1, rules=EpsilonPlus(), warn_on_missing_rule=False),
        lambda f, p: lrp(f, p, _x(), target=1, rules={nn.Conv2d: Epsilon(), nn.ReLU: Pass(), nn.Linear: WSquare()},
                         warn_on_missing_rule=False),
        lambda f, p: guided_backprop(f, p, _x(), target=1, classes_to_skip=(nn.Conv2d, nn.Linear, _SharedReluBlock)),
        lambda f, p: saliency(f, p, _x(), target=1, layers=["[1].conv2"], layer_calls=None),
    ]
    for method in methods:
        a, b = (method(tdhook_fn.functional(m), tdhook_fn.params(m)) for m in (build(False), build(True)))
        torch.testing.assert_close(a, b)
