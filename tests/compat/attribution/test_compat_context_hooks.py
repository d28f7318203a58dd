"""An attribution context's own hooks, side by side with tdhook 0.1.3: switched off by ``disable_context_hooks``,
registered anew after it, ordered with the user's backward hooks, and ``disable_context``
(NOTE [a context's own hooks]).

tdhook registers guided backprop's ReLUs and ``output_grad_callbacks`` as torch hooks on entry: inside
``disable_context_hooks`` its gradients are plain, after the block they run after the hooks recorded in between,
and a backward hook the user records after entry runs after theirs unless ``prepend=True``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import tdhook.attribution
import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn
import tdhook_fn.compat.attribution
from tdhook_fn.attribution import guided_backprop, saliency
from tdhook_fn.compat.attribution.grad_cam import DimsConfig

LIBS = {"tdhook": tdhook.attribution, "ours": tdhook_fn.compat.attribution}


def model(inplace: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(l0=nn.Linear(4, 8), a0=nn.ReLU(inplace=inplace), l1=nn.Linear(8, 6),
                                     a1=nn.ReLU(), l2=nn.Linear(6, 3))).eval()


def data() -> TensorDict:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    return TensorDict(input=x, baseline=TensorDict(input=torch.zeros_like(x), batch_size=[5]), batch_size=[5])


def clamp_positive(module: nn.Module, grad_output: tuple[torch.Tensor, ...], **_: Any) -> tuple[torch.Tensor, ...]:
    return (grad_output[0].clamp(min=0),)


def scale_grad_output(module: nn.Module, grad_output: tuple[torch.Tensor, ...], **_: Any) -> tuple[torch.Tensor, ...]:
    return (grad_output[0] * -1.5,)


def scale_grad_input(module: nn.Module, grad_input: tuple[Any, ...], **_: Any) -> tuple[Any, ...]:
    return tuple(None if grad is None else grad * -1.5 for grad in grad_input)


def scale_output(module: nn.Module, args: Any, output: torch.Tensor, **_: Any) -> torch.Tensor:
    return output * -2.0


FACTORIES: dict[str, Callable[[Any], Any]] = {
    "guided": lambda lib: lib.GuidedBackpropagation(),
    "saliency_callbacks": lambda lib: lib.Saliency(output_grad_callbacks={"l1": clamp_positive}),
    "ig_callbacks": lambda lib: lib.IntegratedGradients(n_steps=4, output_grad_callbacks={"l1": clamp_positive}),
}


def attributions(lib: str, make: Callable[[Any], Any], inside: Callable[[Any, TensorDict], TensorDict],
                 net: nn.Module | None = None) -> TensorDict:
    with make(LIBS[lib]).prepare(model() if net is None else net) as hooked:
        out = inside(hooked, data())
    return out.get("attr")


def assert_same(inside: Callable[[Any, TensorDict], TensorDict], make: Callable[[Any], Any]) -> None:
    ref, ours = attributions("tdhook", make, inside), attributions("ours", make, inside)
    assert set(ours.keys(True, True)) == set(ref.keys(True, True))
    for key in ref.keys(True, True):
        torch.testing.assert_close(ours.get(key), ref.get(key))


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_disabled_context_hooks_give_tdhooks_plain_gradients(name: str) -> None:
    def inside(hooked: Any, td: TensorDict) -> TensorDict:
        with hooked.disable_context_hooks():
            return hooked(td)

    assert_same(inside, FACTORIES[name])
    # and they are plain: the context's hooks did change the numbers outside the block
    plain = attributions("ours", FACTORIES[name], inside)
    hooked = attributions("ours", FACTORIES[name], lambda hooked, td: hooked(td))
    assert not torch.allclose(plain["input"], hooked["input"])


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_the_context_hooks_come_back_after_the_block(name: str) -> None:
    def inside(hooked: Any, td: TensorDict) -> TensorDict:
        with hooked.disable_context_hooks():
            pass
        return hooked(td)

    assert_same(inside, FACTORIES[name])


# (context, the hooked module's setter, path, callback): a backward hook set after entry on a module the context
# hooks too (its output_grad_callbacks, its guides)
AFTER_ENTRY = {
    "saliency_grad_output": ("saliency_callbacks", "set_grad_output", "l1", scale_grad_output),
    "ig_grad_output": ("ig_callbacks", "set_grad_output", "l1", scale_grad_output),
    "guided_grad_l1": ("guided", "set_grad", "l1", scale_grad_input),
    "guided_grad_a0": ("guided", "set_grad", "a0", scale_grad_input),
}


@pytest.mark.parametrize("prepend", [False, True])
@pytest.mark.parametrize("case", sorted(AFTER_ENTRY))
def test_a_backward_hook_after_entry_runs_after_the_contexts(case: str, prepend: bool) -> None:
    name, setter, path, callback = AFTER_ENTRY[case]

    def inside(hooked: Any, td: TensorDict) -> TensorDict:
        getattr(hooked, setter)(path, value=None, callback=callback, prepend=prepend)
        return hooked(td)

    assert_same(inside, FACTORIES[name])


@pytest.mark.parametrize("in_run", [False, True])
def test_the_callbacks_see_the_gradient_of_the_output_a_forward_hook_left(in_run: bool) -> None:
    """torch runs a module's backward pre-hooks on the output as its forward hooks left it."""
    def inside(hooked: Any, td: TensorDict) -> TensorDict:
        if in_run:
            with hooked.run(td, grad_enabled=True) as run:
                run.set("l1", value=None, callback=scale_output)
            return td
        hooked.set("l1", value=None, callback=scale_output)
        return hooked(td)

    assert_same(inside, FACTORIES["saliency_callbacks"])


