"""tdhook_fn.compat.contexts side by side with the oracle, tdhook 0.1.3's tdhook.contexts."""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from typing import Any

import pytest
import tdhook.contexts
import tdhook.modules
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from zoo import Blocks, mlp, same, snapshot

import tdhook_fn.compat.contexts
import tdhook_fn.compat.modules

REF = types.SimpleNamespace(contexts=tdhook.contexts, modules=tdhook.modules)
OURS = types.SimpleNamespace(contexts=tdhook_fn.compat.contexts, modules=tdhook_fn.compat.modules)
LIBS = pytest.mark.parametrize("lib", [REF, OURS], ids=["tdhook", "ours"])
HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return mlp().eval()


_X = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))


def data(batch: int = 2) -> TensorDict:
    """A fresh TensorDict of fixed inputs (no global RNG: threads call it)."""
    return TensorDict(input=_X[:batch].clone(), batch_size=[batch])


def plain(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(data()["input"])  # type: ignore[no-any-return]


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except Exception as e:
        return type(e).__name__, str(e)


def zeroing_factory(lib: Any, key: str = "[2]") -> Any:
    """A factory whose own hook (``_hook_module``) zeroes the output at ``key``."""

    class Zeroing(lib.contexts.HookingContextFactory):
        def _hook_module(self, module: Any) -> Any:
            return module.set(key, None, callback=lambda output, **kw: output * 0)

    return Zeroing()


def both(scenario: Callable[[Any], Any]) -> None:
    ref, ours = scenario(REF), scenario(OURS)
    assert ref[0] == ours[0], (ref, ours)
    for a, b in zip(ref[1:], ours[1:]):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, (a, b)


def test_lifecycle_errors_match() -> None:
    def scenario(lib: Any) -> Any:
        model = make_mlp()
        context = lib.contexts.HookingContextFactory().prepare(model)
        results = []
        with context as hooked:
            results.append(outcome(lambda: context.__enter__()))  # twice
            results.append(outcome(lambda: hooked.restore()))  # managed by `with`
        results.append(outcome(lambda: hooked(data())))  # outside
        results.append(outcome(lambda: context.disable_hooks().__enter__()))
        results.append(outcome(lambda: context.disable().__enter__()))
        with context as again:  # a context can be entered again
            results.append(again is not hooked)
        return results, again.hooking_context is context, plain(model)

    both(scenario)


def test_return_context_false_and_restore() -> None:
    def scenario(lib: Any) -> Any:
        model = make_mlp()
        hooked = zeroing_factory(lib).prepare(model, return_context=False)
        out = hooked(data())["output"]
        hooked.restore()
        return [outcome(lambda: hooked(data())), outcome(hooked.restore)], out

    both(scenario)


def test_disable_hooks_and_disable() -> None:
    def scenario(lib: Any) -> Any:
        model = make_mlp()
        context = zeroing_factory(lib).prepare(model)
        with context as hooked:
            handle = hooked.set("[0]", None, callback=lambda output, **kw: output + 1)
            hooked_out = hooked(data())["output"]
            with context.disable_hooks():
                no_context_hooks = hooked(data())["output"]
            with hooked.disable_context_hooks():
                same_again = hooked(data())["output"]
            with context.disable() as raw:
                is_model = raw is model
                inside = hooked(data())["output"]
            after = hooked(data())["output"]
            with hooked.disable_context() as raw:
                # tdhook attaches a re-prepared module as `hooked.module` after a disable()
                # and yields that the next time; we yield the model every time.
                again = raw is model
            handle.remove()
        assert again or lib is REF
        return is_model, hooked_out, no_context_hooks, same_again, inside, after, plain(model)

    both(scenario)


def test_unremoved_hooks_do_not_outlive_the_context() -> None:
    for lib, leaks in ((REF, True), (OURS, False)):
        model = make_mlp()
        with lib.contexts.HookingContextFactory().prepare(model) as hooked:
            hooked.set("[0]", None, callback=lambda output, **kw: output + 1)  # never removed
        assert bool(model[0]._forward_hooks) is leaks
        assert torch.equal(plain(model), make_mlp()(data()["input"])) is not leaks


def test_cache_context() -> None:
    def scenario(lib: Any) -> Any:
        class Caching(lib.contexts.HookingContextFactory):
            _hooking_context_class = lib.contexts.HookingContextWithCache

            def __init__(self, cache: Any = None, clear_cache: bool = True) -> None:
                super().__init__()
                self._hooking_context_kwargs.update(cache=cache, clear_cache=clear_cache)

            def _hook_module(self, module: Any) -> Any:
                return module.get(module.hooking_context.cache, "[0]")[0]

        given = TensorDict(old=torch.ones(1))
        keeping = Caching(given, clear_cache=False).prepare(make_mlp())
        with keeping:
            kept = sorted(keeping.cache.keys())
        clearing = Caching(TensorDict(old=torch.ones(1))).prepare(make_mlp())
        with clearing as hooked:
            cleared = sorted(clearing.cache.keys())
            hooked(data())
            filled = sorted(clearing.cache.keys())
            value = clearing.cache["[0]_output"]
        clearing.clear()
        return (keeping.cache is given, kept, cleared, filled, sorted(clearing.cache.keys())), value

    both(scenario)


def test_composite_factory() -> None:
    def scenario(lib: Any) -> Any:
        calls: list[str] = []

        def factory(name: str, scale: float, key: str) -> Any:
            class Scaling(lib.contexts.HookingContextFactory):
                def _prepare_module(self, module: Any, in_keys: Any, out_keys: Any, extra: str) -> Any:
                    calls.append(f"prepare {name}")
                    return module

                def _restore_module(self, module: Any, in_keys: Any, out_keys: Any, extra: str) -> Any:
                    calls.append(f"restore {name}")
                    return module

                def _hook_module(self, module: Any) -> Any:
                    calls.append(f"hook {name}")
                    return module.set(key, None, callback=lambda output, **kw: output * scale)

            return Scaling()

        composite = lib.contexts.CompositeHookingContextFactory(factory("a", 2.0, "[0]"), factory("b", -1.0, "[2]"))
        context = composite.prepare(make_mlp())
        with context as hooked:
            out = hooked(data())["output"]
            with context.disable_hooks():
                off = hooked(data())["output"]

        class Spawning(lib.contexts.HookingContextFactory):
            _hooked_module_class = lib.modules.HookedModule

            def _spawn_hooked_module(self, *args: Any) -> Any:
                raise AssertionError

        class CompositeSpawning(lib.contexts.CompositeHookingContextFactory):
            def _spawn_hooked_module(self, *args: Any) -> Any:
                return super()._spawn_hooked_module(*args)

        errors = [outcome(lambda: lib.contexts.CompositeHookingContextFactory(factory("c", 1, ""), Spawning()))]
        errors.append(outcome(lambda: type(CompositeSpawning(Spawning())).__name__))
        return (calls, errors), out, off

    both(scenario)


def test_prepare_key_validation() -> None:
    def scenario(lib: Any) -> Any:
        td_module = TensorDictModule(make_mlp(), ["x", ("a", "b")], ["y"])
        factory = lib.contexts.HookingContextFactory()
        results = [
            outcome(lambda: type(factory.prepare(td_module, ["x", ("a", "b")], ["y"])).__name__),
            outcome(lambda: factory.prepare(td_module, ["z"])),
            outcome(lambda: factory.prepare(td_module, [1])),
            outcome(lambda: factory.prepare(td_module, [()])),
            outcome(lambda: factory.prepare(td_module, None, ["x"])),
            outcome(lambda: factory.prepare(td_module, None, [("y",), ["y"]])),
        ]
        with factory.prepare(make_mlp(), ["x"], [("o", "p")]) as hooked:
            out = hooked(TensorDict(x=torch.ones(2, 4), batch_size=[2]))["o", "p"]
            results.append((hooked.in_keys, hooked.out_keys, hooked.relative_path))
        factory._hooked_module_kwargs["relative_path"] = "base"
        with factory.prepare(td_module) as hooked:
            results.append(hooked.relative_path)
        return results, out

    both(scenario)


def test_pre_factories() -> None:
    def scenario(lib: Any) -> Any:
        cache = TensorDict()

        class Outer(lib.contexts.HookingContextFactory):
            def __init__(self) -> None:
                super().__init__()
                # the inner context sees the outer one's TensorDictModule: keys start there
                self._hooking_context_kwargs["pre_factories"] = [zeroing_factory(lib, "module[1]")]

            def _hook_module(self, module: Any) -> Any:
                return module.get(cache, "[0]")[0]

        with Outer().prepare(make_mlp()) as hooked:
            out = hooked(data())["output"]
        return sorted(cache.keys()), out, cache["[0]_output"]

    both(scenario)


def test_failed_enter_leaves_the_context_closed() -> None:
    class Failing(tdhook_fn.compat.contexts.HookingContextFactory):
        fail = True

        def _prepare_module(self, module: Any, in_keys: Any, out_keys: Any, extra: str) -> Any:
            if self.fail:
                raise KeyError("boom")
            return module

    factory = Failing()
    context = factory.prepare(make_mlp())
    with pytest.raises(KeyError):
        context.__enter__()
    assert not context._in_context
    factory.fail = False
    with context as hooked:
        assert hooked(data())["output"].shape == (2, 3)


@pytest.mark.parametrize("raises", [False, True])
def test_model_untouched_while_hooked_and_after(raises: bool) -> None:
    model = Blocks().eval()
    before = snapshot(model)

    def hook_count() -> int:
        return sum(len(getattr(m, d)) for m in model.modules() for d in HOOK_DICTS)

    context = zeroing_factory(OURS, "layers[2]").prepare(model)
    with pytest.raises(ZeroDivisionError) if raises else torch.no_grad():
        with context as hooked:
            cache = TensorDict()
            hooked.get(cache, "heads['aux']")
            hooked.get_grad_output(cache, "layers[0]", callback=lambda grad_output, **kw: grad_output[0])
            hooked.set_input("<block0/module>", None, callback=lambda args, **kw: (args[0] * 2,))
            assert hook_count() == 0
            with torch.enable_grad():
                hooked(data()).get("output").sum().backward()
            assert hook_count() == 0 and "layers[0]_grad_output" in cache
            with context.disable() as raw:
                raw(data()["input"])
                assert hook_count() == 0
            if raises:
                _ = 1 / 0
    for p in model.parameters():  # the user's backward filled .grad, as with tdhook
        assert p.grad is not None
        p.grad = None
    assert same(before, snapshot(model))


def test_train_mode_buffers_update_as_a_plain_forward() -> None:
    def scenario(lib: Any) -> Any:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).train()
        with lib.contexts.HookingContextFactory().prepare(model) as hooked:
            out = hooked(data(5))["output"]
        return model[1].num_batches_tracked.item(), out, model[1].running_mean, model[1].running_var

    both(scenario)


