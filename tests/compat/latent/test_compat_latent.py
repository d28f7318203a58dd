"""tdhook_fn.compat.latent side by side with tdhook 0.1.3's latent contexts.

Each test runs the same call through ``tdhook.latent`` (on a deep copy of the model) and
``tdhook_fn.compat.latent`` (on the model itself) and compares keys, shapes and numbers;
the model must come out of every compat context exactly as it went in, without hooks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import tdhook.latent
import torch
import transformers
from tensordict import TensorDict, TensorDictBase
from torch import nn
from zoo import TdhookTestModel, cnn, same, snapshot

import tdhook_fn.compat.latent

LIBS = {"tdhook": tdhook.latent, "ours": tdhook_fn.compat.latent}


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=40, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).eval()


def make(name: str) -> tuple[nn.Module, dict[str, Any], Callable[[], torch.Tensor], list[str]]:
    """(model, prepare kwargs, a fresh input batch, module paths to patch or steer)."""
    torch.manual_seed(0)
    if name == "mlp":
        return TdhookTestModel(), {}, lambda: torch.randn(3, 10), ["linear1", "linear2"]
    if name == "cnn":
        model = cnn().eval()
        return model, {}, lambda: torch.randn(3, 1, 5, 5), ["[0]", "[2]"]
    keys = {"in_keys": ["input_ids"], "out_keys": ["logits"]}
    return gpt2(), keys, lambda: torch.randint(0, 40, (3, 7)), ["transformer.h.0", "transformer.h.1.mlp"]


MODELS = ["mlp", "cnn", "gpt2"]


Setup = tuple[dict[str, nn.Module], dict[str, Any], Callable[[], torch.Tensor], list[str]]


@contextmanager
def side_by_side(name: str) -> Iterator[Setup]:
    """The models for both libraries; on exit the compat one must be untouched."""
    model, kwargs, data, paths = make(name)
    before = snapshot(model)
    yield {"tdhook": copy.deepcopy(model), "ours": model}, kwargs, data, paths
    assert same(before, snapshot(model))


def in_key(kwargs: dict[str, Any]) -> str:
    return str(kwargs.get("in_keys", ["input"])[0])


def out_key(kwargs: dict[str, Any]) -> str:
    return str(kwargs.get("out_keys", ["output"])[0])


def assert_same_td(ours: TensorDictBase, theirs: TensorDictBase) -> None:
    assert set(ours.keys(True, True)) == set(theirs.keys(True, True))
    for key in theirs.keys(True, True):
        a, b = ours.get(key), theirs.get(key)
        if isinstance(b, TensorDictBase):
            assert_same_td(a, b)
        else:
            torch.testing.assert_close(a, b)


# -- ActivationCaching -------------------------------------------------------------------


def first_value(**kwargs: Any) -> torch.Tensor:
    """A callback for every direction: the first tensor among the hook's values."""
    for name in ("output", "grad_output", "args", "grad_input"):
        value = kwargs.get(name)
        if isinstance(value, tuple):
            value = next((v for v in value if isinstance(v, torch.Tensor)), None)
        if isinstance(value, torch.Tensor):
            return value
    raise AssertionError(f"no tensor for {kwargs['key']}")


CACHING = {
    "mlp": [
        dict(key_pattern="linear2"),
        dict(key_pattern=".*"),  # the ReLU runs twice: the last run is kept
        dict(key_pattern=r"td_module\.module\.linear", relative=False),
        dict(key_pattern=".*", relative=False),  # includes the TensorDictModule's own TensorDict output
        dict(key_pattern="linear", use_nested_keys=True),
        dict(key_pattern="linear", directions=["fwd", "fwd_kwargs"]),
        dict(key_pattern="linear", directions=["fwd_pre", "fwd_pre_kwargs"], callback=first_value),
        dict(key_pattern="linear", callback=lambda output, **_: output * 2),
    ],
    "cnn": [
        dict(key_pattern=r"\d"),
        dict(key_pattern=r"td_module", relative=False),
        dict(key_pattern=r"\[?[01]", directions=["fwd", "fwd_pre"], callback=first_value),
    ],
    "gpt2": [
        dict(key_pattern=r"transformer\.h\.\d+$"),
        dict(key_pattern=r"transformer\.h\.\d+\.(attn|mlp)$", callback=first_value),
        dict(key_pattern=r"transformer\.h\.0\.mlp", directions=["fwd", "fwd_kwargs"], use_nested_keys=True),
        dict(key_pattern=r"td_module\.module\.lm_head", relative=False),
    ],
}


