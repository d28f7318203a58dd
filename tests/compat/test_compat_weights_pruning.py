"""tdhook_fn.compat.weights.Pruning side by side with tdhook 0.1.3's Pruning."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import tdhook.contexts
import tdhook.weights
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from zoo import Blocks, same, snapshot

import tdhook_fn.compat.contexts
import tdhook_fn.compat.weights

X = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))


def make_blocks() -> nn.Module:
    torch.manual_seed(0)
    return Blocks().eval()


def importance(module_key: str, parameter_name: str, parameter: torch.Tensor) -> torch.Tensor:
    """Magnitude with a per-module offset, so that the choice depends on the key."""
    return parameter.detach().abs() + 0.01 * len(module_key)


def matrices_only(module_key: str, parameter_name: str, parameter: torch.Tensor) -> torch.Tensor | None:
    return parameter.detach().abs() if parameter.dim() > 1 else None


STRUCTURED = {"layers[0]": (0, 0.5), "<block0/module>[0]": (1, 2), "heads['main']": (1, None), "fn(2)": (0, 0)}
CONFIGS: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {
    "global_float": (importance, {"amount_to_prune": 0.3}),
    "global_int": (importance, {"amount_to_prune": 17}),
    "global_skip": (importance, {"amount_to_prune": 0.5, "skip_modules": "default_skip"}),
    "global_relative": (importance, {"amount_to_prune": 0.4, "relative_path": "layers"}),
    "global_relative_slash": (importance, {"amount_to_prune": 3, "relative_path": "<block0/module>"}),
    "global_matrices": (matrices_only, {"amount_to_prune": 0.6}),
    "structured": (matrices_only, {"modules_to_prune": STRUCTURED, "amount_to_prune": 0.25}),
    "structured_no_global": (matrices_only, {"modules_to_prune": {"heads.aux": (1, 0.5), "layers[1]": (0, 3)}}),
}


def factory(lib: Any, name: str, log: list[tuple[str, str, int]] | None = None) -> Any:
    callback, kwargs = CONFIGS[name]
    kwargs = dict(kwargs)
    if kwargs.get("skip_modules") == "default_skip":
        kwargs["skip_modules"] = lib.Pruning.default_skip

    def logged(module_key: str, parameter_name: str, parameter: torch.Tensor) -> Any:
        if log is not None:
            log.append((module_key, parameter_name, id(parameter)))
        return callback(module_key=module_key, parameter_name=parameter_name, parameter=parameter)

    return lib.Pruning(logged, **kwargs)


def run_pruned(lib: Any, name: str, model: nn.Module) -> dict[str, Any]:
    log: list[tuple[str, str, int]] = []
    names = {id(p): n for n, p in model.named_parameters()}
    with factory(lib, name, log).prepare(model) as hooked:
        hooked_out = hooked(TensorDict(input=X, batch_size=[5]))["output"].detach()
        raw_out = model(X).detach()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        "hooked": hooked_out,
        "raw": raw_out,
        "params": params,
        "calls": [(key, pname, names[ident]) for key, pname, ident in log],  # the model's own Parameters
    }


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pruned_model_matches_tdhook_and_is_restored(name: str) -> None:
    model = make_blocks()
    before = snapshot(model)
    ref = run_pruned(tdhook.weights, name, copy.deepcopy(model))
    ours = run_pruned(tdhook_fn.compat.weights, name, model)
    assert same(before, snapshot(model))
    assert ours["calls"] == ref["calls"]
    assert torch.equal(ours["hooked"], ref["hooked"])
    assert torch.equal(ours["raw"], ref["raw"])
    assert ours["params"].keys() == ref["params"].keys()
    for key, value in ref["params"].items():
        assert torch.equal(ours["params"][key], value), key
    zeros = sum(int((p == 0).sum()) for p in ours["params"].values())
    assert zeros > 0
    assert not torch.equal(ours["raw"], model(X))  # pruning changed something, now undone


def test_amounts_are_counted_like_torch_prune() -> None:
    model = make_blocks()
    total = sum(p.numel() for p in model.parameters())
    with factory(tdhook_fn.compat.weights, "global_int").prepare(model):
        assert sum(int((p == 0).sum()) for p in model.parameters()) == 17
    with factory(tdhook_fn.compat.weights, "global_float").prepare(model):
        assert sum(int((p == 0).sum()) for p in model.parameters()) == round(0.3 * total)
    with factory(tdhook_fn.compat.weights, "structured").prepare(model):
        assert int((model.layers[0].weight == 0).all(dim=1).sum()) == 2  # dim 0, half of 4 rows
        assert int((getattr(model, "block0/module")[0].weight == 0).all(dim=0).sum()) == 2  # dim 1, 2 columns
        assert int((model.heads["main"].weight == 0).all(dim=0).sum()) == 1  # None -> 0.25 of 4 columns
        assert int((model.layers[2].weight == 0).all(dim=1).sum()) == 1  # 0 -> 0.25 of 4 rows (tdhook's `or`)
    assert sum(int((p == 0).sum()) for p in model.parameters()) == 0


def test_parameters_keep_identity_and_order() -> None:
    model = make_blocks()
    order = [(n, id(p)) for n, p in model.named_parameters()]
    hooks = snapshot(model)["hooks"]
    with factory(tdhook_fn.compat.weights, "global_float").prepare(model) as hooked:
        hooked(TensorDict(input=X, batch_size=[5]))
        assert [(n, id(p)) for n, p in model.named_parameters()] == order
        assert snapshot(model)["hooks"] == hooks  # no hook on the model
    assert [(n, id(p)) for n, p in model.named_parameters()] == order


def test_restored_when_the_body_raises() -> None:
    for lib in (tdhook.weights, tdhook_fn.compat.weights):
        model = make_blocks()
        before = snapshot(model)
        with pytest.raises(KeyError, match="boom"), factory(lib, "global_float").prepare(model):
            assert (model.layers[0].weight == 0).any() or (model.heads["main"].weight == 0).any()
            raise KeyError("boom")
        assert same(before, snapshot(model))


def test_failing_importance_leaves_the_model_untouched() -> None:
    calls = []

    def flaky(module_key: str, parameter_name: str, parameter: torch.Tensor) -> torch.Tensor:
        calls.append(module_key)
        if len(calls) == 4:
            raise ArithmeticError("no score")
        return parameter.detach().abs()

    model = make_blocks()
    before = snapshot(model)
    context = tdhook_fn.compat.weights.Pruning(flaky, 0.5).prepare(model)
    with pytest.raises(ArithmeticError, match="no score"):
        context.__enter__()
    assert same(before, snapshot(model))
    assert not context._in_context


def test_bad_structured_pruning_leaves_the_model_untouched() -> None:
    """A bias (1-d) cannot be pruned by slices: tdhook raises after pruning some weights."""
    modules = {"layers[0]": (0, 0.5), "layers[1]": (0, 0.5)}
    ref_model, model = make_blocks(), make_blocks()
    with pytest.raises(ValueError, match="multidimensional"):
        with tdhook.weights.Pruning(importance, modules_to_prune=modules).prepare(ref_model):
            pass
    assert (ref_model.layers[0].weight == 0).any()  # tdhook left it pruned
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"'layers\[0\]', parameter 'bias'"):
        with tdhook_fn.compat.weights.Pruning(importance, modules_to_prune=modules).prepare(model):
            pass
    assert same(before, snapshot(model))


def test_failure_after_pruning_restores() -> None:
    class Failing(tdhook_fn.compat.weights.Pruning):
        def _hook_module(self, module: Any) -> Any:
            assert (module.module.layers[0].weight == 0).any() or (module.module.heads.main.weight == 0).any()
            raise RuntimeError("hooking failed")

    model = make_blocks()
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="hooking failed"), Failing(importance, 0.5).prepare(model):
        pass
    assert same(before, snapshot(model))


@pytest.mark.parametrize("lib", [tdhook.weights, tdhook_fn.compat.weights], ids=["tdhook", "ours"])
def test_needs_an_amount_or_modules(lib: Any) -> None:
    with pytest.raises(ValueError, match="`amount_to_prune` is required for global pruning"):
        lib.Pruning(importance)


def test_bad_amount_is_refused_before_pruning() -> None:
    model = make_blocks()
    before = snapshot(model)
    total = sum(p.numel() for p in model.parameters())
    for amount in (1.5, total + 1):
        with (
            pytest.raises(ValueError, match="amount"),
            tdhook.weights.Pruning(importance, amount).prepare(copy.deepcopy(model)),
        ):
            pass
        with (
            pytest.raises(ValueError, match="amount"),
            tdhook_fn.compat.weights.Pruning(importance, amount).prepare(model),
        ):
            pass
        assert same(before, snapshot(model))


def test_default_skip_matches_tdhook() -> None:
    model = make_blocks()
    wrapped = TensorDictModule(model, ["input"], ["output"])
    cases = [("", model), ("module", nn.Linear(2, 2)), ("td_module", nn.Linear(2, 2)), ("x", wrapped)]
    cases += [(name, m) for name, m in model.named_modules()]
    cases += [("seq", nn.Sequential()), ("list", nn.ModuleList()), ("dict", nn.ModuleDict()), ("", nn.ModuleDict())]
    for name, module in cases:
        assert tdhook_fn.compat.weights.Pruning.default_skip(name, module) == tdhook.weights.Pruning.default_skip(
            name, module
        ), name


def test_tensordict_module_and_gradient_importance() -> None:
    """Relevance pruning: the callback reads .grad of the model's own parameters."""

    def relevance(module_key: str, parameter_name: str, parameter: torch.Tensor) -> torch.Tensor:
        return (parameter * parameter.grad).detach()

    results = []
    for lib in (tdhook.weights, tdhook_fn.compat.weights):
        model = make_blocks()
        model(X).pow(2).sum().backward()
        td_module = TensorDictModule(model, ["x"], ["y"])
        before = snapshot(model)
        pruning = lib.Pruning(relevance, 0.4, skip_modules=lib.Pruning.default_skip, relative_path="module")
        with pruning.prepare(td_module) as hooked:
            out = hooked(TensorDict(x=X, batch_size=[5]))["y"].detach()
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert same(before, snapshot(model)) or lib is tdhook.weights
        results.append((out, params))
    (ref_out, ref_params), (out, params) = results
    assert torch.equal(out, ref_out)
    assert all(torch.equal(params[k], v) for k, v in ref_params.items())


