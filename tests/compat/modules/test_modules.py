"""tdhook_fn.compat.modules side by side with the oracle, tdhook 0.1.3's tdhook.modules."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest
import tdhook.contexts
import tdhook.hooks
import tdhook.modules
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from zoo import Blocks, mlp

import tdhook_fn
import tdhook_fn.compat.contexts
import tdhook_fn.compat.hooks
import tdhook_fn.compat.modules

REF = types.SimpleNamespace(contexts=tdhook.contexts, modules=tdhook.modules, hooks=tdhook.hooks)
OURS = types.SimpleNamespace(
    contexts=tdhook_fn.compat.contexts, modules=tdhook_fn.compat.modules, hooks=tdhook_fn.compat.hooks
)
Lib = types.SimpleNamespace


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return mlp().eval()


def make_blocks() -> nn.Module:
    torch.manual_seed(0)
    return Blocks().eval()


def inputs(requires_grad: bool = False) -> TensorDict:
    torch.manual_seed(1)
    return TensorDict(input=torch.randn(2, 4, requires_grad=requires_grad), batch_size=[2])


# Keys naming the same submodules of each model, in tdhook's path syntax.
KEYS = {
    "mlp": (make_mlp, {"first": "[0]", "mid": "[1]", "last": "[2]", "other": "[-1]"}),
    "blocks": (
        make_blocks,
        {"first": "<block0/module>[0]", "mid": "layers[1]", "last": "heads['main']", "other": "fn(2)"},
    ),
}
MODELS = pytest.mark.parametrize("name", list(KEYS))


def same(a: Any, b: Any) -> bool:
    """Deep equality: tensors by value, TensorDicts by keys and values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, TensorDict) or isinstance(b, TensorDict):
        if not (isinstance(a, TensorDict) and isinstance(b, TensorDict)) or a.batch_size != b.batch_size:
            return False
        ka, kb = (set(x.keys(include_nested=True, leaves_only=True)) for x in (a, b))
        return ka == kb and all(same(a.get(k), b.get(k)) for k in ka)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def side_by_side(scenario: Callable[[Lib, nn.Module, dict[str, str]], Any], name: str) -> None:
    make, keys = KEYS[name]
    ref, ours = scenario(REF, make(), keys), scenario(OURS, make(), keys)
    assert same(ref, ours), (ref, ours)


def grads(model: nn.Module) -> dict[str, Any]:
    return {n: p.grad for n, p in model.named_parameters()}


@MODELS
def test_forward_matches(name: str) -> None:
    def scenario(lib: Lib, model: nn.Module, keys: dict[str, str]) -> Any:
        with lib.contexts.HookingContextFactory().prepare(model) as hooked:
            td = inputs()
            out = hooked(td)
            return out, out is td

    side_by_side(scenario, name)


@MODELS
def test_get_and_get_input(name: str) -> None:
    def scenario(lib: Lib, model: nn.Module, keys: dict[str, str]) -> Any:
        cache = TensorDict()
        with lib.contexts.HookingContextFactory().prepare(model) as hooked:
            _, p1 = hooked.get(cache, keys["first"])
            _, p2 = hooked.get_input(cache, keys["last"], callback=lambda args, **kw: args[0])
            hooked.get(cache, keys["other"], cache_key="custom")
            hooked.get(cache, keys["mid"], callback=lambda output, **kw: output.sum(-1))
            out = hooked(inputs())
        return out, cache, p1.resolve(), p2.resolve()

    side_by_side(scenario, name)


@MODELS
def test_set_value_callback_and_proxy(name: str) -> None:
    def scenario(lib: Lib, model: nn.Module, keys: dict[str, str]) -> Any:
        cache = TensorDict()
        results = []
        with lib.contexts.HookingContextFactory().prepare(model) as hooked:
            _, proxy = hooked.get(cache, keys["first"])
            h1 = hooked.set(keys["mid"], None, callback=lambda output, value, **kw: output * 3)
            h2 = hooked.set_input(keys["last"], None, callback=lambda args, **kw: (args[0] + 1,))
            results.append(hooked(inputs()))
            h1.remove()
            h2.remove()
            width = hooked(inputs())["output"].shape  # noqa: F841 - a plain call
            hooked.set(keys["other"], proxy) if name == "mlp" else hooked.set(keys["first"], proxy)
            results.append(hooked(inputs()))
            h3 = hooked.set_input(keys["first"], (torch.zeros(2, 4),))
            results.append(hooked(inputs()))
            h3.remove()
        return results

    side_by_side(scenario, name)