@pytest.mark.parametrize("name, options", [(n, o) for n in MODELS for o in CACHING[n]])
def test_caching_matches_tdhook(name: str, options: dict[str, Any]) -> None:
    with side_by_side(name) as (models, kwargs, data, _):
        x = data()
        caches, outputs = {}, {}
        for lib, latent in LIBS.items():
            with latent.ActivationCaching(**options).prepare(models[lib], **kwargs) as hooked:
                outputs[lib] = hooked(TensorDict({in_key(kwargs): x}, batch_size=[3]))
                caches[lib] = hooked.hooking_context.cache
        assert list(caches["ours"].keys(True, True)) == list(caches["tdhook"].keys(True, True))
        assert len(list(caches["ours"].keys())) > 0
        assert_same_td(caches["ours"], caches["tdhook"])
        torch.testing.assert_close(outputs["ours"][out_key(kwargs)], outputs["tdhook"][out_key(kwargs)])


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("direction", ["bwd", "bwd_pre"])
def test_caching_backward_directions_match_tdhook(name: str, direction: str) -> None:
    """Gradients cached through a callback; the backward fills the model's .grad in both."""
    model, kwargs, data, paths = make(name)
    models = {"tdhook": copy.deepcopy(model), "ours": model}
    x = data()
    pattern = {"mlp": "linear", "cnn": r"\[?[34]", "gpt2": r"transformer\.h\.\d\.mlp$"}[name]
    caches = {}
    for lib, latent in LIBS.items():
        factory = latent.ActivationCaching(pattern, directions=[direction], callback=first_value)
        with factory.prepare(models[lib], **kwargs) as hooked:
            out = hooked(TensorDict({in_key(kwargs): x}, batch_size=[3]))
            out[out_key(kwargs)].pow(2).sum().backward()
            caches[lib] = hooked.hooking_context.cache
    assert list(caches["ours"].keys()) == list(caches["tdhook"].keys()) != []
    assert_same_td(caches["ours"], caches["tdhook"])
    for (_, ours), (_, theirs) in zip(models["ours"].named_parameters(), models["tdhook"].named_parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad)
    assert not any(m._forward_hooks or m._backward_hooks or m._backward_pre_hooks for m in model.modules())


def test_caching_given_cache_clear_cache_and_key_pattern_setter() -> None:
    with side_by_side("mlp") as (models, kwargs, data, _):
        x, y = data(), data()
        caches = {}
        for lib, latent in LIBS.items():
            cache = TensorDict({"kept": torch.ones(2)})
            factory = latent.ActivationCaching("linear1", cache=cache, clear_cache=False)
            factory.key_pattern = "linear3"
            assert factory.key_pattern == "linear3"
            with factory.prepare(models[lib]) as hooked:
                hooked(x)  # a plain tensor call, as tdhook's
                with hooked.disable_context_hooks():
                    hooked(y)  # not cached
            assert hooked.hooking_context.cache is cache
            caches[lib] = cache
        assert set(caches["ours"].keys()) == {"kept", "linear3"}
        assert_same_td(caches["ours"], caches["tdhook"])


# -- ActivationPatching ------------------------------------------------------------------


