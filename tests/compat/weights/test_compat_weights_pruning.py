"""tdhook_fn.compat.weights.Pruning side by side with tdhook 0.1.3's Pruning.

tdhook prunes the model in place inside the context; ours never writes it: the hooked
module's calls run with pruned params. So tdhook's pruned weights are compared with the
params our hooked module runs with, and our model is checked untouched inside the context.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import tdhook.attribution
import tdhook.contexts
import tdhook.weights
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from zoo import Blocks, same, snapshot

import tdhook_fn
import tdhook_fn.compat.attribution
import tdhook_fn.compat.contexts
import tdhook_fn.compat.weights

X = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
OURS = tdhook_fn.compat.weights


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


Frozen = dict[str, tuple[int, torch.Tensor]]


def freeze(model: nn.Module) -> Frozen:
    """Storage address and a copy of every parameter and buffer."""
    return {n: (t.data_ptr(), t.detach().clone()) for n, t in [*model.named_parameters(), *model.named_buffers()]}


def assert_untouched(model: nn.Module, frozen: Frozen) -> None:
    now = dict([*model.named_parameters(), *model.named_buffers()])
    assert now.keys() == frozen.keys()
    for name, (ptr, value) in frozen.items():
        assert now[name].data_ptr() == ptr, name
        assert torch.equal(now[name].detach(), value), name


def hooked_output(hooked: Any) -> torch.Tensor:
    return hooked(TensorDict(input=X, batch_size=[5]))["output"].detach()  # type: ignore[no-any-return]


def pruned_params(hooked: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters our hooked module runs with (its prepared RoutedModule's params)."""
    names = {n for n, _ in model.named_parameters()}
    params = hooked.td_module.params()
    return {".".join(k): v.detach().clone() for k, v in params.items(True, True) if ".".join(k) in names}


def run_pruned(lib: Any, name: str, model: nn.Module) -> dict[str, Any]:
    log: list[tuple[str, str, int]] = []
    names = {id(p): n for n, p in model.named_parameters()}
    frozen = freeze(model)
    with factory(lib, name, log).prepare(model) as hooked:
        out = hooked_output(hooked)
        raw_out = model(X).detach()
        if lib is OURS:
            assert_untouched(model, frozen)  # inside the context
            params = pruned_params(hooked, model)
        else:
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        "hooked": out,
        "raw": raw_out,
        "params": params,
        "calls": [(key, pname, names[ident]) for key, pname, ident in log],  # the model's own Parameters
    }


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hooked_module_matches_tdhook_and_model_is_untouched(name: str) -> None:
    model = make_blocks()
    before = snapshot(model)
    plain = model(X).detach()
    ref = run_pruned(tdhook.weights, name, copy.deepcopy(model))
    ours = run_pruned(OURS, name, model)
    assert same(before, snapshot(model))
    assert ours["calls"] == ref["calls"]
    assert torch.equal(ours["hooked"], ref["hooked"])
    assert torch.equal(ours["raw"], plain)  # tdhook: the raw model is pruned inside the context
    assert not torch.equal(ref["raw"], plain)
    assert ours["params"].keys() == ref["params"].keys()
    for key, value in ref["params"].items():
        assert torch.equal(ours["params"][key], value), key
    assert sum(int((p == 0).sum()) for p in ours["params"].values()) > 0


@pytest.mark.parametrize("name", ["global_float", "structured"])
def test_gradients_match_tdhook(name: str) -> None:
    """tdhook's model holds the pruned values: .grad is the gradient there, pruned entries included."""
    grads = []
    for lib in (tdhook.weights, OURS):
        model = make_blocks()
        frozen = freeze(model)
        with factory(lib, name).prepare(model) as hooked:
            hooked(TensorDict(input=X, batch_size=[5]))["output"].pow(2).sum().backward()
            if lib is OURS:
                assert_untouched(model, frozen)
        grads.append({n: p.grad for n, p in model.named_parameters()})
    ref, ours = grads
    assert ref.keys() == ours.keys()
    for key, grad in ref.items():
        assert grad is not None and ours[key] is not None, key
        assert torch.equal(ours[key], grad), key
    assert any((grad != 0).any() for grad in ours.values())


