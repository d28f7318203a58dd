"""Calls in a fast-pooling block pool in channels-last (NOTE [shadow max pooling]): the model's own numbers and
autograd's own gradients, exactly."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from zoo import pooled_layouts, pooling_planes, tiny_resnet

import tdhook_fn
from tdhook_fn._functional import shadow_of
from tdhook_fn._pool_layout import ChannelsLastMaxPool2d, fast_pooling, shadow_class
from tdhook_fn.attribution import saliency

_ANY_SIZE = pytest.mark.usefixtures("pools_of_any_size")  # (small inputs: these test where and what it pools)
_SETTINGS = [
    dict(kernel_size=2),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=3, stride=1, padding=1, ceil_mode=True),
    dict(kernel_size=2, stride=2, dilation=2, ceil_mode=True),
    dict(kernel_size=(2, 3), stride=(1, 2)),
]


def _exact(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(got), torch.signbit(want))
    assert got.is_contiguous()


@_ANY_SIZE
@pytest.mark.parametrize("name", ["ties", "nans", "zeros", "float64"])
@pytest.mark.parametrize("settings", _SETTINGS, ids=str)
def test_an_undifferentiated_call_gives_the_models_own_maxima_and_indices(name: str, settings: dict[str, Any],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    x = pooling_planes()[name]
    model = nn.MaxPool2d(**settings, return_indices=True)
    params = tdhook_fn.params(model)
    want, want_indices = model(x)
    layouts = pooled_layouts(monkeypatch)
    with fast_pooling():
        out, indices = tdhook_fn.call(model, params, x)
    assert layouts == [True]
    _exact(out, want)
    assert torch.equal(indices, want_indices) and indices.is_contiguous()
    with fast_pooling():
        _exact(tdhook_fn.call(nn.MaxPool2d(**settings), params, x), want)


@_ANY_SIZE
@pytest.mark.parametrize("name", ["ties", "nans", "zeros", "float64"])
@pytest.mark.parametrize("settings", _SETTINGS, ids=str)
def test_autograd_differentiates_the_pool_as_the_plain_kernel(name: str, settings: dict[str, Any],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Pooled on a channels-last copy, differentiated by the plain kernel's backward: its gradient bit for bit, in
    the default layout, the indices too; a second derivative through a layer below as well."""
    torch.manual_seed(1)
    x = pooling_planes()[name]
    pool = nn.MaxPool2d(**settings, return_indices=True)
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.Tanh(), nn.MaxPool2d(**settings)).to(x.dtype)
    for net in (pool, model):
        params = tdhook_fn.params(net)
        leaf = x.clone().requires_grad_()
        plain = net(leaf)
        out = plain[0] if isinstance(plain, tuple) else plain
        cot = torch.randn_like(out).round()  # (whole numbers: sums of them round alike in any order)
        want = torch.autograd.grad(out, leaf, cot, create_graph=True)[0]
        want_second = torch.autograd.grad((want.nan_to_num() ** 2).sum(), leaf)[0] if net is model else None
        layouts = pooled_layouts(monkeypatch)
        with fast_pooling():
            got_out = tdhook_fn.call(net, params, leaf)
        monkeypatch.undo()
        assert layouts == [True]
        if isinstance(plain, tuple):
            _exact(got_out[0], plain[0])
            assert torch.equal(got_out[1], plain[1]) and got_out[1].is_contiguous() and not got_out[1].requires_grad
            got_out = got_out[0]
        got = torch.autograd.grad(got_out, leaf, cot, create_graph=True)[0]
        _exact(got, want)
        if want_second is not None:
            _exact(torch.autograd.grad((got.nan_to_num() ** 2).sum(), leaf)[0], want_second)