def zero_first(output: torch.Tensor, output_to_patch: torch.Tensor, **_: Any) -> torch.Tensor:
    """tdhook's own test patch: the first feature from the clean run, in place."""
    output[:, 0] = output_to_patch[:, 0]
    return output


PATCHING = [
    dict(),
    dict(patch_fn=zero_first),
    dict(patch_fn=lambda output, output_to_patch, **_: None),  # None: the clean value
    dict(patch_fn=lambda output, output_to_patch, **_: 0.5 * (output + output_to_patch)),
    dict(clean_intermediate_keys=False),
    dict(patch_key=("runs", "corrupted")),
    dict(cache_callback=lambda output, **_: output * 0.5),
    dict(cache_callback=lambda output, **_: output + 1, patch_fn=lambda output, output_to_patch, **_: output_to_patch),
]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("options", PATCHING)
@pytest.mark.parametrize("count", [1, 2])
def test_patching_matches_tdhook(name: str, options: dict[str, Any], count: int) -> None:
    with side_by_side(name) as (models, kwargs, data, paths):
        key = options.get("patch_key", "patched")
        clean, corrupted = data(), data()
        results, given = {}, {}
        for lib, latent in LIBS.items():
            td = TensorDict({in_key(kwargs): clean}, batch_size=[3])
            td.set((*((key,) if isinstance(key, str) else key), in_key(kwargs)), corrupted)
            with latent.ActivationPatching(paths[:count], **options).prepare(models[lib], **kwargs) as hooked:
                results[lib] = hooked(td)
            given[lib] = td
        assert_same_td(results["ours"], results["tdhook"])
        patched = results["ours"].get((*((key,) if isinstance(key, str) else key), out_key(kwargs)))
        assert patched.shape == results["ours"][out_key(kwargs)].shape
        if not options.get("clean_intermediate_keys", True):
            assert set(results["ours"]["_cache"].keys()) == set(paths[:count])


@pytest.mark.parametrize("name", MODELS)
def test_patching_every_module_patched_gives_the_clean_output(name: str) -> None:
    """Patching the last module with its clean value reproduces the clean run."""
    model, kwargs, data, _ = make(name)
    last = {"mlp": "linear3", "cnn": "[4]", "gpt2": "lm_head"}[name]
    td = TensorDict({in_key(kwargs): data(), ("patched", in_key(kwargs)): data()}, batch_size=[3])
    with tdhook_fn.compat.latent.ActivationPatching([last]).prepare(model, **kwargs) as hooked:
        out = hooked(td)
    torch.testing.assert_close(out["patched", out_key(kwargs)], out[out_key(kwargs)], rtol=0, atol=0)


# -- SteeringVectors and ActivationAddition -----------------------------------------------


STEER_FNS = [
    lambda output, **_: output + 1.0,
    lambda output, **_: None,
    lambda output, **_: output.clamp(min=0.0) * 0.5,
]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("steer_fn", STEER_FNS)
@pytest.mark.parametrize("count", [1, 2])
def test_steering_matches_tdhook(name: str, steer_fn: Callable[..., Any], count: int) -> None:
    with side_by_side(name) as (models, kwargs, data, paths):
        x = data()
        results = {}
        for lib, latent in LIBS.items():
            with latent.SteeringVectors(paths[:count], steer_fn=steer_fn).prepare(models[lib], **kwargs) as hooked:
                results[lib] = hooked(TensorDict({in_key(kwargs): x}, batch_size=[3]))
        assert_same_td(results["ours"], results["tdhook"])


