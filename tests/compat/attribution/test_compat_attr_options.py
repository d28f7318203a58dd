"""The documented options of tdhook's gradient attributions, and their errors, against tdhook 0.1.3."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from test_compat_attr_api import BATCHES, CASES, OURS, REF, assert_same, compare, oracle, run
from torch import nn

MLP, TWO, BLOCKS, CNN = CASES["mlp"], CASES["two_input"], CASES["blocks"], CASES["cnn"]
METHODS = {
    "saliency": lambda lib, **kw: lib.Saliency(multiply_by_inputs=True, **kw),
    "ig": lambda lib, **kw: lib.IntegratedGradients(n_steps=5, multiply_by_inputs=True, **kw),
    "guided": lambda lib, **kw: lib.GuidedBackpropagation(**kw),
}
EACH = pytest.mark.parametrize("method", list(METHODS))
EACH_BATCH = pytest.mark.parametrize("batch", BATCHES, ids=["3", "2x3"])


def labelled(case: Any, batch: tuple[int, ...], nested: bool) -> TensorDict:
    td = case.data(batch)
    labels = torch.arange(td.numel()).reshape(batch) % 2
    td["label"] = TensorDict(output=labels, batch_size=batch) if nested else labels
    return td


def second_output(t: TensorDict, extra: TensorDict) -> TensorDict:
    return TensorDict(output=t["output"][..., 1], batch_size=t.batch_size)


@EACH
@EACH_BATCH
def test_init_attr_targets(method: str, batch: tuple[int, ...]) -> None:
    compare(lambda lib: METHODS[method](lib, init_attr_targets=second_output), TWO, batch)


@pytest.mark.filterwarnings("ignore:Using a non-tuple sequence:UserWarning")  # tdhook indexing a tensor by str
@EACH_BATCH
def test_init_attr_targets_with_labels(batch: tuple[int, ...]) -> None:
    def make(lib: Any, delta: bool = False) -> Any:
        target = functools.partial(lib.IntegratedGradients.init_attr_targets_with_labels, selected_out_keys=["output"])
        return lib.IntegratedGradients(n_steps=7, multiply_by_inputs=True, init_attr_targets=target,
                                       additional_init_keys=["label"], compute_convergence_delta=delta)

    out = compare(make, BLOCKS, td=labelled(BLOCKS, batch, nested=True))
    # Each sample's attribution is that of its own label's logit.
    for label in range(2):
        one = run(OURS, lambda lib, k=label: lib.IntegratedGradients(
            n_steps=7, multiply_by_inputs=True,
            init_attr_targets=lambda t, e: TensorDict(output=t["output"][..., k], batch_size=t.batch_size)),
            BLOCKS.model(), BLOCKS.data(batch), BLOCKS.in_keys)
        rows = labelled(BLOCKS, batch, True)["label", "output"] == label
        torch.testing.assert_close(out["attr", "input"][rows], one["attr", "input"][rows])
    # Beyond tdhook 0.1.3: plain-tensor labels, and the convergence delta (both fail there).
    plain = run(OURS, make, BLOCKS.model(), labelled(BLOCKS, batch, nested=False), BLOCKS.in_keys)
    torch.testing.assert_close(plain["attr", "input"], out["attr", "input"])
    with pytest.raises(IndexError):
        run(REF, make, BLOCKS.model(), labelled(BLOCKS, batch, nested=False), BLOCKS.in_keys)
    with_delta = run(OURS, lambda lib: make(lib, True), BLOCKS.model(), labelled(BLOCKS, batch, True), ["input"])
    assert with_delta["convergence_delta"].abs().max() < 1e-2


@EACH
@EACH_BATCH
def test_init_attr_grads(method: str, batch: tuple[int, ...]) -> None:
    def grads(targets: TensorDict, extra: TensorDict) -> TensorDict:
        weights = torch.tensor([1.0, -2.0, 0.5]) * extra["scale"].unsqueeze(-1).reshape(
            *extra["scale"].shape, *[1] * (targets.batch_dims - extra.batch_dims), 1)
        return TensorDict(output=weights.expand(targets["output"].shape), batch_size=targets.batch_size)

    td = MLP.data(batch)
    td["scale"] = torch.linspace(0.5, 2.0, td.numel()).reshape(batch)
    compare(lambda lib: METHODS[method](lib, init_attr_grads=grads, additional_init_keys=["scale"]), MLP, td=td)


@pytest.mark.parametrize("method", ["saliency", "guided"])
@EACH_BATCH
def test_init_attr_inputs_selects_inputs(method: str, batch: tuple[int, ...]) -> None:
    only_y = lambda inputs, extra: inputs.select("y")
    out = compare(lambda lib: METHODS[method](lib, init_attr_inputs=only_y), TWO, batch)
    assert {k for k in out.keys(True, True) if k[0] == "attr"} == {("attr", "y")}


@EACH_BATCH
def test_init_attr_inputs_selects_interpolated_inputs(batch: tuple[int, ...]) -> None:
    """tdhook interpolates only the selected inputs and needs baselines for those alone."""
    only_y = lambda inputs, extra: inputs.select("y")
    td = TWO.data(batch)
    td["baseline"] = td["baseline"].select("y")
    out = compare(lambda lib: lib.IntegratedGradients(n_steps=5, init_attr_inputs=only_y), TWO, td=td)
    assert {k for k in out.keys(True, True) if k[0] == "attr"} == {("attr", "y")}
    # Beyond tdhook 0.1.3: full baselines, multiplied by inputs, with the convergence delta.
    full = run(OURS, lambda lib: lib.IntegratedGradients(n_steps=5, init_attr_inputs=only_y, multiply_by_inputs=True,
                                                         compute_convergence_delta=True), TWO.model(), TWO.data(batch),
               TWO.in_keys)
    assert full["attr", "y"].shape == td["y"].shape and full["convergence_delta"].shape == torch.Size(batch)


@pytest.mark.parametrize("method", ["saliency", "guided"])
@EACH_BATCH
def test_init_attr_cache_in_selects_modules(method: str, batch: tuple[int, ...]) -> None:
    only_a = lambda cache, extra: cache.select("a")
    out = compare(lambda lib: METHODS[method](lib, input_modules=["a", "b"], init_attr_cache_in=only_a), TWO, batch)
    assert ("attr", "a") in out.keys(True, True) and ("attr", "b") not in out.keys(True, True)


@EACH_BATCH
def test_init_attr_cache_in_grad_cam(batch: tuple[int, ...]) -> None:
    keep = lambda cache, extra: cache.select("[2]")
    td = CNN.data((6,)).reshape(batch) if len(batch) > 1 else CNN.data(batch)
    ref = run(REF, lambda lib: lib.GradCAM({"[0]": lib.DimsConfig((2, 3), (1,)), "[2]": lib.DimsConfig()},
                                           init_attr_cache_in=keep), CNN.model(), td.reshape(-1), CNN.in_keys)
    ours = run(OURS, lambda lib: lib.GradCAM({"[0]": lib.DimsConfig((2, 3), (1,)), "[2]": lib.DimsConfig()},
                                             init_attr_cache_in=keep), CNN.model(), td, CNN.in_keys)
    assert_same(ref.reshape(batch), ours)


@EACH
@EACH_BATCH
def test_output_grad_callbacks(method: str, batch: tuple[int, ...]) -> None:
    seen: dict[int, list[Any]] = {}

    def make(lib: Any) -> Any:
        def callback(module: Any, grad_output: Any, **kwargs: Any) -> Any:
            seen.setdefault(id(lib), []).append((type(module).__name__, type(grad_output), kwargs["direction"]))
            return (grad_output[0] * torch.linspace(-1.0, 2.0, grad_output[0].shape[-1]),)

        return METHODS[method](lib, output_grad_callbacks={BLOCKS.layer: callback})

    compare(make, BLOCKS, batch)
    assert seen[id(REF)][0] == seen[id(OURS)][0] == ("Linear", tuple, "bwd_pre")


def test_output_grad_callback_receives_the_users_submodule() -> None:
    model, modules = MLP.model(), []

    def callback(module: Any, grad_output: Any, **kwargs: Any) -> None:
        modules.append(module)

    with OURS.Saliency(output_grad_callbacks={"[1]": callback}).prepare(model) as hooked:
        hooked(MLP.data())
    assert modules == [model[1]]


@pytest.mark.parametrize("key", ["saliency_maps", ("maps", "grads")])
def test_attribution_key(key: Any) -> None:
    out = compare(lambda lib: lib.Saliency(attribution_key=key, input_modules=["a"]), TWO, (2, 3))
    prefix = key if isinstance(key, tuple) else (key,)
    assert (*prefix, "x") in out.keys(True, True) and (*prefix, "a") in out.keys(True, True)
    compare(lambda lib: lib.IntegratedGradients(n_steps=4, attribution_key=key), TWO, (2, 3))


@EACH
@EACH_BATCH
def test_use_inputs_false_with_input_modules(method: str, batch: tuple[int, ...]) -> None:
    out = compare(lambda lib: METHODS[method](lib, use_inputs=False, input_modules=[CNN.layer]) if method != "ig"
                  else lib.IntegratedGradients(n_steps=5, use_inputs=False, input_modules=[CNN.layer]), CNN, batch)
    assert {k for k in out.keys(True, True) if k[0] == "attr"} == {("attr", CNN.layer)}


@EACH
def test_target_modules_and_use_outputs(method: str) -> None:
    """For guided backprop the target module is skipped: see the NOTE in the guided test below."""
    def hidden(t: TensorDict, extra: TensorDict) -> TensorDict:
        return TensorDict(h=t[MLP.target][..., :2].sum(-1) * extra["w"], batch_size=t.batch_size)

    td = MLP.data((2, 3))
    td["w"] = torch.rand(2, 3)
    if method == "ig":  # the weights broadcast over tdhook's trailing step dim
        hidden_fn: Any = lambda t, e: TensorDict(h=t[MLP.target][..., :2].sum(-1) * e["w"].unsqueeze(-1),
                                                 batch_size=t.batch_size)
    else:
        hidden_fn = hidden
    skip = {"classes_to_skip": (torch.nn.Linear,)} if method == "guided" else {}
    compare(lambda lib: METHODS[method](lib, target_modules=[MLP.target], use_outputs=False,
                                        init_attr_targets=hidden_fn, additional_init_keys=["w"], **skip), MLP, td=td)


def test_cache_callback_on_target_modules() -> None:
    def callback(module: Any, args: Any, output: Any, **kwargs: Any) -> Any:
        return output[..., :3] * 2

    compare(lambda lib: lib.Saliency(target_modules=["[0]"], cache_callback=callback,
                                     init_attr_targets=lambda t, e: t.select("[0]")), MLP, (2, 3))


def test_additional_init_keys_pass_through_and_reach_callables() -> None:
    seen = []

    def targets(t: TensorDict, extra: TensorDict) -> TensorDict:
        seen.append((tuple(extra.keys(True, True)), tuple(extra.batch_size)))
        return TensorDict(output=t["output"][..., 0] * extra["meta", "w"], batch_size=t.batch_size)

    td = MLP.data((3,))
    td["meta"] = TensorDict(w=torch.tensor([1.0, 2.0, 3.0]), batch_size=[3])
    out = compare(lambda lib: lib.Saliency(init_attr_targets=targets, additional_init_keys=[("meta", "w")]),
                  MLP, td=td)
    assert ("meta", "w") in out.keys(True, True)
    assert seen[0] == seen[1] == ((("meta", "w"),), (3,))


def test_custom_grad_attr_subclass() -> None:
    """A tdhook-style subclass implementing ``_grad_attr`` runs unchanged."""
    def subclass(base: type) -> type:
        class Squared(base):  # type: ignore[misc,valid-type]
            def _grad_attr(self, grads: TensorDict, inputs: TensorDict) -> TensorDict:
                return grads * grads + inputs

        return Squared

    classes = {id(REF): subclass(REF.GradientAttribution), id(OURS): subclass(OURS.GradientAttribution)}
    compare(lambda lib: classes[id(lib)](input_modules=["a"]), TWO, (2, 3))


# -- errors ----------------------------------------------------------------------------------

def errors(make: Any, td: TensorDict, case: Any = MLP) -> tuple[BaseException, BaseException]:
    caught = []
    for lib in (REF, OURS):
        with pytest.raises(Exception) as info:
            run(lib, make, case.model(), td, case.in_keys)
        caught.append(info.value)
    return caught[0], caught[1]


@pytest.mark.parametrize("name", ["init_attr_targets", "init_attr_grads", "init_attr_cache_in"])
def test_callable_returning_a_dict_raises_tdhooks_value_error(name: str) -> None:
    bad = lambda t, e: dict(t.items())
    ref, ours = errors(lambda lib: lib.Saliency(input_modules=["[1]"], **{name: bad}), MLP.data())
    assert type(ref) is type(ours) is ValueError
    assert str(ours) == str(ref) == f"{name} function must return a TensorDict"


def test_init_attr_inputs_returning_a_dict_raises_value_error() -> None:
    """tdhook 0.1.3 fails on ``dict.requires_grad_`` before its own check; we raise its message."""
    with pytest.raises(ValueError, match="init_attr_inputs function must return a TensorDict"):
        run(OURS, lambda lib: lib.Saliency(init_attr_inputs=lambda t, e: dict(t.items())), MLP.model(), MLP.data(),
            ["input"])


def test_additional_init_keys_overlapping_keys() -> None:
    for key in ("input", "output"):
        ref, ours = errors(lambda lib, k=key: lib.Saliency(additional_init_keys=[k]), MLP.data())
        assert type(ref) is type(ours) is ValueError and str(ours) == str(ref)


@pytest.mark.parametrize("method", ["saliency", "ig"])
def test_target_without_grad_fn_names_the_key(method: str) -> None:
    constant = lambda t, e: TensorDict(flat_target=torch.zeros(t.batch_size), batch_size=t.batch_size)
    ref, ours = errors(lambda lib: METHODS[method](lib, init_attr_targets=constant), MLP.data())
    assert type(ref) is type(ours) is ValueError
    assert "flat_target" in str(ref) and "flat_target" in str(ours)


def test_missing_baseline_raises_key_error_naming_it() -> None:
    td = MLP.data().exclude("baseline")
    ref, ours = errors(lambda lib: lib.IntegratedGradients(n_steps=3), td)
    assert type(ref) is type(ours) is KeyError and "baseline" in str(ours)
    ref, ours = errors(lambda lib: lib.IntegratedGradients(n_steps=3, baseline_key="ref"), MLP.data())
    assert type(ref) is type(ours) is KeyError and "ref" in str(ours)


class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.linear(x)
        return y, y.sum(-1)


@pytest.mark.parametrize("name", ["Saliency", "IntegratedGradients"])
def test_more_outputs_than_out_keys_raise_a_runtime_error(name: str) -> None:
    """tensordict's (and so tdhook's) error type for a model returning more tensors than ``out_keys`` names."""
    td = TensorDict(x=torch.randn(2, 4), baseline=TensorDict(x=torch.zeros(2, 4), batch_size=[2]), batch_size=[2])
    for lib in (REF, OURS):
        with getattr(lib, name)().prepare(TwoOutputs(), in_keys=["x"], out_keys=["o"]) as hooked, \
                pytest.raises(RuntimeError, match="out_keys"):
            hooked(td.clone())


def test_init_grads_must_match_targets() -> None:
    wrong_keys = lambda t, e: TensorDict(other=torch.ones_like(t["output"]), batch_size=t.batch_size)
    ref, ours = errors(lambda lib: lib.Saliency(init_attr_grads=wrong_keys), MLP.data())
    assert type(ref) is type(ours) is ValueError and str(ours) == str(ref)
    wrong_batch = lambda t, e: TensorDict(output=torch.ones_like(t["output"]))
    ref, ours = errors(lambda lib: lib.Saliency(init_attr_grads=wrong_batch), MLP.data())
    assert type(ref) is type(ours) is ValueError and str(ours) == str(ref)


def test_unsupported_cache_callback_with_input_modules() -> None:
    with pytest.raises(NotImplementedError, match="cache_callback"):
        OURS.Saliency(input_modules=["[1]"], cache_callback=lambda **kw: kw["output"])


def test_oracle_helper_sees_same_model() -> None:
    ref, ours = oracle(lambda lib: lib.Saliency(), MLP, MLP.data())
    assert_same(ref, ours)


def test_compat_output_grad_callbacks_on_a_module_never_run_do_nothing_as_in_tdhook() -> None:
    import tdhook.attribution

    from tdhook_fn.compat.attribution import Saliency

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.unused, self.b = nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    torch.manual_seed(0)
    model, td = Net(), TensorDict(input=torch.randn(2, 3), batch_size=[2])
    callbacks = {"unused": lambda **kw: None, "a": lambda **kw: None}
    outs = []
    for lib_saliency in (tdhook.attribution.Saliency, Saliency):
        with lib_saliency(output_grad_callbacks=callbacks).prepare(model, in_keys=["input"]) as hooked:
            outs.append(hooked(td.clone())["attr", "input"])
    torch.testing.assert_close(outs[1], outs[0])


@EACH
def test_no_outputs_and_no_target_modules_is_refused(method: str) -> None:
    """Nothing to attribute: tdhook fails inside autograd on the call; compat says why on entry (it attributed
    the outputs, silently, before)."""
    make = METHODS[method]
    td = MLP.data((3,))
    with pytest.raises(RuntimeError):
        run(REF, lambda lib: make(lib, use_outputs=False), MLP.model(torch.float32), td, MLP.in_keys)
    with pytest.raises(ValueError, match="use_outputs=False and no target_modules"):
        run(OURS, lambda lib: make(lib, use_outputs=False), MLP.model(torch.float32), td, MLP.in_keys)
    skip = {"classes_to_skip": (torch.nn.Linear,)} if method == "guided" else {}  # (as above)
    compare(lambda lib: make(lib, use_outputs=False, target_modules=[MLP.target], **skip), MLP)  # one is enough