def test_inference_mode_then_gradients() -> None:
    model = make_blocks()
    ref = run_pruned(tdhook.weights, "global_float", copy.deepcopy(model))["hooked"]
    with torch.inference_mode():
        context = factory(OURS, "global_float").prepare(model)
        hooked = context.__enter__()
        assert torch.equal(hooked_output(hooked), ref)
    hooked(TensorDict(input=X, batch_size=[5]))["output"].sum().backward()
    with torch.inference_mode():
        assert torch.equal(hooked_output(hooked), ref)
    context.__exit__(None, None, None)
    assert model.layers[0].weight.grad is not None


def test_amounts_are_counted_like_torch_prune() -> None:
    model = make_blocks()
    frozen = freeze(model)
    total = sum(p.numel() for p in model.parameters())

    def zeros(name: str) -> dict[str, torch.Tensor]:
        with factory(OURS, name).prepare(model) as hooked:
            return pruned_params(hooked, model)

    assert sum(int((p == 0).sum()) for p in zeros("global_int").values()) == 17
    assert sum(int((p == 0).sum()) for p in zeros("global_float").values()) == round(0.3 * total)
    pruned = zeros("structured")
    assert int((pruned["layers.0.weight"] == 0).all(dim=1).sum()) == 2  # dim 0, half of 4 rows
    assert int((pruned["block0/module.0.weight"] == 0).all(dim=0).sum()) == 2  # dim 1, 2 columns
    assert int((pruned["heads.main.weight"] == 0).all(dim=0).sum()) == 1  # None -> 0.25 of 4 columns
    assert int((pruned["layers.2.weight"] == 0).all(dim=1).sum()) == 1  # 0 -> 0.25 of 4 rows (tdhook's `or`)
    assert_untouched(model, frozen)


def test_params_taken_before_are_untouched_inside() -> None:
    """tdhook_fn.params(model) shares the model's storage: pure calls with it stay unpruned."""
    model = make_blocks()
    taken = tdhook_fn.params(model)
    expected = tdhook_fn.call(model, taken, X)
    copies = taken.clone()
    with factory(OURS, "global_float").prepare(model) as hooked:
        assert not torch.equal(hooked_output(hooked), expected)
        assert torch.equal(tdhook_fn.call(model, taken, X), expected)
        assert (taken == copies).all()


def test_a_parameter_changed_inside_is_used_changed_and_still_masked() -> None:
    model = make_blocks()
    with factory(OURS, "global_float").prepare(model) as hooked:
        before = pruned_params(hooked, model)
        with torch.no_grad():
            model.layers[0].weight.mul_(2)  # the user's own in-place change (an optimizer step)
        after = pruned_params(hooked, model)
        expected = {tuple(k.split(".")): v for k, v in after.items()}
        assert torch.equal(hooked_output(hooked), tdhook_fn.call(model, TensorDict(expected, batch_size=[]), X))
        with torch.no_grad():
            model.layers[0].weight.div_(2)
        assert all(torch.equal(v, before[k]) for k, v in pruned_params(hooked, model).items())
    assert torch.equal(after["layers.0.weight"], 2 * before["layers.0.weight"])
    assert all(torch.equal(v, before[k]) for k, v in after.items() if k != "layers.0.weight")


def test_a_write_through_data_inside_is_used_and_still_masked() -> None:
    """``.data`` moves no version counter: the pruned values are made at each call, never kept."""
    model = make_blocks()
    with factory(OURS, "global_float").prepare(model) as hooked:
        before = hooked_output(hooked)
        model.layers[0].weight.data.mul_(2)  # a hand-written training loop's update
        model.layers[0].bias.data[0] = 5.0
        after = pruned_params(hooked, model)
        expected = {tuple(k.split(".")): v for k, v in after.items()}
        out = hooked_output(hooked)
        assert not torch.equal(out, before)
        assert torch.equal(out, tdhook_fn.call(model, TensorDict(expected, batch_size=[]), X))
        assert float(after["layers.0.bias"][0]) in (0.0, 5.0)  # masked where the mask prunes it