@MODELS
def test_prepend_orders_hooks(name: str) -> None:
    def scenario(lib: Lib, model: nn.Module, keys: dict[str, str]) -> Any:
        with lib.contexts.HookingContextFactory().prepare(model) as hooked:
            hooked.set(keys["mid"], None, callback=lambda output, **kw: output * 2)
            hooked.set(keys["mid"], None, callback=lambda output, **kw: output + 1, prepend=True)
            return hooked(inputs())

    side_by_side(scenario, name)


def test_handles_remove_and_work_as_context_managers() -> None:
    def scenario(lib: Lib, model: nn.Module, keys: dict[str, str]) -> Any:
        with lib.contexts.HookingContextFactory().prepare(model) as hooked:
            with hooked.set(keys["mid"], None, callback=lambda output, **kw: output * 0):
                inside = hooked(inputs())
            handle = hooked.stop(keys["first"])
            handle.remove()
            handle.remove()
            return inside, hooked(inputs())

    side_by_side(scenario, "mlp")


@MODELS
def test_gradient_hooks_and_param_grads(name: str) -> None:
    def scenario(lib: Lib, model: nn.Module, keys: dict[str, str]) -> Any:
        cache = TensorDict()
        td = inputs(requires_grad=True)
        with lib.contexts.HookingContextFactory().prepare(model) as hooked:
            hooked.get_grad(cache, keys["mid"], callback=lambda grad_input, **kw: grad_input[0])
            hooked.get_grad_output(cache, keys["first"], callback=lambda grad_output, **kw: grad_output[0])
            hooked.set_grad(keys["last"], None, callback=lambda grad_input, **kw: (grad_input[0] * 3,))
            hooked.set_grad_output(keys["first"], None, callback=lambda grad_output, **kw: (-grad_output[0],))
            out = hooked(td)
            out["output"].pow(2).sum().backward()
        return out, cache, td["input"].grad, grads(model)

    side_by_side(scenario, name)


@MODELS
def test_stop_raises_early_stopping(name: str) -> None:
    def scenario(lib: Lib, model: nn.Module, keys: dict[str, str]) -> Any:
        cache = TensorDict()
        with lib.contexts.HookingContextFactory().prepare(model) as hooked:
            hooked.get(cache, keys["first"])
            handle = hooked.stop(keys["mid"])
            with pytest.raises(lib.hooks.EarlyStoppingException) as caught:
                hooked(inputs())
            handle.remove()
            return str(caught.value), cache, hooked(inputs())

    side_by_side(scenario, name)


def test_relative_false_keys_start_at_the_hooked_module() -> None:
    def scenario(lib: Lib, model: nn.Module, keys: dict[str, str]) -> Any:
        cache = TensorDict()
        with lib.contexts.HookingContextFactory().prepare(model) as hooked:
            hooked.get(cache, "td_module.module.layers[0]", relative=False)
            hooked.set("td_module.module.<block0/module>", None, callback=lambda output, **kw: -output, relative=False)
            return hooked.relative_path, hooked(inputs()), cache

    side_by_side(scenario, "blocks")


def test_hooks_see_the_users_submodule() -> None:
    def scenario(lib: Lib, model: nn.Module, keys: dict[str, str]) -> Any:
        seen = []
        td = inputs(requires_grad=True)
        with lib.contexts.HookingContextFactory().prepare(model) as hooked:
            for direction in ("fwd", "fwd_pre", "bwd", "bwd_pre"):
                hooked.register_submodule_hook("layers[1]", lambda module, *a: seen.append(module), direction)
            hooked(td)["output"].sum().backward()
        return [module is model.layers[1] for module in seen]

    side_by_side(scenario, "blocks")


