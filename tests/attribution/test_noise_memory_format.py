"""SmoothGrad's and GradientSHAP's noisy copies keep a channels_last input's memory order, with captum's numbers.

A convolution on the CPU runs channels_last where its input or weight is; copies of a
channels_last input written in the other order would be converted back by every forward.
The noise is still drawn in captum's order (NOTE [noise draws]): seeded alike, the maps
equal captum's bitwise on a channels_last model and input.
"""

import copy

import attr_zoo
import captum.attr as ca
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution._gradient_shap import gradient_shap
from tdhook_fn.attribution._smoothgrad import smoothgrad

pytestmark = pytest.mark.filterwarnings("ignore:Input Tensor .* did not already require gradients:UserWarning")

CL, CL3D = torch.channels_last, torch.channels_last_3d


@pytest.fixture(autouse=True)
def _one_thread():
    yield from attr_zoo.one_thread()


class _Layouts(nn.Module):
    """Records in ``seen`` whether each input it is given is laid out in ``memory_format`` (and not also contiguous).

    (Through a function: the pure call runs a copy of the module, whose own list would be a copy.)
    """

    def __init__(self, memory_format: torch.memory_format, seen: list[bool]) -> None:
        super().__init__()
        self.memory_format = memory_format
        self.record = lambda flag: seen.append(flag)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, *x.shape[-4 if self.memory_format is CL3D else -3:])
        self.record(flat.is_contiguous(memory_format=self.memory_format) and not flat.is_contiguous())
        return x


def _net(memory_format: torch.memory_format, seen: list[bool] | None = None) -> nn.Module:
    """A small convolutional net, its weights in ``memory_format``; with ``seen``, a `_Layouts` before it."""
    torch.manual_seed(0)
    three_d = memory_format is CL3D
    conv, pool = (nn.Conv3d, nn.MaxPool3d) if three_d else (nn.Conv2d, nn.MaxPool2d)
    body = [conv(3, 4, 3, padding=1), nn.ReLU(), pool(2), nn.Flatten(), nn.Linear(4 * 3 ** (3 if three_d else 2), 5)]
    net = nn.Sequential(*([] if seen is None else [_Layouts(memory_format, seen)]), *body).eval()
    return net if memory_format is torch.contiguous_format else net.to(memory_format=memory_format)


def _images(batch: tuple[int, ...], memory_format: torch.memory_format, seed: int = 1) -> torch.Tensor:
    """Random ``[*batch, 3, 6, 6]`` (``[*batch, 3, 6, 6, 6]`` for channels_last_3d) laid out in ``memory_format``."""
    torch.manual_seed(seed)
    three_d = memory_format is CL3D
    x = torch.rand(int(np.prod(batch)), 3, *[6] * (3 if three_d else 2))
    return x.contiguous(memory_format=memory_format).view(*batch, *x.shape[1:])


@pytest.mark.parametrize("method", ["smoothgrad", "gradient_shap"])
@pytest.mark.parametrize("batch", [(4,), (2, 3)], ids=str)
@pytest.mark.parametrize("memory_format", [CL, CL3D, torch.contiguous_format], ids=str)
def test_the_noisy_copies_reach_the_model_in_the_inputs_memory_format(method, batch, memory_format):
    seen: list[bool] = []
    f, p = tdhook_fn.pure(_net(memory_format, seen))
    x = TensorDict(input=_images(batch, memory_format), batch_size=list(batch))
    if method == "smoothgrad":
        smoothgrad(f, p, x, target=1, nt_samples=5, stdevs=0.2)
    else:
        refs = TensorDict(input=_images((7,), memory_format, seed=2), batch_size=[7])
        gradient_shap(f, p, x, refs, target=1, n_samples=5, stdevs=0.2)
    assert seen
    assert all(seen) if memory_format is not torch.contiguous_format else not any(seen)


def _seeded_smoothgrad(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    f, p = tdhook_fn.pure(model)
    torch.manual_seed(3)
    return smoothgrad(f, p, x, target=2, nt_samples=6, stdevs=0.3)


@pytest.mark.parametrize("memory_format", [CL, CL3D], ids=str)
def test_smoothgrad_of_a_channels_last_input_equals_captum_bitwise(memory_format):
    model, x = _net(memory_format), _images((4,), memory_format)
    ours = _seeded_smoothgrad(model, x)
    torch.manual_seed(3)
    theirs = ca.NoiseTunnel(ca.Saliency(model)).attribute(x.clone(), nt_samples=6, stdevs=0.3, target=2, abs=False)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("memory_format", [CL, CL3D], ids=str)
def test_smoothgrad_maps_do_not_depend_on_the_memory_format(memory_format):
    model, x = _net(memory_format), _images((4,), memory_format)
    ours = _seeded_smoothgrad(model, x)
    plain = _seeded_smoothgrad(copy.deepcopy(model).to(memory_format=torch.contiguous_format), x.contiguous())
    assert x.contiguous().data_ptr() != x.data_ptr()
    torch.testing.assert_close(ours, plain)  # (other kernels for each layout: close, not bitwise)


@pytest.mark.parametrize("multiply_by_inputs", [False, True])
@pytest.mark.parametrize("memory_format", [CL, CL3D], ids=str)
def test_gradient_shap_of_a_channels_last_input_equals_captum_given_its_draws(memory_format, multiply_by_inputs):
    """The averaged gradients bitwise; times ``x + e - b``, to a few ulps: captum repeats the inputs
    (``repeat_interleave``, which writes them NCHW), so its products ``(x + e - b) * grad`` are NCHW and are
    averaged over the draws in that order, where ours, kept channels_last, are summed in theirs."""
    model, x, refs = _net(memory_format), _images((4,), memory_format), _images((7,), memory_format, seed=2)
    n, k, stdev = len(x), 5, 0.2
    np.random.seed(4)
    torch.manual_seed(4)
    index = torch.tensor(np.random.choice(len(refs), n * k)).view(n, k)
    noise = (torch.randn(n * k, *x.shape[1:]) * stdev).view(n, k, *x.shape[1:])  # captum's draw: NCHW order
    alpha = torch.tensor(np.random.uniform(0.0, 1.0, n * k)).view(n, k)
    draws = TensorDict(index=index, alpha=alpha, noise=TensorDict(input=noise, batch_size=[n, k]), batch_size=[n, k])
    f, p = tdhook_fn.pure(model)
    ours = gradient_shap(f, p, x, refs, target=2, n_samples=k, stdevs=stdev, draws=draws,
                         multiply_by_inputs=multiply_by_inputs)
    np.random.seed(4)
    torch.manual_seed(4)
    theirs = ca.GradientShap(model, multiply_by_inputs=multiply_by_inputs).attribute(
        x.clone(), refs, n_samples=k, stdevs=stdev, target=2)
    if multiply_by_inputs:
        eps = torch.finfo(theirs.dtype).eps
        torch.testing.assert_close(ours, theirs, rtol=4 * eps, atol=4 * eps * theirs.abs().max().item())
    else:
        assert torch.equal(ours, theirs)