@pytest.mark.parametrize("make", [
    lambda lib: lib.Saliency(input_modules=["l1"]),
    lambda lib: lib.Saliency(target_modules=["l1"]),
    lambda lib: lib.IntegratedGradients(n_steps=4, input_modules=["l1"]),
], ids=["saliency_input_modules", "saliency_target_modules", "ig_input_modules"])
def test_hooks_set_before_a_disable_block_run_before_the_context_hooks_after_it(make: Callable[[Any], Any]) -> None:
    """tdhook registers its hooks anew when the block ends: a hook the user set before the block then runs first."""
    def inside(hooked: Any, td: TensorDict) -> TensorDict:
        hooked.set("l1", value=None, callback=scale_output)
        with hooked.disable_context_hooks():
            pass
        return hooked(td)

    assert_same(inside, make)


@pytest.mark.parametrize("name", ["saliency", "ig", "guided", "grad_cam", "lrp"])
def test_disable_context_yields_the_model_and_the_context_works_after(name: str) -> None:
    factories = {
        "saliency": lambda: tdhook_fn.compat.attribution.Saliency(),
        "ig": lambda: tdhook_fn.compat.attribution.IntegratedGradients(n_steps=4),
        "guided": lambda: tdhook_fn.compat.attribution.GuidedBackpropagation(),
        "grad_cam": lambda: tdhook_fn.compat.attribution.GradCAM({"l1": DimsConfig()}),
        "lrp": lambda: tdhook_fn.compat.attribution.LRP(),
    }
    net = model()
    with factories[name]().prepare(net) as hooked:
        before = hooked(data())["attr"]
        with hooked.disable_context() as raw:
            assert raw is net
            torch.testing.assert_close(raw(data()["input"]), net(data()["input"]))
        after = hooked(data())["attr"]
    for key in before.keys(True, True):
        torch.testing.assert_close(after.get(key), before.get(key))


def test_disable_context_inside_matches_tdhook() -> None:
    def inside(hooked: Any, td: TensorDict) -> TensorDict:
        with hooked.disable_context():
            return hooked(td)

    assert_same(inside, FACTORIES["saliency_callbacks"])


def test_a_module_writing_its_input_in_place_is_still_guided_and_called_back() -> None:
    """tdhook's torch backward hooks fail on ``ReLU(inplace=True)``; ours are gradient maps there (no user hook)."""
    net = model(inplace=True)
    with pytest.raises(RuntimeError, match="modified inplace"):
        attributions("tdhook", FACTORIES["guided"], lambda hooked, td: hooked(td), model(inplace=True))
    f, p = tdhook_fn.functional(model(), ["input"], ["output"]), tdhook_fn.params(model())
    everything = lambda out: TensorDict(out=out["output"], batch_size=out.batch_size)
    guided = attributions("ours", FACTORIES["guided"], lambda hooked, td: hooked(td), net)
    expected = guided_backprop(f, p, data().select("input"), target=everything)
    torch.testing.assert_close(guided["input"], expected["input"])
    called_back = attributions("ours", lambda lib: lib.Saliency(output_grad_callbacks={"a0": clamp_positive}),
                               lambda hooked, td: hooked(td), model(inplace=True))
    expected = saliency(f, p, data().select("input"), target=everything,
                        taps=[tdhook_fn.map_grad("a0", lambda grad: grad.clamp(min=0))])
    torch.testing.assert_close(called_back["input"], expected["input"])
