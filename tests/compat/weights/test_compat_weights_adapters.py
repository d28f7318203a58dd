"""tdhook_fn.compat.weights.Adapters side by side with tdhook 0.1.3's Adapters."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import tdhook.weights
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from zoo import Blocks, same, snapshot

import tdhook_fn.compat.weights

LIBS = [tdhook.weights, tdhook_fn.compat.weights]
X = torch.randn(5, 4, generator=torch.Generator().manual_seed(4))


class SAE(nn.Module):
    """A sparse autoencoder; it uses tdhook's ``args=`` (the adapted module's inputs)."""

    def __init__(self, width: int = 4, hidden: int = 8, out: int | None = None) -> None:
        super().__init__()
        self.enc = nn.Linear(width, hidden)
        self.dec = nn.Linear(hidden, out or width)

    def forward(self, x: torch.Tensor, args: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        out = self.dec(torch.relu(self.enc(x)))
        return out if args is None else out + 0.1 * args[0].mean(-1, keepdim=True)


class Either(nn.Module):
    """Works for both directions: a tuple of inputs (fwd_pre) or an output (fwd)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Any, **kwargs: Any) -> Any:
        if isinstance(x, tuple):
            return (torch.tanh(self.linear(x[0])),)
        return self.linear(x) * 0.5


class ToArgs(nn.Module):
    """A fwd_pre transcoder: tdhook hands it the cached tensor and wants the inputs' tuple back."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor]:
        return (torch.tanh(self.linear(x)),)


class Blend(nn.Module):
    """A fwd transcoder that also reads the adapted module's own output: tdhook passes an adapter the hook
    arguments its call's signature names (a module's ``__call__`` names only ``args``), so this one names
    ``output`` there."""

    def __call__(self, x: torch.Tensor, output: torch.Tensor | None = None, args: Any = None) -> torch.Tensor:
        return x if output is None else 0.5 * (x + output)


class PreBlend(nn.Module):
    """A fwd_pre transcoder that also reads the adapted module's own inputs (tdhook passes ``args=`` to it)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, args: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor]:
        return (torch.tanh(self.linear(x)) + (0 if args is None else args[0]),)


def make_blocks() -> nn.Module:
    torch.manual_seed(0)
    return Blocks().eval()


def double(module: nn.Module, args: Any, output: torch.Tensor, key: str, direction: str) -> torch.Tensor:
    return output * 2


def first_input(module: nn.Module, args: Any, key: str, direction: str) -> torch.Tensor:
    return args[0]


CASES: dict[str, tuple[Callable[[], dict[str, Any]], dict[str, Any]]] = {
    "sae": (lambda: {"sae": (SAE(), "layers[1]", "layers[1]")}, {}),
    "sae_slash_path": (lambda: {"sae": (SAE(), "<block0/module>[0]", "<block0/module>[0]")}, {}),
    "sae_module_dict": (lambda: {"sae": (SAE(2), "heads['main']", "heads['main']")}, {}),
    "transcoder": (lambda: {"tc": (SAE(), "layers[0]", "layers[2]")}, {}),
    "transcoder_to_dict": (lambda: {"tc": (SAE(out=1), "layers.0", "heads.aux")}, {}),
    "transcoder_callback": (
        lambda: {"tc": (SAE(), "<block0/module>", "layers[2]"), "sae": (SAE(), "layers[0]", "layers[0]")},
        {"cache_callback": double},
    ),
    "fwd_pre": (lambda: {"pre": (Either(), "layers[1]", "layers[1]")}, {"directions": ["fwd_pre"]}),
    "both_directions": (lambda: {"e": (Either(), "layers[2]", "layers[2]")}, {"directions": ["fwd", "fwd_pre"]}),
    "fwd_pre_transcoder": (
        lambda: {"pre": (ToArgs(), "layers[0]", "layers[2]")},
        {"directions": ["fwd_pre"], "cache_callback": first_input},
    ),
    "transcoder_sees_output": (lambda: {"tc": (Blend(), "layers[0]", "layers[2]")}, {}),
    "fwd_pre_transcoder_sees_args": (
        lambda: {"pre": (PreBlend(), "layers[0]", "layers[2]")},
        {"directions": ["fwd_pre"], "cache_callback": first_input},
    ),
    "not_relative": (
        lambda: {
            "sae": (SAE(), "td_module.module.layers[1]", "td_module.module.layers[1]"),
            "tc": (SAE(), "td_module.module.<block0/module>[0]", "td_module.module.layers[0]"),
        },
        {"relative": False},
    ),
}


def make_adapters(name: str) -> dict[str, Any]:
    torch.manual_seed(1)
    return CASES[name][0]()