def test_parameters_keep_identity_and_order() -> None:
    model = make_blocks()
    order = [(n, id(p), p.data_ptr()) for n, p in model.named_parameters()]
    hooks = snapshot(model)["hooks"]
    with factory(OURS, "global_float").prepare(model) as hooked:
        hooked(TensorDict(input=X, batch_size=[5]))
        assert [(n, id(p), p.data_ptr()) for n, p in model.named_parameters()] == order
        assert snapshot(model)["hooks"] == hooks  # no hook on the model
    assert [(n, id(p), p.data_ptr()) for n, p in model.named_parameters()] == order


def test_model_unchanged_when_the_body_raises() -> None:
    ref_model = make_blocks()
    before = snapshot(ref_model)
    with pytest.raises(KeyError, match="boom"), factory(tdhook.weights, "global_float").prepare(ref_model):
        assert (ref_model.layers[0].weight == 0).any() or (ref_model.heads["main"].weight == 0).any()
        raise KeyError("boom")
    assert same(before, snapshot(ref_model))  # tdhook restores on exit

    model = make_blocks()
    before, frozen = snapshot(model), freeze(model)
    with pytest.raises(KeyError, match="boom"), factory(OURS, "global_float").prepare(model) as hooked:
        hooked_output(hooked)
        assert_untouched(model, frozen)
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
    context = OURS.Pruning(flaky, 0.5).prepare(model)
    with pytest.raises(ArithmeticError, match="no score"):
        context.__enter__()
    assert same(before, snapshot(model))
    assert not context._in_context


def test_bad_structured_pruning_leaves_the_model_untouched() -> None:
    """A bias (1-d) cannot be pruned by slices: tdhook raises after pruning some weights. Both score every module
    before the first fails (a callback that counts or logs sees the same calls)."""
    modules = {"layers[0]": (0, 0.5), "layers[1]": (0, 0.5)}
    ref_model, model = make_blocks(), make_blocks()
    theirs: list[tuple[str, str]] = []
    ours: list[tuple[str, str]] = []

    def logged(log: list[tuple[str, str]]) -> Callable[..., Any]:
        def score(module_key: str, parameter_name: str, parameter: torch.Tensor) -> torch.Tensor:
            log.append((module_key, parameter_name))
            return importance(module_key, parameter_name, parameter)
        return score

    with pytest.raises(ValueError, match="multidimensional"):
        with tdhook.weights.Pruning(logged(theirs), modules_to_prune=modules).prepare(ref_model):
            pass
    assert (ref_model.layers[0].weight == 0).any()  # tdhook left it pruned
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"'layers\[0\]', parameter 'bias'"):
        with OURS.Pruning(logged(ours), modules_to_prune=modules).prepare(model):
            pass
    assert same(before, snapshot(model))
    assert ours == theirs and {key for key, _ in ours} == set(modules)


def test_mask_of_the_wrong_shape_is_refused_on_entry() -> None:
    model = make_blocks()
    before = snapshot(model)
    pruning = OURS.Pruning(lambda module_key, parameter_name, parameter: torch.ones(3), 0.5)
    with pytest.raises(ValueError, match="shape"), pruning.prepare(model):
        pass
    assert same(before, snapshot(model))


def test_failure_after_preparing_leaves_the_model_untouched() -> None:
    class Failing(OURS.Pruning):
        def _hook_module(self, module: Any) -> Any:
            assert any((p == 0).any() for p in module.td_module.params().values(True, True))
            raise RuntimeError("hooking failed")

    model = make_blocks()
    before = snapshot(model)
    context = Failing(importance, 0.5).prepare(model)
    with pytest.raises(RuntimeError, match="hooking failed"), context:
        pass
    assert same(before, snapshot(model))
    assert not context._in_context


def test_prepare_without_context_and_restore() -> None:
    model = make_blocks()
    before, frozen = snapshot(model), freeze(model)
    ref = run_pruned(tdhook.weights, "structured", copy.deepcopy(model))
    hooked = factory(OURS, "structured").prepare(model, return_context=False)
    assert torch.equal(hooked_output(hooked), ref["hooked"])
    assert_untouched(model, frozen)
    hooked.restore()
    assert same(before, snapshot(model))


def test_disable_yields_the_unpruned_model() -> None:
    model = make_blocks()
    plain = model(X).detach()
    with factory(OURS, "global_float").prepare(model) as hooked:
        with hooked.disable_context() as raw:
            assert raw is model
            assert torch.equal(raw(X), plain)
        assert not torch.equal(hooked_output(hooked), plain)