@_ANY_SIZE
@pytest.mark.parametrize("name", ["ties", "zeros", "float64"])
def test_transformed_and_forward_mode_derivatives_keep_the_plain_kernel(name: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    x = pooling_planes()[name]
    model = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Flatten(), nn.LazyLinear(3)).to(x.dtype)
    model(x)
    params = tdhook_fn.params(model)
    leaf = x.clone().requires_grad_()
    want = torch.autograd.grad(model(leaf)[:, 1].sum(), leaf)[0]
    tangent = torch.randn_like(x)
    with torch.autograd.forward_ad.dual_level():
        want_jvp = torch.autograd.forward_ad.unpack_dual(model(torch.autograd.forward_ad.make_dual(leaf, tangent)))[1]
    layouts = pooled_layouts(monkeypatch)
    with fast_pooling():
        got = torch.func.grad(lambda inputs: tdhook_fn.call(model, params, inputs)[:, 1].sum())(x)
        with torch.autograd.forward_ad.dual_level():
            dual = torch.autograd.forward_ad.make_dual(leaf, tangent)
            got_jvp = torch.autograd.forward_ad.unpack_dual(tdhook_fn.call(model, params, dual))[1]
    assert layouts == [False, False]
    _exact(got, want)
    _exact(got_jvp, want_jvp)


def test_small_inputs_keep_the_plain_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below 2^15 elements the copies cost more than the channels-last kernel saves, differentiated or not."""
    model = nn.MaxPool2d(2)
    params = tdhook_fn.params(model)
    inputs = [torch.randn(shape) for shape in [(1, 8, 8, 8), (8, 8, 16, 16), (16, 8, 16, 16)]]  # (2^9 to 2^15)
    wants = [model(x) for x in inputs]
    layouts = pooled_layouts(monkeypatch)
    with fast_pooling():
        for x, want in zip(inputs, wants, strict=True):
            _exact(tdhook_fn.call(model, params, x), want)
            _exact(tdhook_fn.call(model, params, x.clone().requires_grad_()).detach(), want)
    assert layouts == [False, False, False, False, True, True]


@pytest.mark.parametrize(("kernel", "stride", "padding", "dilation"),
                         [(2, 0, 0, 1), (2, (), 0, 1), (3, (), 1, 1), ((3, 2), [2, 1], (1, 0), (1, 2)),
                          (2, None, 0, 1)], ids=str)
def test_settings_read_as_the_plain_kernel_reads_them(monkeypatch: pytest.MonkeyPatch, kernel: Any, stride: Any,
                                                      padding: Any, dilation: Any) -> None:
    """Differentiated in channels-last: ints, tuples and lists as the module holds them; an empty stride is the
    kernel's, a zero one is refused, as by nn.MaxPool2d: the same maxima and gradient."""
    x = torch.randn(16, 8, 16, 16, requires_grad=True)  # (2^15 elements: the channels-last kernel runs)
    plain = nn.MaxPool2d(kernel, stride=stride, padding=padding, dilation=dilation)
    shadow = ChannelsLastMaxPool2d(kernel, stride=stride, padding=padding, dilation=dilation)
    if stride == 0:
        with pytest.raises(RuntimeError, match="stride should not be zero"):
            plain(x)
        with pytest.raises(RuntimeError, match="stride should not be zero"):
            shadow(x)
        return
    want = plain(x)
    (want_grad,) = torch.autograd.grad(want.square().sum(), x)
    layouts = pooled_layouts(monkeypatch)
    got = shadow(x)
    (got_grad,) = torch.autograd.grad(got.square().sum(), x)
    assert layouts == [True]  # (the Function ran)
    _exact(got, want)
    _exact(got_grad, want_grad)


@_ANY_SIZE
def test_planes_of_fewer_than_four_channels_keep_the_plain_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """There the channels-last kernel is the slower one; differentiated or not."""
    x = torch.randn(5, 3, 8, 8)
    model = nn.MaxPool2d(2)
    params = tdhook_fn.params(model)
    layouts = pooled_layouts(monkeypatch)
    with fast_pooling():
        out = tdhook_fn.call(model, params, x)
        differentiated = tdhook_fn.call(model, params, x.clone().requires_grad_())
        wide = tdhook_fn.call(model, params, torch.cat([x, x[:, :1]], 1))
    assert layouts == [False, False, True]
    _exact(out, model(x))
    _exact(differentiated.detach(), model(x))
    _exact(wide, model(torch.cat([x, x[:, :1]], 1)))