def run_adapted(lib: Any, name: str, model: nn.Module, **extra: Any) -> dict[str, Any]:
    adapters = make_adapters(name)
    factory = lib.Adapters(adapters, **{**CASES[name][1], **extra})
    with factory.prepare(model) as hooked:
        out = hooked(TensorDict(input=X, batch_size=[5]))["output"]
        out.pow(2).sum().backward()
        hooks_inside = snapshot(model)["hooks"]
        cache = hooked.hooking_context.cache.clone()
        names = list(hooked.adapters.keys())
    return {
        "out": out.detach(),
        "cache": cache,
        "grads": {f"{n}.{p}": t.grad for n, (a, _, _) in adapters.items() for p, t in a.named_parameters()},
        "model_grads": {n: p.grad for n, p in model.named_parameters()},
        "names": names,
        "hooks_inside": hooks_inside,
    }


def assert_close_dicts(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key] is None) == (b[key] is None), key
        if a[key] is not None:
            assert torch.allclose(a[key], b[key], atol=1e-6), key


@pytest.mark.parametrize("name", list(CASES))
def test_adapters_match_tdhook(name: str) -> None:
    model = make_blocks()
    plain = model(X).detach()
    before = snapshot(model)
    ref = run_adapted(tdhook.weights, name, copy.deepcopy(model))
    ours = run_adapted(tdhook_fn.compat.weights, name, model)
    assert torch.allclose(ours["out"], ref["out"], atol=1e-6)
    assert not torch.allclose(ours["out"], plain, atol=1e-4)  # the adapters changed the output
    assert list(ours["cache"].keys()) == list(ref["cache"].keys())
    for key in ref["cache"].keys():
        assert torch.allclose(ours["cache"][key], ref["cache"][key]), key
    assert_close_dicts(ours["grads"], ref["grads"])
    assert_close_dicts(ours["model_grads"], ref["model_grads"])
    assert all(g is not None for g in ours["grads"].values())
    assert ours["names"] == ref["names"]
    assert ours["hooks_inside"] == before["hooks"]  # the model never carries a hook
    model.zero_grad(set_to_none=True)  # backward filled .grad, as with tdhook; nothing else changed
    assert same(before, snapshot(model))
    assert torch.equal(model(X).detach(), plain)


def test_cache_keys_and_clearing() -> None:
    for lib in LIBS:
        cache = TensorDict(old=torch.zeros(1))
        run_adapted(lib, "transcoder", make_blocks(), cache=cache, clear_cache=False)
        assert set(cache.keys()) == {"old", "layers[0]_output"}
        run_adapted(lib, "transcoder", make_blocks(), cache=cache)
        assert set(cache.keys()) == {"layers[0]_output"}
        model = make_blocks()
        expected = model.layers[0](getattr(model, "block0/module")(X)).detach()
        assert torch.allclose(cache["layers[0]_output"], expected)


def test_training_the_adapter_matches_tdhook() -> None:
    weights = []
    for lib in LIBS:
        model = make_blocks()
        torch.manual_seed(1)
        sae = SAE()
        optimizer = torch.optim.SGD(sae.parameters(), lr=0.1)
        with lib.Adapters({"sae": (sae, "layers[1]", "layers[1]")}).prepare(model) as hooked:
            assert hooked.adapters["sae"] is sae
            for _ in range(3):
                optimizer.zero_grad()
                adapted = hooked(TensorDict(input=X, batch_size=[5]))["output"]
                nn.functional.mse_loss(adapted, torch.ones_like(adapted)).backward()
                optimizer.step()
        weights.append({n: p.detach().clone() for n, p in sae.named_parameters()})
    assert_close_dicts(weights[1], weights[0])


def test_tensordict_module_and_hooks_on_the_hooked_module() -> None:
    """Hooks registered on the hooked module see the adapted values, as in tdhook."""
    results = []
    for lib in LIBS:
        model = make_blocks()
        td_module = TensorDictModule(model, ["x"], ["y"])
        torch.manual_seed(1)
        adapters = {"sae": (SAE(), "module.layers[1]", "module.layers[1]")}
        with lib.Adapters(adapters).prepare(td_module) as hooked:
            seen = TensorDict()
            hooked.get(seen, "module.layers[1]")
            out = hooked(TensorDict(x=X, batch_size=[5]))["y"].detach()
            with hooked.disable_context_hooks():  # the adapters are the context's hooks
                plain = hooked(TensorDict(x=X, batch_size=[5]))["y"].detach()
        results.append((out, seen["module.layers[1]_output"].detach(), plain))
    for ref, ours in zip(*results, strict=True):
        assert torch.allclose(ours, ref, atol=1e-6)
    assert torch.allclose(results[1][2], make_blocks()(X).detach(), atol=1e-6)


def test_the_body_raising_leaves_the_model_alone() -> None:
    model = make_blocks()
    before = snapshot(model)
    with pytest.raises(ZeroDivisionError), tdhook_fn.compat.weights.Adapters(make_adapters("sae")).prepare(model) as h:
        h(TensorDict(input=X, batch_size=[5]))
        raise ZeroDivisionError
    assert same(before, snapshot(model))


