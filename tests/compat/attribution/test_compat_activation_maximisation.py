"""tdhook_fn.compat.attribution.ActivationMaximisation side by side with tdhook 0.1.3's."""

from __future__ import annotations

import copy
import inspect
import math
from typing import Any

import pytest
import tdhook.attribution
import tdhook.attribution.activation_maximisation
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from test_compat_attr_api import assert_same
from torch import nn
from zoo import cnn, mlp, same, snapshot

import tdhook_fn
import tdhook_fn.compat.attribution
import tdhook_fn.compat.attribution.activation_maximisation
from tdhook_fn.attribution import activation_maximisation

REF, OURS = tdhook.attribution.ActivationMaximisation, tdhook_fn.compat.attribution.ActivationMaximisation
MODELS = {"mlp": (mlp, (4,), "module[2]"), "cnn": (cnn, (1, 5, 5), "module[1]")}
GRID = [pytest.param(n, b, d, id=f"{n}-{'x'.join(map(str, b))}-{str(d)[6:]}")
        for n in MODELS for b in [(3,), (2, 3)] for d in [torch.float32, torch.float64]
        if n == "mlp" or (b, d) in [((3,), torch.float32), ((2, 3), torch.float64)]]


def model_and_data(name: str, batch: tuple[int, ...] = (3,), dtype: torch.dtype = torch.float32,
                   ) -> tuple[nn.Module, TensorDict, str]:
    build, shape, layer = MODELS[name]
    torch.manual_seed(0)
    model = build().eval().to(dtype)
    x = torch.randn(*batch, *shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    return model, TensorDict(input=x, batch_size=list(batch)), layer


def run(cls: Any, model: nn.Module, td: TensorDict, *args: Any, prepare: dict | None = None, **kwargs: Any,
        ) -> TensorDict:
    with cls(*args, **kwargs).prepare(model, **(prepare or {})) as hooked:
        return hooked(td.clone())  # type: ignore[no-any-return]


def compare(model: nn.Module, td: TensorDict, *args: Any, **kwargs: Any) -> TensorDict:
    """Same keys, shapes and values (tdhook's intermediate ``_working`` entries aside)."""
    ref = run(REF, copy.deepcopy(model), td, *args, **kwargs).exclude("_working")
    ours = run(OURS, model, td, *args, **kwargs)
    assert_same(ref, ours)
    return ours


def test_surface() -> None:
    assert inspect.signature(OURS.__init__).parameters.keys() == inspect.signature(REF.__init__).parameters.keys()
    for name, ref in inspect.signature(REF.__init__).parameters.items():
        ours = inspect.signature(OURS.__init__).parameters[name]
        assert (ours.kind, ours.default) == (ref.kind, ref.default), name
    assert "ActivationMaximisation" in tdhook_fn.compat.attribution.__all__
    module = tdhook_fn.compat.attribution.activation_maximisation
    assert module.ActivationMaximisation is OURS and tdhook.attribution.activation_maximisation is not None
    with REF(["module[0]"]).prepare(mlp()) as ref, OURS(["module[0]"]).prepare(mlp()) as ours:
        assert ours.relative_path == ref.relative_path


@pytest.mark.parametrize(("name", "batch", "dtype"), GRID)
def test_values(name: str, batch: tuple[int, ...], dtype: torch.dtype) -> None:
    model, td, layer = model_and_data(name, batch, dtype)
    out = compare(model, td, [layer])  # tdhook's defaults: ten steps of 0.1, no bounds
    assert set(out.keys(True, True)) == {"input", ("attr", "input")} and out.batch_size == td.batch_size
    compare(model, td, [layer], alpha=0.05, n_steps=3, min_value=-0.5, max_value=0.7)


@pytest.mark.parametrize("name", list(MODELS))
def test_options(name: str) -> None:
    model, td, layer = model_and_data(name)
    compare(model, td, ["module[0]", "module"], n_steps=2)  # "module": the whole model, its output
    pick = lambda targets, additional: TensorDict(o=targets[layer].flatten(1)[:, 1], batch_size=targets.batch_size)
    compare(model, td, [layer], n_steps=2, init_attr_targets=pick)
    doubled = lambda targets, additional: targets.apply(lambda v: 2 * torch.ones_like(v))
    compare(model, td, [layer], n_steps=2, init_attr_grads=doubled)
    out = compare(model, td, [layer], n_steps=2, attribution_key=("am", "x"), clean_intermediate_keys=False)
    assert ("am", "x", "input") in out.keys(True, True)
    out = compare(model, td, [layer], n_steps=0)
    assert torch.equal(out["attr", "input"], td["input"])


def test_keys_of_the_context() -> None:
    model, td, layer = model_and_data("mlp")
    renamed = TensorDict(x=td["input"], batch_size=[3])
    out = compare(model, renamed, [layer], n_steps=3, prepare={"in_keys": ["x"], "out_keys": ["y"]})
    assert set(out.keys(True, True)) == {"x", ("attr", "x")}
    wrapped = TensorDictModule(model, ["x"], ["y"])  # paths start at the TensorDictModule there too
    ref = run(REF, copy.deepcopy(wrapped), renamed, [layer], n_steps=3)
    assert_same(ref, run(OURS, wrapped, renamed, [layer], n_steps=3))
    assert_same(ref, out)


def test_computed_by_the_pure_method() -> None:
    model, td, _ = model_and_data("cnn", dtype=torch.float64)
    out = run(OURS, model, td, ["module[4]"], n_steps=4, max_value=1.0)
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    everything = lambda o: o.select("[4]")
    pure = activation_maximisation(f, p, td, target=everything, target_layers=["[4]"], n_steps=4, max_value=1.0)
    assert torch.equal(out["attr", "input"], pure["input"])


def test_additional_init_keys_reach_the_callables() -> None:
    """tdhook 0.1.3 fails here (its Saliency runs on a copy of the inputs without them)."""
    model, td, layer = model_and_data("mlp", dtype=torch.float64)
    td["label"] = torch.tensor([2, 0, 1])
    pick = lambda targets, additional: TensorDict(
        o=targets[layer].gather(1, additional["label"][:, None]), batch_size=targets.batch_size)
    kwargs = {"n_steps": 3, "init_attr_targets": pick, "additional_init_keys": ["label"]}
    with pytest.raises(KeyError, match="label"):
        run(REF, copy.deepcopy(model), td, [layer], **kwargs)
    out = run(OURS, model, td, [layer], **kwargs)
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    pure = activation_maximisation(f, p, td, target=tdhook_fn.label("label"), n_steps=3)
    torch.testing.assert_close(out["attr", "input"], pure["input"], rtol=1e-12, atol=1e-12)


def test_model_and_inputs_untouched() -> None:
    model, td, layer = model_and_data("cnn")
    before, x, x_before = snapshot(model), td["input"], td["input"].clone()
    with OURS([layer], n_steps=3).prepare(model) as hooked:
        out = hooked(td)
    assert same(before, snapshot(model))
    assert td["input"] is x and torch.equal(x, x_before) and not x.requires_grad
    assert not out["attr", "input"].requires_grad


@pytest.mark.parametrize(("modules", "error", "match"), [
    ([], ValueError, "modules_to_maximise is empty"),
    ("module[2]", TypeError, r"write \['module\[2\]'\]"),
])
def test_bad_constructor(modules: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        OURS(modules)


@pytest.mark.parametrize(("modules", "match"), [
    (["[2]"], r"paths start at the context's TensorDictModule.*'module\[2\]'"),
    (["module[0].weight"], "is not a module of the model"),
    (["module[2]", "module.2"], "names a module already in modules_to_maximise"),
    (["module[7]"], "module\\[7\\]"),
])
def test_bad_paths_fail_on_entry(modules: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match), OURS(modules).prepare(mlp()):
        pass


def test_bad_options_fail_on_calling() -> None:
    model, td, layer = model_and_data("mlp")
    with pytest.raises(ValueError, match="activation_maximisation: min_value .* above max_value"):
        run(OURS, model, td, [layer], min_value=1.0, max_value=0.0)
    with pytest.raises(TypeError, match="activation_maximisation: n_steps must be an int"):
        run(OURS, model, td, [layer], n_steps=math.inf)