def test_prepare_without_context_and_restore() -> None:
    model = make_blocks()
    before = snapshot(model)
    hooked = factory(tdhook_fn.compat.weights, "structured").prepare(model, return_context=False)
    assert (model.layers[0].weight == 0).any()
    hooked.restore()
    assert same(before, snapshot(model))


def test_nested_contexts_restore_in_order() -> None:
    model = make_blocks()
    before = snapshot(model)
    with factory(tdhook_fn.compat.weights, "global_int").prepare(model):
        once = {n: p.detach().clone() for n, p in model.named_parameters()}
        with factory(tdhook_fn.compat.weights, "structured").prepare(model):
            assert sum(int((p == 0).sum()) for p in model.parameters()) > 17
        assert all(torch.equal(p, once[n]) for n, p in model.named_parameters())
    assert same(before, snapshot(model))


def test_composite_factories() -> None:
    """A composite restores only with a PruningContext; with another context class it is refused."""

    class Restoring(tdhook_fn.compat.contexts.CompositeHookingContextFactory):
        _hooking_context_class = tdhook_fn.compat.weights.pruning.PruningContext

    class OtherContext(tdhook_fn.compat.contexts.HookingContext):
        pass

    class Plain(tdhook_fn.compat.contexts.CompositeHookingContextFactory):
        _hooking_context_class = OtherContext

    model = make_blocks()
    before = snapshot(model)
    ref = run_pruned(tdhook.weights, "global_int", copy.deepcopy(model))
    with Restoring(factory(tdhook_fn.compat.weights, "global_int")).prepare(model):
        assert all(torch.equal(p, ref["params"][n]) for n, p in model.named_parameters())
    assert same(before, snapshot(model))
    with (
        pytest.raises(RuntimeError, match="PruningContext"),
        Plain(factory(tdhook_fn.compat.weights, "global_int")).prepare(model),
    ):
        pass
    assert same(before, snapshot(model))