ADDITION = [
    dict(),
    dict(clean_intermediate_keys=False),
    dict(positive_key="pos", negative_key=("neg", "x"), steer_key=("out", "vectors")),
]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("options", ADDITION)
@pytest.mark.parametrize("count", [1, 2])
def test_activation_addition_matches_tdhook(name: str, options: dict[str, Any], count: int) -> None:
    with side_by_side(name) as (models, kwargs, data, paths):
        pos_key, neg_key = options.get("positive_key", "positive"), options.get("negative_key", "negative")
        steer_key = options.get("steer_key", "steer")
        positive, negative = data(), data()
        results = {}
        for lib, latent in LIBS.items():
            td = TensorDict({}, batch_size=[3])
            for key, value in ((pos_key, positive), (neg_key, negative)):
                td.set((*((key,) if isinstance(key, str) else key), in_key(kwargs)), value)
            with latent.ActivationAddition(paths[:count], **options).prepare(models[lib], **kwargs) as hooked:
                results[lib] = hooked(td)
        assert_same_td(results["ours"], results["tdhook"])
        for path in paths[:count]:
            vector = results["ours"].get((*((steer_key,) if isinstance(steer_key, str) else steer_key), path))
            assert vector.shape == results["tdhook"].get(
                (*((steer_key,) if isinstance(steer_key, str) else steer_key), path)).shape


@pytest.mark.parametrize("name", MODELS)
def test_steering_with_activation_addition_vectors_matches_tdhook(name: str) -> None:
    """The documented pipeline: vectors from ActivationAddition, added by SteeringVectors."""
    with side_by_side(name) as (models, kwargs, data, paths):
        pair = TensorDict({("positive", in_key(kwargs)): data(), ("negative", in_key(kwargs)): data()}, batch_size=[3])
        x = data()
        results = {}
        for lib, latent in LIBS.items():
            with latent.ActivationAddition(paths[1:]).prepare(models[lib], **kwargs) as hooked:
                vector = hooked(pair.clone())["steer", paths[1]]
            steer = latent.SteeringVectors(paths[1:], steer_fn=lambda output, **_: output + 4.0 * vector)
            with steer.prepare(models[lib], **kwargs) as hooked:
                results[lib] = hooked(TensorDict({in_key(kwargs): x}, batch_size=[3]))
        assert_same_td(results["ours"], results["tdhook"])


# -- TensorDictModules and keyword inputs --------------------------------------------------


def run_all(latent: Any, model: nn.Module, kwargs: dict[str, Any], data: dict[str, TensorDictBase],
            paths: list[str]) -> dict[str, Any]:
    """One call of each latent context; their results and caches."""
    results: dict[str, Any] = {}
    with latent.ActivationPatching(paths).prepare(model, **kwargs) as hooked:
        results["patching"] = hooked(data["patch"].clone())
    with latent.ActivationAddition(paths).prepare(model, **kwargs) as hooked:
        results["addition"] = hooked(data["pair"].clone())
    with latent.SteeringVectors(paths, steer_fn=lambda output, **_: output - 0.5).prepare(model, **kwargs) as hooked:
        results["steering"] = hooked(data["plain"].clone())
    for relative in (True, False):
        with latent.ActivationCaching(".*mlp$|.*[02]$", relative=relative).prepare(model, **kwargs) as hooked:
            hooked(data["plain"].clone())
            results[f"caching-{relative}"] = hooked.hooking_context.cache
    return results


def test_tensordict_module_matches_tdhook() -> None:
    from tensordict.nn import TensorDictModule

    torch.manual_seed(0)
    model = TensorDictModule(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)), ["x"], ["y"])
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    data = {
        "patch": TensorDict({"x": x, ("patched", "x"): y}, batch_size=[3]),
        "pair": TensorDict({("positive", "x"): x, ("negative", "x"): y}, batch_size=[3]),
        "plain": TensorDict({"x": x}, batch_size=[3]),
    }
    before = snapshot(model)
    theirs = run_all(tdhook.latent, copy.deepcopy(model), {}, data, ["module[0]", "module[1]"])
    ours = run_all(tdhook_fn.compat.latent, model, {}, data, ["module[0]", "module[1]"])
    assert same(before, snapshot(model))
    for key, value in theirs.items():
        assert list(ours[key].keys(True, True)) == list(value.keys(True, True)), key
        assert_same_td(ours[key], value)