@pytest.mark.parametrize("lib", LIBS, ids=["tdhook", "ours"])
def test_fwd_pre_transcoder_must_return_a_tuple(lib: Any) -> None:
    adapters = {"pre": (Either(), "layers[0]", "layers[2]")}
    factory = lib.Adapters(adapters, directions=["fwd_pre"], cache_callback=first_input)
    with factory.prepare(make_blocks()) as hooked:
        with pytest.raises(RuntimeError, match="Callback returned a value of type Tensor but the original value"):
            hooked(TensorDict(input=X, batch_size=[5]))


@pytest.mark.parametrize("lib", LIBS, ids=["tdhook", "ours"])
def test_wrong_result_type_is_refused(lib: Any) -> None:
    class Tupled(nn.Module):
        def forward(self, x: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor]:
            return (x,)

    with lib.Adapters({"bad": (Tupled(), "layers[0]", "layers[0]")}).prepare(make_blocks()) as hooked:
        with pytest.raises(RuntimeError, match="Callback returned a value of type tuple"):
            hooked(TensorDict(input=X, batch_size=[5]))


def test_plain_linear_adapter_needs_the_args_keyword_as_in_tdhook() -> None:
    for lib in LIBS:
        with lib.Adapters({"lin": (nn.Linear(4, 4), "layers[0]", "layers[0]")}).prepare(make_blocks()) as hooked:
            with pytest.raises(TypeError, match="args"):
                hooked(TensorDict(input=X, batch_size=[5]))


def test_unsupported_options_and_bad_keys() -> None:
    with pytest.raises(NotImplementedError, match="bwd"):
        tdhook_fn.compat.weights.Adapters(make_adapters("sae"), directions=["bwd"])
    model = make_blocks()
    before = snapshot(model)
    bad = tdhook_fn.compat.weights.Adapters({"sae": (SAE(), "layers[1]", "layers[7]")})
    with pytest.raises(ValueError, match="layers"), bad.prepare(model):
        pass
    outside = tdhook_fn.compat.weights.Adapters({"sae": (SAE(), "adapters.sae", "adapters.sae")}, relative=False)
    with pytest.raises(ValueError, match="adapters.sae.*outside the hooked model"), outside.prepare(model):
        pass
    assert same(before, snapshot(model))


class _NormedAdapter(nn.Module):
    """An adapter with a BatchNorm of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(6, 6), nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor, **_: Any) -> torch.Tensor:
        return self.norm(self.lin(x))


def test_training_mode_updates_the_buffers_as_tdhook() -> None:
    """The model and the adapters run as plain forwards: BatchNorm statistics move as in tdhook."""
    states = []
    for lib in LIBS:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.BatchNorm1d(6), nn.Linear(6, 3)).train()
        adapter = _NormedAdapter().train()
        with lib.Adapters({"b": (adapter, "[0]", "[0]")}).prepare(model) as hooked:
            out = hooked(TensorDict(input=X.clone(), batch_size=[5]))["output"]
        states.append((out, {**model.state_dict(), **{f"adapter.{k}": v for k, v in adapter.state_dict().items()}}))
    (theirs, their_state), (ours, our_state) = states
    torch.testing.assert_close(ours, theirs)
    assert their_state.keys() == our_state.keys()
    for key, value in their_state.items():
        torch.testing.assert_close(our_state[key], value, msg=key)
    assert int(our_state["2.num_batches_tracked"]) == 1 and int(our_state["adapter.norm.num_batches_tracked"]) == 1


@pytest.mark.parametrize("adapters_first", [True, False])
def test_a_composite_with_pruning_in_either_order_is_tdhooks(adapters_first: bool) -> None:
    import tdhook.contexts

    import tdhook_fn.compat.contexts

    outputs = []
    for lib, contexts in zip(LIBS, (tdhook.contexts, tdhook_fn.compat.contexts), strict=True):
        torch.manual_seed(0)
        model, adapter = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)), _NormedAdapter().eval()

        class Composite(contexts.CompositeHookingContextFactory):  # type: ignore[name-defined, misc]
            _hooked_module_class = lib.adapters.HookedModuleWithAdapters
            _hooking_context_class = contexts.HookingContextWithCache

        adapters = lib.Adapters({"a": (adapter, "[0]", "[0]")})
        pruning = lib.Pruning(lambda module_key, parameter_name, parameter: parameter.abs(), 0.5)
        composite = Composite(*((adapters, pruning) if adapters_first else (pruning, adapters)))
        composite._hooked_module_kwargs.update(adapters._hooked_module_kwargs)
        with composite.prepare(model) as hooked:
            outputs.append(hooked(TensorDict(input=X.clone(), batch_size=[5]))["output"])
    theirs, ours = outputs
    torch.testing.assert_close(ours, theirs)