@pytest.mark.parametrize("first_out", ["first_in", "last_in"])
def test_overlapping_contexts_leave_the_model_unchanged(first_out: str) -> None:
    """Each context gives its own pruned results, whatever the order they exit in."""
    model = make_blocks()
    before, frozen = snapshot(model), freeze(model)
    refs = {name: run_pruned(tdhook.weights, name, copy.deepcopy(model))["hooked"] for name in CONFIGS}
    shared = factory(OURS, "global_float")  # one factory, two contexts: masks are per context
    contexts = {
        "global_int": factory(OURS, "global_int").prepare(model),
        "structured": factory(OURS, "structured").prepare(model),
        "global_float": shared.prepare(model),
        "global_float_again": shared.prepare(model),
    }
    hooked = {name: context.__enter__() for name, context in contexts.items()}
    order = list(contexts) if first_out == "first_in" else list(reversed(contexts))
    for name in order:
        for open_name, module in hooked.items():
            assert torch.equal(hooked_output(module), refs[open_name.removesuffix("_again")]), open_name
        assert_untouched(model, frozen)
        contexts[name].__exit__(None, None, None)
        del hooked[name]
        assert_untouched(model, frozen)
    assert same(before, snapshot(model))


def test_tensordict_module_and_gradient_importance() -> None:
    """Relevance pruning: the callback reads .grad of the model's own parameters."""

    def relevance(module_key: str, parameter_name: str, parameter: torch.Tensor) -> torch.Tensor:
        return (parameter * parameter.grad).detach()

    results = []
    for lib in (tdhook.weights, OURS):
        model = make_blocks()
        model(X).pow(2).sum().backward()
        td_module = TensorDictModule(model, ["x"], ["y"])
        before, frozen = snapshot(model), freeze(model)
        pruning = lib.Pruning(relevance, 0.4, skip_modules=lib.Pruning.default_skip, relative_path="module")
        with pruning.prepare(td_module) as hooked:
            out = hooked(TensorDict(x=X, batch_size=[5]))["y"].detach()
            if lib is OURS:
                assert_untouched(model, frozen)
                params = {k.removeprefix("module."): v for k, v in pruned_params(hooked, td_module).items()}
            else:
                params = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert same(before, snapshot(model))
        results.append((out, params))
    (ref_out, ref_params), (out, params) = results
    assert torch.equal(out, ref_out)
    assert params.keys() == ref_params.keys()
    assert all(torch.equal(params[k], v) for k, v in ref_params.items())