def test_threads_with_their_own_contexts_on_one_model() -> None:
    model = make_mlp()
    expected = {}
    for scale in (2.0, -3.0):
        with torch.no_grad():
            expected[scale] = model[2](model[1](model[0](data()["input"]) * scale))
    errors: list[Any] = []
    barrier = threading.Barrier(2)

    def worker(scale: float) -> None:
        try:
            with OURS.contexts.HookingContextFactory().prepare(model) as hooked:
                hooked.set("[0]", None, callback=lambda output, **kw: output * scale)
                barrier.wait()
                for _ in range(50):
                    with torch.no_grad():
                        out = hooked(data())["output"]
                    assert torch.allclose(out, expected[scale]), scale
                    with hooked.run(data()) as run:  # run-local hooks stay in their thread
                        proxy = run.get("[1]")
                    assert torch.allclose(proxy.resolve(), torch.relu(model[0](data()["input"]) * scale))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in expected]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(not getattr(m, d) for m in model.modules() for d in HOOK_DICTS)


def test_threads_sharing_one_hooked_module() -> None:
    model = make_mlp()
    with OURS.contexts.HookingContextFactory().prepare(model) as hooked:
        hooked.set("[2]", None, callback=lambda output, **kw: output + 10)
        with torch.no_grad():
            expected = model(data()["input"]) + 10
        results: list[bool] = []

        def worker() -> None:
            for _ in range(50):
                with torch.no_grad():
                    results.append(torch.allclose(hooked(data())["output"], expected))

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(results) == 200 and all(results)


