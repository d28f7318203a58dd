"""Factories subclassing ``_prepare_module`` / ``_restore_module``, next to tdhook 0.1.3.

A factory that sets an attribute on the working module in ``_prepare_module`` and deletes
it in ``_restore_module`` sees it on the context's TensorDictModule inside the context,
and not after; a composite prepares in order and restores in reverse. Where tdhook leaves
a factory's attribute behind (a failing step), we put it back, and the user's model is
never written.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest
import tdhook.contexts
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from zoo import mlp, same, snapshot

import tdhook_fn.compat.contexts

REF = types.SimpleNamespace(name="tdhook", contexts=tdhook.contexts)
OURS = types.SimpleNamespace(name="ours", contexts=tdhook_fn.compat.contexts)
LIBS = pytest.mark.parametrize("lib", [REF, OURS], ids=["tdhook", "ours"])


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return mlp().eval()


def data() -> TensorDict:
    return TensorDict(input=torch.arange(8.0).reshape(2, 4) / 8, batch_size=[2])


def flagging(lib: Any, flag: str = "flag", log: list[Any] | None = None, key: str = "[0]", **fail: bool) -> Any:
    """A factory setting ``flag`` on the working module on prepare, deleting it on restore.

    Its own hook adds 1 to the output of the module at ``key`` (``"module[0]"`` when the
    context is prepared with a TensorDictModule). ``log`` gets ``(step, flag, id(module),
    the flags the module has then)``; ``fail`` makes a step raise: ``prepare`` after
    setting the flag, ``restore`` before deleting it, ``hook`` on registering the
    context's hooks.
    """
    calls = [] if log is None else log

    def flags(module: Any) -> list[str]:
        return sorted(name for name in ("flag", "flag_a", "flag_b") if hasattr(module, name))

    class Flagging(lib.contexts.HookingContextFactory):
        def _prepare_module(self, module: Any, in_keys: Any, out_keys: Any, extra_relative_path: str) -> Any:
            setattr(module, flag, 1)
            calls.append(("prepare", flag, id(module), flags(module)))
            if fail.get("prepare"):
                raise KeyError("prepare")
            return module

        def _restore_module(self, module: Any, in_keys: Any, out_keys: Any, extra_relative_path: str) -> Any:
            calls.append(("restore", flag, id(module), flags(module)))
            if fail.get("restore"):
                raise KeyError("restore")
            delattr(module, flag)
            return module

        def _hook_module(self, module: Any) -> Any:
            if fail.get("hook"):
                raise KeyError("hook")
            return module.set(key, None, callback=lambda output, **kw: output + 1)

    return Flagging()


def td_module_of(model: nn.Module) -> TensorDictModule:
    return TensorDictModule(model, in_keys=["input"], out_keys=["output"])


TD_KEY = "module[0]"  # the first layer, seen from a context prepared with a TensorDictModule


def key_for(target: nn.Module) -> str:
    return TD_KEY if isinstance(target, TensorDictModule) else "[0]"


def both(scenario: Callable[[Any], Any]) -> Any:
    ref, ours = scenario(REF), scenario(OURS)
    assert ref == ours, (ref, ours)
    return ours


def test_attribute_visible_inside_and_gone_after() -> None:
    def scenario(lib: Any) -> Any:
        model = make_mlp()
        td_module = td_module_of(model)
        with flagging(lib, key=TD_KEY).prepare(td_module) as hooked:
            inside = (getattr(td_module, "flag", None), getattr(hooked, "flag", None), hasattr(model, "flag"))
            out = hooked(data())["output"]
        return inside, hasattr(td_module, "flag"), hasattr(model, "flag"), out.tolist()

    inside, *_ = both(scenario)
    assert inside == (1, 1, False)


def test_attribute_on_the_wrapper_of_an_nn_module() -> None:
    def scenario(lib: Any) -> Any:
        model = make_mlp()
        with flagging(lib).prepare(model) as hooked:
            inside = getattr(hooked, "flag", None), hasattr(model, "flag")
        return inside, hasattr(model, "flag")

    assert both(scenario) == ((1, False), False)


def test_prepare_and_restore_receive_the_same_module() -> None:
    def scenario(lib: Any) -> Any:
        log: list[Any] = []
        for model in (make_mlp(), td_module_of(make_mlp())):
            with flagging(lib, log=log, key=key_for(model)).prepare(model):
                pass
        (_, _, prepared, _), (_, _, restored, _) = log[:2]
        (_, _, prepared_td, _), (_, _, restored_td, _) = log[2:]
        return prepared == restored, prepared_td == restored_td, [entry[3] for entry in log]

    assert both(scenario) == (True, True, [["flag"]] * 4)


def test_composite_prepares_in_order_and_restores_in_reverse() -> None:
    def scenario(lib: Any) -> Any:
        log: list[Any] = []
        model = make_mlp()
        td_module = td_module_of(model)
        composite = lib.contexts.CompositeHookingContextFactory(
            flagging(lib, "flag_a", log, TD_KEY), flagging(lib, "flag_b", log, TD_KEY)
        )
        with composite.prepare(td_module) as hooked:
            inside = getattr(td_module, "flag_a", None), getattr(td_module, "flag_b", None)
            out = hooked(data())["output"]  # each factory's hook adds 1
        after = hasattr(td_module, "flag_a"), hasattr(td_module, "flag_b")
        steps = [(step, flag, names) for step, flag, _, names in log]
        return steps, inside, after, out.tolist()

    steps, inside, after, _ = both(scenario)
    assert steps == [
        ("prepare", "flag_a", ["flag_a"]),
        ("prepare", "flag_b", ["flag_a", "flag_b"]),
        ("restore", "flag_b", ["flag_a", "flag_b"]),
        ("restore", "flag_a", ["flag_a"]),
    ]
    assert inside == (1, 1) and after == (False, False)


@pytest.mark.parametrize("given", ["nn.Module", "TensorDictModule"])
def test_exception_in_body_still_restores(given: str) -> None:
    def scenario(lib: Any) -> Any:
        log: list[Any] = []
        model = make_mlp()
        target = model if given == "nn.Module" else td_module_of(model)
        with pytest.raises(ZeroDivisionError):
            with flagging(lib, log=log, key=key_for(target)).prepare(target):
                _ = 1 / 0
        return [step for step, *_ in log], hasattr(target, "flag"), hasattr(model, "flag")

    assert both(scenario) == (["prepare", "restore"], False, False)


def test_contexts_over_one_module_close_in_any_order() -> None:
    def scenario(lib: Any) -> Any:
        td_module = td_module_of(make_mlp())
        first = flagging(lib, "flag_a", key=TD_KEY).prepare(td_module, return_context=False)
        second = flagging(lib, "flag_b", key=TD_KEY).prepare(td_module, return_context=False)
        first.restore()
        between = hasattr(td_module, "flag_a"), hasattr(td_module, "flag_b")
        second.restore()
        return between, hasattr(td_module, "flag_a"), hasattr(td_module, "flag_b")

    assert both(scenario) == ((False, True), False, False)


@pytest.mark.parametrize("given", ["nn.Module", "TensorDictModule"])
def test_model_unchanged(given: str) -> None:
    def scenario(lib: Any) -> Any:
        model = make_mlp()
        target = model if given == "nn.Module" else td_module_of(model)
        before, wrapper_before = snapshot(model), dict(vars(target))
        composite = lib.contexts.CompositeHookingContextFactory(
            flagging(lib, "flag_a", key=key_for(target)), flagging(lib, "flag_b", key=key_for(target))
        )
        with composite.prepare(target) as hooked:
            hooked(data())
            unchanged_inside = same(before, snapshot(model))
        return unchanged_inside, same(before, snapshot(model)), dict(vars(target)) == wrapper_before

    # tdhook hooks the model itself for real while the context is open
    ref, ours = scenario(REF), scenario(OURS)
    assert ref[1:] == ours[1:] == (True, True)
    assert ours[0]


# -- where tdhook leaves the factory's attribute behind, we put it back -----------------


@pytest.mark.parametrize("failing", ["prepare", "restore", "hook"])
def test_failing_step_leaves_no_attribute(failing: str) -> None:
    def scenario(lib: Any) -> Any:
        model = make_mlp()
        td_module = td_module_of(model)
        before = snapshot(model)
        log: list[Any] = []
        context = flagging(lib, log=log, key=TD_KEY, **{failing: True}).prepare(td_module)
        with pytest.raises(KeyError, match=failing):
            with context:
                pass
        return [step for step, *_ in log], hasattr(td_module, "flag"), same(before, snapshot(model))

    ours = scenario(OURS)
    # a failing hook step restores the prepared module (tdhook leaves it prepared)
    steps = {"prepare": ["prepare"], "restore": ["prepare", "restore"], "hook": ["prepare", "restore"]}
    assert ours == (steps[failing], False, True)
    assert scenario(REF)[1] is True  # tdhook 0.1.3 keeps the flag on the user's module


def test_composite_with_a_failing_prepare_leaves_no_attribute() -> None:
    td_module = td_module_of(make_mlp())
    composite = OURS.contexts.CompositeHookingContextFactory(
        flagging(OURS, "flag_a"), flagging(OURS, "flag_b", prepare=True)
    )
    context = composite.prepare(td_module)
    with pytest.raises(KeyError, match="prepare"):
        context.__enter__()
    assert not hasattr(td_module, "flag_a") and not hasattr(td_module, "flag_b")
    assert not context._in_context


def test_attributes_a_restore_forgets_are_put_back() -> None:
    model = make_mlp()
    td_module = td_module_of(model)
    original_module = td_module.module

    class Swapping(OURS.contexts.HookingContextFactory):
        def _prepare_module(self, module: Any, in_keys: Any, out_keys: Any, extra_relative_path: str) -> Any:
            module.extra = nn.Linear(2, 2)  # a submodule, on the TensorDictModule
            module.note = "prepared"
            del module.out_keys_source_note  # a plain attribute the user had set
            return module

    td_module.out_keys_source_note = "mine"
    with Swapping().prepare(td_module) as hooked:
        assert isinstance(td_module.extra, nn.Linear) and "extra" in td_module._modules
        assert td_module.note == "prepared" and not hasattr(td_module, "out_keys_source_note")
        out = hooked(data())["output"]
    assert not hasattr(td_module, "extra") and not hasattr(td_module, "note")
    assert td_module.out_keys_source_note == "mine"
    assert td_module.module is original_module and "extra" not in dict(td_module.named_children())
    torch.testing.assert_close(out, model(data()["input"]))


def test_private_and_own_attributes_stay_on_the_working_module() -> None:
    td_module = td_module_of(make_mlp())
    seen: dict[str, Any] = {}

    class Private(OURS.contexts.HookingContextFactory):
        def _prepare_module(self, module: Any, in_keys: Any, out_keys: Any, extra_relative_path: str) -> Any:
            module._private = 1
            seen["working"] = module._private
            return module

        def _restore_module(self, module: Any, in_keys: Any, out_keys: Any, extra_relative_path: str) -> Any:
            seen["restored"] = module._private
            del module._private
            return module

    with Private().prepare(td_module) as hooked:
        assert not hasattr(td_module, "_private")
        hooked(data())
    assert seen == {"working": 1, "restored": 1} and not hasattr(td_module, "_private")