def test_module_list_warns_as_tdhook() -> None:
    for lib in (REF, OURS):
        with lib.contexts.HookingContextFactory().prepare(make_blocks()) as hooked:
            for key in ("layers", "layers[0:2]"):
                with pytest.warns(UserWarning, match=r"You are hooking a ModuleList \(layers"):
                    hooked.get(TensorDict(), key)
            hooked(inputs())


def test_keys_outside_the_model_and_bad_hooks_raise() -> None:
    with tdhook_fn.compat.contexts.HookingContextFactory().prepare(make_mlp()) as hooked:
        with pytest.raises(ValueError, match="outside the hooked model"):
            hooked.get(TensorDict(), "", relative=False)
        with pytest.raises(ValueError, match="not to a module"):
            hooked.get(TensorDict(), "[0].weight")
        with pytest.raises(ValueError, match="Hook"):
            hooked.register_submodule_hook("[0]", lambda module: None, "fwd")


@MODELS
def test_run_context(name: str) -> None:
    def scenario(lib: Lib, model: nn.Module, keys: dict[str, str]) -> Any:
        outer = TensorDict()
        td = inputs(requires_grad=True)
        with lib.contexts.HookingContextFactory().prepare(model) as hooked:
            with hooked.run(td, cache=outer, run_name="r", run_sep="/") as run:
                p1 = run.get(keys["first"])
                p2 = run.save(keys["mid"])
                p3 = run.get_input(keys["last"], cache_key="in", callback=lambda args, **kw: args[0])
                run.save_input(keys["last"], callback=lambda args, **kw: args[0] + 1)
                run.set(keys["other"], None, callback=lambda output, **kw: output * 0)
                run.set_input(keys["mid"], None, callback=lambda args, **kw: (args[0] * 2,))
            first = (run.cache, outer, td, p1.resolve(), p2.resolve(), p3.resolve(), hooked(inputs()))
            with hooked.run(inputs(True), run_callback=lambda m, d: m(d)["output"].sum().backward()) as run:
                run.get_grad(keys["mid"], callback=lambda grad_input, **kw: grad_input[0])
                run.save_grad(keys["first"], callback=lambda grad_input, **kw: grad_input[0])
                run.get_grad_output(keys["last"], callback=lambda grad_output, **kw: grad_output[0])
                run.set_grad(keys["last"], None, callback=lambda grad_input, **kw: (grad_input[0] * 2,))
                run.set_grad_output(keys["mid"], None, callback=lambda grad_output, **kw: (grad_output[0] + 1,))
            with hooked.run(inputs(), run_cache=TensorDict(kept=torch.ones(1))) as stopped:
                stopped.get(keys["first"])
                stopped.save_grad_output(keys["mid"], callback=lambda grad_output, **kw: grad_output[0])
                stopped.stop(keys["mid"])
            with pytest.raises(RuntimeError) as outside:
                run.get(keys["first"])
        return first, run.cache, grads(model), stopped.cache, str(outside.value)

    side_by_side(scenario, name)


def test_standalone_hooked_module() -> None:
    def scenario(lib: Lib, model: nn.Module, keys: dict[str, str]) -> Any:
        cache = TensorDict()
        hooked = lib.modules.HookedModule.from_module(model, ["input"], ["output"])
        hooked.get(cache, "module[0]")
        hooked.set("module[2]", None, callback=lambda output, **kw: output + 1)
        errors = []
        for method in (hooked.restore, lambda: hooked.disable_context().__enter__()):
            with pytest.raises(RuntimeError) as caught:
                method()
            errors.append(str(caught.value))
        return hooked(inputs()), cache, hooked.relative_path, hooked.hooking_context, errors

    side_by_side(scenario, "mlp")


def test_user_tensordict_module() -> None:
    def scenario(lib: Lib, model: nn.Module, keys: dict[str, str]) -> Any:
        cache = TensorDict()
        td_module = TensorDictModule(model, ["x"], [("out", "y")])
        with lib.contexts.HookingContextFactory().prepare(td_module) as hooked:
            hooked.get(cache, "module.layers[2]")
            hooked.get_input(cache, "module.layers[0]", callback=lambda args, **kw: args[0])
            hooked.set_input("module.heads['aux']", None, callback=lambda args, **kw: (args[0] * 0,))
            out = hooked(TensorDict(x=torch.ones(3, 4), batch_size=[3]))
            return out, cache, hooked.relative_path, hooked.in_keys, hooked.out_keys

    side_by_side(scenario, "blocks")