def test_buffers_update_as_a_plain_forward() -> None:
    """BatchNorm in training mode: the hooked module's call updates the model's buffers in place."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).train()

    results = []
    for lib in (tdhook.weights, OURS):
        model = make()
        buffers = {n: b for n, b in model.named_buffers()}
        with factory(lib, "global_float").prepare(model) as hooked:
            out = hooked_output(hooked)
            stats = {n: b.clone() for n, b in model.named_buffers()}
        results.append((out, stats))
        if lib is OURS:
            assert all(b is buffers[n] for n, b in model.named_buffers())
            assert all(torch.equal(b, stats[n]) for n, b in model.named_buffers())  # not reset on exit
    (ref_out, ref_stats), (out, stats) = results
    assert torch.equal(out, ref_out)
    assert all(torch.equal(stats[n], b) for n, b in ref_stats.items())
    assert int(stats["1.num_batches_tracked"]) == 1


def test_composite_factories() -> None:
    """Any context class works: nothing is written, so nothing needs restoring."""

    class Restoring(tdhook_fn.compat.contexts.CompositeHookingContextFactory):
        _hooking_context_class = OURS.pruning.PruningContext

    class OtherContext(tdhook_fn.compat.contexts.HookingContext):
        pass

    class Plain(tdhook_fn.compat.contexts.CompositeHookingContextFactory):
        _hooking_context_class = OtherContext

    model = make_blocks()
    before, frozen = snapshot(model), freeze(model)
    ref = run_pruned(tdhook.weights, "global_int", copy.deepcopy(model))
    for composite in (Restoring, Plain):
        with composite(factory(OURS, "global_int")).prepare(model) as hooked:
            assert torch.equal(hooked_output(hooked), ref["hooked"])
            assert_untouched(model, frozen)
    assert same(before, snapshot(model))


def test_composite_with_an_attribution_attributes_the_pruned_model() -> None:
    """A method composed after Pruning sees the pruned params (tdhook: the pruned model)."""

    def scenario(lib: Any) -> torch.Tensor:
        class Composite(lib.contexts.CompositeHookingContextFactory):
            _hooking_context_class = lib.weights.pruning.PruningContext

        def target(td: TensorDict, _: Any) -> TensorDict:
            return TensorDict(out=td["output"][..., 0], batch_size=td.batch_size)

        model = make_blocks()
        frozen = freeze(model)
        pruning, saliency = factory(lib.weights, "global_float"), lib.attribution.Saliency(init_attr_targets=target)
        with Composite(pruning, saliency).prepare(model) as hooked:
            attr = hooked(TensorDict(input=X, batch_size=[5]))["attr", "input"].detach()
            if lib is not tdhook:
                assert_untouched(model, frozen)
        return attr  # type: ignore[no-any-return]

    ref, ours = scenario(tdhook), scenario(tdhook_fn.compat)
    assert torch.equal(ours, ref)
    model = make_blocks()
    with tdhook_fn.compat.attribution.Saliency(
        init_attr_targets=lambda td, _: TensorDict(out=td["output"][..., 0], batch_size=td.batch_size)
    ).prepare(model) as hooked:
        assert not torch.equal(hooked(TensorDict(input=X, batch_size=[5]))["attr", "input"], ours)


def test_pre_factories() -> None:
    """A Pruning context with a pre-factory prunes the calls of the pre-factory's hooked module."""

    def scenario(lib: Any) -> torch.Tensor:
        class Zeroing(lib.contexts.HookingContextFactory):
            def _hook_module(self, module: Any) -> Any:
                return module.set("module.heads['aux']", None, callback=lambda output, **kw: output * 0)

        class WithPre(lib.weights.Pruning):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self._hooking_context_kwargs["pre_factories"] = [Zeroing()]

        model = make_blocks()
        frozen = freeze(model)
        with WithPre(importance, 0.3).prepare(model) as hooked:
            out = hooked_output(hooked)
            if lib is not tdhook:
                assert_untouched(model, frozen)
        return out

    ref, ours = scenario(tdhook), scenario(tdhook_fn.compat)
    assert torch.equal(ours, ref)
    model = make_blocks()
    with factory(OURS, "global_float").prepare(model) as hooked:
        assert not torch.equal(ours, hooked_output(hooked))  # the pre-factory's zeroing happened


@pytest.mark.parametrize("lib", [tdhook.weights, OURS], ids=["tdhook", "ours"])
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
            OURS.Pruning(importance, amount).prepare(model),
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
        assert OURS.Pruning.default_skip(name, module) == tdhook.weights.Pruning.default_skip(name, module), name


def test_a_composite_of_pruning_and_caching_needs_a_context_with_a_cache() -> None:
    """Its context class holds the cache: PruningContext has none (a clear error), HookingContextWithCache has."""
    from tdhook_fn.compat.contexts import CompositeHookingContextFactory, HookingContextWithCache
    from tdhook_fn.compat.latent import ActivationCaching
    from tdhook_fn.compat.weights.pruning import PruningContext

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    magnitude = lambda module_key, parameter_name, parameter: parameter.abs()
    Pruning = tdhook_fn.compat.weights.Pruning

    class Pruned(CompositeHookingContextFactory):
        _hooking_context_class = PruningContext

    class Cached(CompositeHookingContextFactory):
        _hooking_context_class = HookingContextWithCache

    x = TensorDict(input=torch.ones(3, 4), batch_size=[3])
    with pytest.raises(TypeError, match="PruningContext, which has no cache.*HookingContextWithCache"):
        with Pruned(Pruning(magnitude, 0.5), ActivationCaching("0")).prepare(net) as hooked:
            hooked(x.clone())
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    with Cached(Pruning(magnitude, 0.5), ActivationCaching("0")).prepare(net) as hooked:
        out = hooked(x.clone())
        cached = hooked.hooking_context.cache
    with Pruning(magnitude, 0.5).prepare(net) as pruned:
        torch.testing.assert_close(out["output"], pruned(x.clone())["output"])
    assert len(list(cached.keys(True, True))) == 1
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