def test_every_prepare_step_receives_a_routed_module_of_the_users_model() -> None:
    """Plain, composite (each factory) and with pre-factories: one kind of module, whose model is the user's
    (for a pre-factory, as in tdhook, the TensorDictModule the outer context wraps it in)."""
    seen: list[Any] = []

    class Recording(tdhook_fn.compat.contexts.HookingContextFactory):
        def _prepare_module(self, module: Any, in_keys: Any, out_keys: Any, extra_relative_path: str) -> Any:
            seen.append(module)
            return tdhook_fn.compat.modules.FunctionModule(lambda td: module(td), in_keys, out_keys)

    class WithPre(Recording):
        def __init__(self) -> None:
            super().__init__()
            self._hooking_context_kwargs["pre_factories"] = [Recording()]

    model = make_mlp()
    x = TensorDict(input=torch.randn(2, model[0].in_features), batch_size=[2])
    factories = [Recording(), tdhook_fn.compat.contexts.CompositeHookingContextFactory(Recording(), Recording()),
                 WithPre()]
    for factory in factories:
        with factory.prepare(model) as hooked:
            out = hooked(x.clone())["output"]
        assert torch.equal(out, model(x["input"]))
    assert len(seen) == 5 and all(type(m) is tdhook_fn.compat.modules.RoutedModule for m in seen)
    pre = seen[3]
    assert all(m.model is model for m in seen if m is not pre) and pre.model.module is model
