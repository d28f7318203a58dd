"""tdhook_fn.compat.latent: the model is never touched, threads, errors, and where it differs from tdhook."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import tdhook.latent
import torch
from tensordict import TensorDict
from test_compat_latent import LIBS, TdhookTestModel, assert_same_td, gpt2, in_key, make
from torch import nn
from zoo import same, snapshot

import tdhook_fn
from tdhook_fn.compat.latent import ActivationAddition, ActivationCaching, ActivationPatching, SteeringVectors


def no_hooks(model: nn.Module) -> bool:
    return not any(
        getattr(m, name) for m in model.modules() for name in vars(m) if name.endswith("hooks") and getattr(m, name)
    )


def patch_td(x: torch.Tensor, y: torch.Tensor, key: str = "input") -> TensorDict:
    return TensorDict({key: x, ("patched", key): y}, batch_size=x.shape[:1])


def pair_td(x: torch.Tensor, y: torch.Tensor, key: str = "input") -> TensorDict:
    return TensorDict({("positive", key): x, ("negative", key): y}, batch_size=x.shape[:1])


FACTORIES = {
    "caching": lambda paths: ActivationCaching(r"transformer\.h\.\d+$" if "transformer.h.0" in paths else ".*"),
    "patching": lambda paths: ActivationPatching(paths),
    "steering": lambda paths: SteeringVectors(paths, steer_fn=lambda output, **_: output * 2),
    "addition": lambda paths: ActivationAddition(paths),
}


def call(kind: str, hooked: Any, data: Any, key: str) -> Any:
    if kind == "patching":
        return hooked(TensorDict({key: data(), ("patched", key): data()}, batch_size=[3]))
    if kind == "addition":
        return hooked(TensorDict({("positive", key): data(), ("negative", key): data()}, batch_size=[3]))
    return hooked(TensorDict({key: data()}, batch_size=[3]))


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt2"])
@pytest.mark.parametrize("kind", list(FACTORIES))
def test_model_untouched_after_a_context_and_after_an_exception(name: str, kind: str) -> None:
    model, kwargs, data, paths = make(name)
    before = snapshot(model)
    with FACTORIES[kind](paths).prepare(model, **kwargs) as hooked:
        assert no_hooks(model)
        call(kind, hooked, data, in_key(kwargs))
        assert no_hooks(model) and same(before, snapshot(model))
    assert same(before, snapshot(model))
    with pytest.raises(KeyError, match="boom"), FACTORIES[kind](paths).prepare(model, **kwargs) as hooked:
        call(kind, hooked, data, in_key(kwargs))
        raise KeyError("boom")
    assert same(before, snapshot(model))


def test_errors_leave_the_model_untouched_and_name_the_module() -> None:
    model = gpt2()
    before = snapshot(model)
    ids = torch.randint(0, 40, (2, 5))
    keys = {"in_keys": ["input_ids"], "out_keys": ["logits"]}
    for lib, latent in LIBS.items():  # a tuple output: both refuse to cache it
        with pytest.raises(RuntimeError, match="tuple"), \
                latent.ActivationPatching(["transformer.h.0.attn"]).prepare(model, **keys) as hooked:
            hooked(patch_td(ids, ids, "input_ids"))
    with pytest.raises(RuntimeError, match="'transformer.h.0.attn'"), \
            ActivationAddition(["transformer.h.0.attn"]).prepare(model, **keys) as hooked:
        hooked(pair_td(ids, ids, "input_ids"))
    with pytest.raises(ValueError, match="nope"), ActivationPatching(["nope"]).prepare(model, **keys):
        pass
    with pytest.raises(ValueError), ActivationAddition(["transformer.h[0].__class__"]).prepare(model, **keys):
        pass
    assert same(before, snapshot(model))


def test_a_module_running_twice_is_refused_where_tdhook_keeps_its_last_run() -> None:
    model = TdhookTestModel()
    before = snapshot(model)
    x, y = torch.randn(2, 10), torch.randn(2, 10)
    with tdhook.latent.ActivationPatching(["activation"]).prepare(copy.deepcopy(model)) as hooked:
        hooked(patch_td(x, y))  # tdhook patches both runs with the last clean one
    with pytest.raises(ValueError, match="ran 2 times"), ActivationPatching(["activation"]).prepare(model) as hooked:
        hooked(patch_td(x, y))
    with pytest.raises(ValueError, match="ran 2 times"), ActivationAddition(["activation"]).prepare(model) as hooked:
        hooked(pair_td(x, y))
    assert same(before, snapshot(model)) and no_hooks(model)


def test_callbacks_receive_their_own_module_key() -> None:
    """tdhook passes the last module key to every call (a late-binding closure); we pass each its own."""
    model = TdhookTestModel()
    x, y = torch.randn(2, 10), torch.randn(2, 10)
    seen: dict[str, list[str]] = {"tdhook": [], "ours": []}
    for lib, latent in LIBS.items():
        record = seen[lib].append
        patch_fn = lambda module_key, output, output_to_patch: record(module_key)
        with latent.ActivationPatching(["linear1", "linear2"], patch_fn=patch_fn).prepare(model) as hooked:
            hooked(patch_td(x, y))
        steer_fn = lambda module_key, output: record(module_key)
        with latent.SteeringVectors(["linear1", "linear2"], steer_fn=steer_fn).prepare(model) as hooked:
            hooked(x)
    assert seen["tdhook"] == ["linear2"] * 4
    assert seen["ours"] == ["linear1", "linear2"] * 2


def test_patching_changes_the_output_and_follows_patch_fn() -> None:
    model = TdhookTestModel()
    x, y = torch.randn(4, 10), torch.randn(4, 10)
    with ActivationPatching(["linear2"]).prepare(model) as hooked:
        out = hooked(patch_td(x, y))
    assert not torch.allclose(out["patched", "output"], model(y))
    expected = model.linear3(torch.relu(model.linear2(torch.relu(model.linear1(x)))))
    torch.testing.assert_close(out["patched", "output"], expected)
    with ActivationPatching(["linear2"], patch_fn=lambda output, output_to_patch, **_: output).prepare(model) as hooked:
        out = hooked(patch_td(x, y))
    torch.testing.assert_close(out["patched", "output"], model(y))


def test_patching_with_several_batch_dims() -> None:
    """tdhook loses its cache reference there; ours equals the flattened run."""
    model = TdhookTestModel()
    x, y = torch.randn(2, 3, 10), torch.randn(2, 3, 10)
    td = TensorDict({"input": x, ("patched", "input"): y}, batch_size=[2, 3])
    with ActivationPatching(["linear1"], clean_intermediate_keys=False).prepare(model) as hooked:
        out = hooked(td)
        flat = hooked(td.reshape(-1))
    assert out["_cache"].batch_size == (2, 3)
    torch.testing.assert_close(out["patched", "output"].reshape(6, 5), flat["patched", "output"])
    torch.testing.assert_close(out["_cache", "linear1"], model.linear1(x))


def test_hooks_registered_on_the_hooked_module_apply_as_in_tdhook() -> None:
    model = TdhookTestModel()
    x, y = torch.randn(3, 10), torch.randn(3, 10)
    results = {}
    for lib, latent in LIBS.items():
        with latent.ActivationPatching(["linear2"]).prepare(model) as hooked:
            handle = hooked.set("linear1", None, callback=lambda output, **_: output * 0.5)
            results[lib] = hooked(patch_td(x, y))
            handle.remove()
    assert_same_td(results["ours"], results["tdhook"])
    assert no_hooks(model)


def test_disable_hooks_turns_caching_and_steering_off() -> None:
    model = TdhookTestModel()
    x = torch.randn(3, 10)
    with SteeringVectors(["linear3"], steer_fn=lambda output, **_: output * 0).prepare(model) as hooked:
        assert hooked(x).abs().sum() == 0
        with hooked.disable_context_hooks():
            torch.testing.assert_close(hooked(x), model(x))
        assert hooked(x).abs().sum() == 0
    with ActivationCaching("linear3").prepare(model) as hooked:
        with hooked.disable_context_hooks():
            hooked(x)
        assert "linear3" not in hooked.hooking_context.cache.keys()
        hooked(x)
        torch.testing.assert_close(hooked.hooking_context.cache["linear3"], model.linear3(
            torch.relu(model.linear2(torch.relu(model.linear1(x))))))


def test_bad_inputs() -> None:
    model = TdhookTestModel()
    with ActivationPatching(["linear1"]).prepare(model) as hooked, pytest.raises(TypeError, match="TensorDict"):
        hooked(torch.randn(2, 10))
    with pytest.raises(NotImplementedError, match="cache_callback"):
        ActivationAddition(["linear1"], cache_callback=lambda output, **_: output)
    with pytest.raises(ValueError, match="missing required parameters"), \
            ActivationPatching(["linear1"], cache_callback=lambda x: x).prepare(model):
        pass
    with pytest.raises(RuntimeError, match="int values"), \
            ActivationPatching(["linear1"], cache_callback=lambda output, **_: 3).prepare(model) as hooked:
        hooked(patch_td(torch.randn(2, 10), torch.randn(2, 10)))
    with pytest.raises(RuntimeError, match="type float"), ActivationPatching(
            ["linear1"], patch_fn=lambda output, output_to_patch, **_: 1.0).prepare(model) as hooked:
        hooked(patch_td(torch.randn(2, 10), torch.randn(2, 10)))
    assert no_hooks(model)


def test_relative_path_and_caller_td_as_documented() -> None:
    model = TdhookTestModel()
    td = patch_td(torch.randn(2, 10), torch.randn(2, 10))
    for latent in LIBS.values():
        with latent.ActivationPatching(["linear1"]).prepare(model) as hooked:
            assert hooked.relative_path == "td_module.module[0]._td_module.module"
    with ActivationPatching(["linear1"]).prepare(model) as hooked:
        out = hooked(td)
    assert "_cache" not in out.keys() and "_cache" not in td.keys()
    pair = pair_td(torch.randn(2, 10), torch.randn(2, 10))
    with ActivationAddition(["linear1"]).prepare(model) as hooked:
        out = hooked(pair)
    assert set(out.keys(True, True)) == {("steer", "linear1")} and out.batch_size == ()
    assert set(pair.keys(True, True)) == {("positive", "input"), ("negative", "input")}


def test_threads_share_one_context() -> None:
    """Calls from several threads at once each get their own, correct, numbers."""
    model = TdhookTestModel()
    before = snapshot(model)
    inputs = [(torch.randn(4, 10), torch.randn(4, 10)) for _ in range(6)]
    patching, addition = ActivationPatching(["linear2"]), ActivationAddition(["linear1", "linear2"])
    steering = SteeringVectors(["linear2"], steer_fn=lambda output, **_: output + 1)
    with patching.prepare(model) as patched, addition.prepare(model) as added, steering.prepare(model) as steered:
        expected = [(patched(patch_td(x, y)), added(pair_td(x, y)), steered(x)) for x, y in inputs]
        got: list[Any] = [None] * len(inputs)
        errors: list[BaseException] = []

        def work(i: int) -> None:
            try:
                x, y = inputs[i]
                for _ in range(5):
                    got[i] = (patched(patch_td(x, y)), added(pair_td(x, y)), steered(x))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    for (p, a, s), (p2, a2, s2) in zip(expected, got, strict=True):
        assert_same_td(p2, p)
        assert_same_td(a2, a)
        torch.testing.assert_close(s2, s)
    assert same(before, snapshot(model)) and no_hooks(model)


def test_return_context_false_and_restore() -> None:
    model = TdhookTestModel()
    hooked = ActivationAddition(["linear1"]).prepare(model, return_context=False)
    out = hooked(pair_td(torch.randn(2, 10), torch.randn(2, 10)))
    assert out["steer", "linear1"].shape == (20,)
    hooked.restore()
    with pytest.raises(RuntimeError, match="in context"):
        hooked(pair_td(torch.randn(2, 10), torch.randn(2, 10)))
    assert no_hooks(model)
    assert tdhook_fn.params(model).keys()  # the model still works as before


def test_caching_from_threads_writes_whole_values_and_leaves_no_hook() -> None:
    """One shared cache, as in tdhook: after concurrent calls it holds one of the calls' values."""
    model = TdhookTestModel()
    before = snapshot(model)
    inputs = [torch.randn(4, 10) for _ in range(6)]
    expected = [model.linear1(x) for x in inputs]
    errors: list[BaseException] = []
    with ActivationCaching("linear1").prepare(model) as hooked:

        def work(x: torch.Tensor) -> None:
            try:
                for _ in range(5):
                    hooked(x)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work, args=(x,)) for x in inputs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        cached = hooked.hooking_context.cache["linear1"]
    assert not errors
    assert any(torch.equal(cached, value) for value in expected)
    assert same(before, snapshot(model)) and no_hooks(model)