def test_no_model_hooks_while_hooked() -> None:
    model = make_blocks()
    hook_dicts = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")

    def hooks_on_model() -> int:
        return sum(len(getattr(m, d)) for m in model.modules() for d in hook_dicts)

    with tdhook_fn.compat.contexts.HookingContextFactory().prepare(model) as hooked:
        for direction in ("fwd", "fwd_pre", "bwd", "bwd_pre", "fwd_kwargs", "fwd_pre_kwargs"):
            hooked.register_submodule_hook("layers[0]", lambda module, *a, **k: None, direction)
        assert hooks_on_model() == 0
        hooked(inputs(requires_grad=True))["output"].sum().backward()
        assert hooks_on_model() == 0
        with hooked.run(inputs()) as run:
            run.get("layers[1]")
            assert hooks_on_model() == 0


def test_wrappers_match() -> None:
    def scenario(lib: Lib, model: nn.Module, keys: dict[str, str]) -> Any:
        m = lib.modules
        inner = TensorDictModule(model, ["input"], ["output"])
        td = TensorDict(input=torch.ones(2, 3, 4), batch_size=[2, 3])
        nested = TensorDict(sub=td.clone(), batch_size=[2, 3])
        ref = m.MutableWeakRef(TensorDict())
        with_cache = m.ModuleCallWithCache(inner, ["stored"], cache_key="c", in_key="sub", out_key="o", cache_ref=ref)
        no_cache = m.ModuleCallWithCache(inner, ["stored"], cache_as_output=False, cache_ref=m.TensorDictRef(None))
        fn = m.FunctionModule(lambda t: t.set("z", t["input"] * 2), ["input"], ["z"])
        cleaner = m.IntermediateKeysCleaner(["input"])
        return (
            m.flatten_select_reshape_call(inner, td.clone()),
            m.flatten_select_reshape_call(inner, td.clone(), select=False),
            m.ModuleCall(inner)(td.clone()),
            m.ModuleCall(inner, in_key="sub", out_key="o")(nested.clone()),
            (with_cache.in_keys, with_cache.out_keys, no_cache.out_keys),
            with_cache(nested.clone()),
            no_cache(td.clone()),
            no_cache.cache_ref.resolve()["_shape"],
            fn(td.clone()),
            cleaner(fn(td.clone())),
            (fn.in_keys, fn.out_keys, cleaner.in_keys, cleaner.out_keys),
        )

    side_by_side(scenario, "mlp")


def test_handoff_functional_and_params() -> None:
    seen: dict[str, Any] = {}

    class Probe(tdhook_fn.compat.contexts.HookingContextFactory):
        def _prepare_module(self, module: Any, in_keys: Any, out_keys: Any, extra_relative_path: str) -> Any:
            def probe(td: TensorDict) -> TensorDict:
                seen["f"], seen["params"], seen["model"] = module.functional(), module.params(), module.model
                zeroed = [(p, torch.zeros_like) for p in module.model.parameters()]
                with tdhook_fn.compat.modules.replacing(*zeroed):  # other weights, for these calls only
                    seen["zeroed"] = module(td.clone())
                return module(td)

            return tdhook_fn.compat.modules.FunctionModule(probe, in_keys, out_keys)

    model = make_mlp()
    with Probe().prepare(model) as hooked:
        hooked.set("[0]", None, callback=lambda output, **kw: output * 2)
        out = hooked(inputs())
    f, params = seen["f"], seen["params"]
    assert seen["model"] is model
    assert isinstance(f, tdhook_fn.Functional) and len(f.taps) == 1
    assert params["0", "weight"] is model[0].weight
    assert torch.equal(f(params, inputs())["output"], out["output"])  # the hook is one of f's taps
    assert torch.equal(f(tdhook_fn.params(model), inputs())["output"], out["output"])
    assert not torch.equal(tdhook_fn.functional(model)(params, inputs())["output"], out["output"])
    assert torch.equal(seen["zeroed"]["output"], torch.zeros(2, 3))