@_ANY_SIZE
def test_under_vmap_and_on_other_layouts_the_plain_kernel_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    x = pooling_planes()["ties"]
    model = nn.MaxPool2d(3, 2, 1)
    params = tdhook_fn.params(model)
    want, last, unbatched = model(x), x.contiguous(memory_format=torch.channels_last), x[0]
    layouts = pooled_layouts(monkeypatch)
    with fast_pooling():
        per_sample = torch.vmap(lambda one: tdhook_fn.call(model, params, one[None])[0])(x)
        on_last = tdhook_fn.call(model, params, last)
        on_unbatched = tdhook_fn.call(model, params, unbatched)
    assert layouts == [False, True, False]  # (the second input is channels-last itself: pooled as it is)
    _exact(per_sample, want)
    torch.testing.assert_close(on_last, model(last), rtol=0, atol=0)
    _exact(on_unbatched, model(unbatched))


def test_only_fast_pooling_shadows_of_max_pool2d_itself_change_class(monkeypatch: pytest.MonkeyPatch) -> None:
    class Mine(nn.MaxPool2d):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return super().forward(input) * 2

    assert shadow_class(nn.MaxPool2d(2)) is ChannelsLastMaxPool2d
    assert shadow_class(Mine(2)) is Mine
    assert shadow_class(nn.MaxPool1d(2)) is nn.MaxPool1d
    model = nn.Sequential(Mine(2), nn.MaxPool2d(2))
    x = torch.randn(2, 3, 8, 8)
    layouts = pooled_layouts(monkeypatch)
    assert torch.equal(tdhook_fn.call(model, tdhook_fn.params(model), x), model(x))
    assert layouts == [False, False, False, False]  # (the model's own call is the second pair)
    with shadow_of(model) as shadow:  # every other call: the model's own classes (LRP chooses rules by class)
        assert type(shadow.root[0]) is Mine and type(shadow.root[1]) is nn.MaxPool2d
    with shadow_of(model, fast_pooling=True) as shadow:
        assert type(shadow.root[0]) is Mine and type(shadow.root[1]) is ChannelsLastMaxPool2d


def test_hooks_on_the_pool_see_its_result() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.MaxPool2d(2))
    seen: list[torch.Tensor] = []
    handle = model[1].register_forward_hook(lambda module, args, out: seen.append(out) or out * 3)
    try:
        x = torch.randn(4, 1, 9, 9)
        with fast_pooling():
            got = tdhook_fn.call(model, tdhook_fn.params(model), x)
        want = model(x)
    finally:
        handle.remove()
    _exact(got, want)
    _exact(seen[0], seen[1])
    assert type(model[1]) is nn.MaxPool2d  # the model's own module is untouched


def test_a_hugging_face_resnet_at_full_size_pools_its_stem_in_channels_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' ResNet (random init from a config) on 64x64 images: its stem's pool reads 2^15 elements, so
    saliency pools it in channels-last, with the map of the plain kernel bit for bit; at batch 1 it keeps the plain
    kernel."""
    f, p = tiny_resnet()
    images = torch.rand(4, 3, 64, 64)
    for x, pooled in ((images, True), (images[:1], False)):
        inputs = TensorDict(pixel_values=x, batch_size=[len(x)])
        layouts = pooled_layouts(monkeypatch)
        got = saliency(f, p, inputs, target=2)["pixel_values"]
        assert layouts == [pooled]
        monkeypatch.undo()
        with monkeypatch.context() as patch:
            patch.setattr("tdhook_fn._pool_layout.faster_in_channels_last", lambda *_: False)
            want = saliency(f, p, inputs, target=2)["pixel_values"]
        _exact(got, want)