def test_gpt2_with_an_attention_mask_matches_tdhook() -> None:
    """in_keys as a dict: the model takes input_ids and attention_mask by keyword."""
    torch.manual_seed(0)
    model = gpt2()
    kwargs = {"in_keys": {"input_ids": "input_ids", "attention_mask": "attention_mask"}, "out_keys": ["logits"]}
    ids, other = torch.randint(0, 40, (3, 7)), torch.randint(0, 40, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, 4:] = 0
    plain = TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=[3])
    corrupted = TensorDict({"input_ids": other, "attention_mask": mask}, batch_size=[3])
    data = {
        "patch": plain.clone().set("patched", corrupted),
        "pair": TensorDict({"positive": plain, "negative": corrupted}, batch_size=[3]),
        "plain": plain,
    }
    before = snapshot(model)
    paths = ["transformer.h.0.mlp", "transformer.h.1"]
    theirs = run_all(tdhook.latent, copy.deepcopy(model), kwargs, data, paths)
    ours = run_all(tdhook_fn.compat.latent, model, kwargs, data, paths)
    assert same(before, snapshot(model))
    for key, value in theirs.items():
        assert list(ours[key].keys(True, True)) == list(value.keys(True, True)), key
        assert_same_td(ours[key], value)


def test_caching_keeps_the_value_a_later_in_place_write_changes():
    """Deliberate difference (docs/compat.md): tdhook stores the tensor, which ReLU(inplace=True) then writes."""
    from tdhook.latent.activation_caching import ActivationCaching as RefCaching

    from tdhook_fn.compat.latent.activation_caching import ActivationCaching

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(inplace=True), torch.nn.Linear(4, 2)).eval()
    x = torch.randn(2, 3)
    before_relu = torch.nn.functional.linear(x, net[0].weight, net[0].bias).detach()
    caches = []
    for factory in (ActivationCaching, RefCaching):
        with factory(r"0").prepare(net) as hooked:
            hooked(TensorDict(input=x, batch_size=[2]))
            caches.append(hooked.hooking_context.cache["0"])
    torch.testing.assert_close(caches[0], before_relu)
    torch.testing.assert_close(caches[1], before_relu.relu())  # tdhook's: the values after the write


def test_patching_a_module_whose_output_is_written_in_place_patches_what_it_returned() -> None:
    """transformers' ResNet block writes its layer's output in place (``hidden_state += residual``): compat patches
    in the output as returned, as a forward hook patching by hand does; tdhook patches in the written tensor
    (documented in docs/compat.md)."""
    torch.manual_seed(0)
    config = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                       num_labels=5, layer_type="basic")
    model = transformers.ResNetForImageClassification(config).eval()
    keys = {"in_keys": {"pixel_values": "pixel_values"}, "out_keys": ["logits"]}
    g = torch.Generator().manual_seed(1)
    x, corrupted = torch.randn(2, 3, 16, 16, generator=g), torch.randn(2, 3, 16, 16, generator=g)
    site = "resnet.encoder.stages.0.layers.0.layer"
    patched = {}
    for name, lib in (("tdhook", tdhook.latent), ("ours", tdhook_fn.compat.latent)):
        with lib.ActivationPatching([site]).prepare(copy.deepcopy(model), **keys) as hooked:
            td = TensorDict(pixel_values=x, patched={"pixel_values": corrupted}, batch_size=[2])
            patched[name] = hooked(td)["patched", "logits"]
    module = model.get_submodule(site)
    handle = module.register_forward_hook(lambda m, a, out: patched.__setitem__("clean", out.clone()))
    model(pixel_values=x)
    handle.remove()
    handle = module.register_forward_hook(lambda m, a, out: patched["clean"].clone())
    by_hand = model(pixel_values=corrupted).logits
    handle.remove()
    torch.testing.assert_close(patched["ours"], by_hand)
    assert (patched["tdhook"] - by_hand).abs().max() > 0.05
