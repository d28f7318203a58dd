"""Methods that take the model as a pure function see what pre-factories do, as tdhook's methods do; and a
context prepared over another context's hooked module runs the model through it.

A context with ``pre_factories`` runs the model through their hooked module; attribution, LRP,
Grad-CAM and activation patching compute on the pure function of the model (NOTE [runners' effects]):
they must see its hooks (steering) and its replacements (pruning), side by side with tdhook 0.1.3,
and against the gradient of the changed model computed by hand.
"""

from __future__ import annotations

import types
from collections import OrderedDict
from typing import Any

import pytest
import tdhook.attribution
import tdhook.attribution.grad_cam
import tdhook.contexts
import tdhook.latent
import tdhook.weights
import torch
from tensordict import TensorDict
from torch import nn
from zoo import same, snapshot

import tdhook_fn.compat.attribution
import tdhook_fn.compat.attribution.grad_cam
import tdhook_fn.compat.contexts
import tdhook_fn.compat.latent
import tdhook_fn.compat.weights

REF = types.SimpleNamespace(attribution=tdhook.attribution, latent=tdhook.latent, weights=tdhook.weights,
                            contexts=tdhook.contexts)
OURS = types.SimpleNamespace(attribution=tdhook_fn.compat.attribution, latent=tdhook_fn.compat.latent,
                             weights=tdhook_fn.compat.weights, contexts=tdhook_fn.compat.contexts)
X = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
SHIFT = 3 * torch.randn(8, generator=torch.Generator().manual_seed(2))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(l0=nn.Linear(4, 8), act=nn.Tanh(), l1=nn.Linear(8, 3))).eval()


def steering(lib: Any) -> Any:
    return lib.latent.SteeringVectors(["l0"], lambda module_key, output: output + SHIFT)


def pruning(lib: Any) -> Any:
    return lib.weights.Pruning(lambda module_key, parameter_name, parameter: parameter.abs(), amount_to_prune=0.5)


def with_pre(factory: Any, pre: Any) -> Any:
    factory._hooking_context_kwargs["pre_factories"] = [pre]
    return factory


def steered_gradient(model: nn.Module) -> torch.Tensor:
    x = X.clone().requires_grad_()
    handle = model.l0.register_forward_hook(lambda module, args, output: output + SHIFT)
    try:
        model(x).sum().backward()
    finally:
        handle.remove()
    model.zero_grad()
    assert x.grad is not None
    return x.grad


def attributed(lib: Any, make: str, pre: str) -> torch.Tensor:
    model = make_model()
    before = snapshot(model)
    factory = {"saliency": lambda: lib.attribution.Saliency(),
               "integrated_gradients": lambda: lib.attribution.IntegratedGradients(n_steps=8),
               "guided_backprop": lambda: lib.attribution.GuidedBackpropagation()}[make]()
    td = TensorDict(input=X.clone(), baseline=TensorDict(input=torch.zeros(5, 4), batch_size=[5]), batch_size=[5])
    with with_pre(factory, {"steering": steering, "pruning": pruning}[pre](lib)).prepare(model) as hooked:
        out = hooked(td)["attr", "input"]
    if lib is OURS:
        assert same(before, snapshot(model))
    return out


@pytest.mark.parametrize("pre", ["steering", "pruning"])
@pytest.mark.parametrize("make", ["saliency", "integrated_gradients", "guided_backprop"])
def test_gradient_attributions_see_the_pre_factory(make: str, pre: str) -> None:
    ours, ref = attributed(OURS, make, pre), attributed(REF, make, pre)
    torch.testing.assert_close(ours, ref)
    plain = {"steering": steering, "pruning": pruning}[pre]
    model = make_model()
    td = TensorDict(input=X.clone(), baseline=TensorDict(input=torch.zeros(5, 4), batch_size=[5]), batch_size=[5])
    factory = {"saliency": tdhook_fn.compat.attribution.Saliency(),
               "integrated_gradients": tdhook_fn.compat.attribution.IntegratedGradients(n_steps=8),
               "guided_backprop": tdhook_fn.compat.attribution.GuidedBackpropagation()}[make]
    with factory.prepare(model) as hooked:
        unchanged = hooked(td)["attr", "input"]
    assert (ours - unchanged).abs().max() > 1e-3, plain  # the pre-factory changed the numbers


def test_saliency_is_the_gradient_of_the_steered_model() -> None:
    model = make_model()
    with with_pre(tdhook_fn.compat.attribution.Saliency(), steering(OURS)).prepare(model) as hooked:
        attr = hooked(TensorDict(input=X.clone(), batch_size=[5]))["attr", "input"]
    torch.testing.assert_close(attr, steered_gradient(make_model()))


def test_lrp_and_grad_cam_see_the_pre_factory() -> None:
    def scenario(lib: Any, make: str) -> torch.Tensor:
        model = make_model().double()
        factory = (lib.attribution.LRP() if make == "lrp"
                   else lib.attribution.GradCAM({"l0": lib.attribution.grad_cam.DimsConfig()}))
        with with_pre(factory, steering(lib)).prepare(model) as hooked:
            out = hooked(TensorDict(input=X.double(), batch_size=[5]))
        return out["attr", "input"] if make == "lrp" else out["attr", "l0"]

    for make in ("lrp", "grad_cam"):
        torch.testing.assert_close(scenario(OURS, make), scenario(REF, make))


def test_activation_patching_sees_the_pre_factory() -> None:
    def scenario(lib: Any) -> torch.Tensor:
        model = make_model()
        td = TensorDict(input=X.clone(), patched=TensorDict(input=X.flip(0), batch_size=[5]), batch_size=[5])
        factory = lib.latent.ActivationPatching(["act"])
        with with_pre(factory, steering(lib)).prepare(model) as hooked:
            return hooked(td)["patched", "output"]

    torch.testing.assert_close(scenario(OURS), scenario(REF))


def test_a_prepared_module_that_is_not_the_model_is_refused() -> None:
    """A composite whose earlier factory prepares an attribution: the later one cannot differentiate it."""
    model = make_model()
    composite = tdhook_fn.compat.contexts.CompositeHookingContextFactory(
        tdhook_fn.compat.attribution.Saliency(), tdhook_fn.compat.attribution.IntegratedGradients(n_steps=4))
    td = TensorDict(input=X.clone(), baseline=TensorDict(input=torch.zeros(5, 4), batch_size=[5]), batch_size=[5])
    with composite.prepare(model) as hooked, pytest.raises(NotImplementedError, match="Attributing"):
        hooked(td)


# -- a context prepared over another context's hooked module -----------------------------------------


def nested(lib: Any, outer: Any, inner: str, td: TensorDict) -> TensorDict:
    model = make_model()
    before = snapshot(model)
    with {"steering": steering, "pruning": pruning}[inner](lib).prepare(model) as changed:
        context = outer(lib).prepare(changed)
        with context as hooked:
            out = hooked(td.clone())
            cache = getattr(context, "cache", None)
    if lib is OURS:
        assert same(before, snapshot(model))
    return out.set("cache", cache.clone()) if cache is not None else out


NESTED = {
    "saliency": lambda lib: lib.attribution.Saliency(),
    "saliency_of_a_layer": lambda lib: lib.attribution.Saliency(input_modules=["module.l0"], use_inputs=False),
    "integrated_gradients": lambda lib: lib.attribution.IntegratedGradients(n_steps=6, multiply_by_inputs=True,
                                                                            compute_convergence_delta=True),
    "caching": lambda lib: lib.latent.ActivationCaching(r".*l\d$"),
    "caching_absolute": lambda lib: lib.latent.ActivationCaching(r".*l\d$", relative=False),
}


@pytest.mark.parametrize("inner", ["steering", "pruning"])
@pytest.mark.parametrize("outer", list(NESTED))
def test_a_context_over_a_hooked_module_runs_what_it_runs(outer: str, inner: str) -> None:
    td = TensorDict(input=X.clone(), baseline=TensorDict(input=torch.zeros(5, 4), batch_size=[5]), batch_size=[5])
    ours, ref = nested(OURS, NESTED[outer], inner, td), nested(REF, NESTED[outer], inner, td)
    keys = list(ours.keys(True, True))  # (tdhook's also hold its pipeline's keys: docs/compat.md)
    assert keys and set(keys) <= set(ref.keys(True, True))
    for key in keys:
        torch.testing.assert_close(ours.get(key), ref.get(key))


def test_saliency_over_a_steered_hooked_module_is_the_steered_gradient() -> None:
    td = TensorDict(input=X.clone(), batch_size=[5])
    attr = nested(OURS, NESTED["saliency"], "steering", td)["attr", "input"]
    torch.testing.assert_close(attr, steered_gradient(make_model()))


def test_a_context_over_an_attribution_context_is_refused() -> None:
    model = make_model()
    with tdhook_fn.compat.attribution.Saliency().prepare(model) as attributing:
        with pytest.raises(NotImplementedError, match="runs Attributing, a module that computes more than the model"):
            tdhook_fn.compat.attribution.Saliency().prepare(attributing).__enter__()


@pytest.mark.parametrize("pre", ["steering", "pruning"])
def test_a_gpt2_on_token_ids_sees_the_pre_factory(pre: str) -> None:
    """A GPT-2 from a config on token ids: saliency of its last logit at the token embeddings, with a pre-factory that
    steers the first block's MLP or prunes the weights by magnitude: tdhook's numbers, changed by the pre-factory."""
    transformers = pytest.importorskip("transformers")
    from zoo import tiny_gpt2

    ids = torch.randint(0, 40, (3, 5), generator=torch.Generator().manual_seed(0))
    shift = 3 * torch.randn(16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    last = lambda targets, additional: TensorDict(logits=targets["logits"][:, -1, 3], batch_size=targets.batch_size)
    pres = {"steering": lambda lib: lib.latent.SteeringVectors(["transformer.h[0].mlp"],
                                                                lambda module_key, output: output + shift),
            # (lm_head's weight is wte's, which tdhook scores once a module: skipped, docs/compat.md; a pre-factory's
            # names start at the TensorDictModule)
            "pruning": lambda lib: lib.weights.Pruning(lambda module_key, parameter_name, parameter: parameter.abs(),
                                                       amount_to_prune=0.5,
                                                       skip_modules=lambda name, module: name == "module.lm_head")}

    def scenario(lib: Any, with_pre_factory: bool) -> torch.Tensor:
        model = tiny_gpt2(transformers).double()
        before = snapshot(model)
        factory = lib.attribution.Saliency(input_modules=["transformer.wte"], use_inputs=False,
                                           init_attr_targets=last)
        if with_pre_factory:
            factory = with_pre(factory, pres[pre](lib))
        with factory.prepare(model, in_keys={"input_ids": "input_ids"}, out_keys=["logits"]) as hooked:
            out = hooked(TensorDict(input_ids=ids, batch_size=[3]))["attr", "transformer.wte"]
        if lib is OURS:
            assert same(before, snapshot(model))
        return out

    ours = scenario(OURS, True)
    torch.testing.assert_close(ours, scenario(REF, True))
    assert (ours - scenario(OURS, False)).abs().max() > 1e-3  # the pre-factory changed the numbers


@pytest.mark.parametrize("make", ["saliency", "integrated_gradients"])
def test_a_pre_factory_that_changes_a_shape(make: str) -> None:
    """Steering that reshapes an activation, which the layer probe does not run (NOTE [hooks and shape probes]):
    the layer after it is measured again with the hook, and gives tdhook's map, on the first call and later."""
    def scenario(lib: Any) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(OrderedDict(l0=nn.Linear(4, 8), act=nn.Tanh(), flat=nn.Flatten(), l1=nn.Linear(8, 3)))
        steer = lib.latent.SteeringVectors(["l0"], lambda module_key, output: output.reshape(len(output), 2, 4))
        factory = {"saliency": lambda: lib.attribution.Saliency(input_modules=["act"], use_inputs=False),
                   "integrated_gradients": lambda: lib.attribution.IntegratedGradients(
                       n_steps=6, input_modules=["act"], use_inputs=False)}[make]()
        td = TensorDict(input=X.clone(), baseline=TensorDict(input=torch.zeros(5, 4), batch_size=[5]), batch_size=[5])
        with with_pre(factory, steer).prepare(model) as hooked:
            return [hooked(td.clone())["attr", "act"] for _ in range(2)]

    ours, ref = scenario(OURS), scenario(REF)
    assert ours[0].shape == (5, 2, 4)
    for got, expected in zip(ours, ref, strict=True):
        torch.testing.assert_close(got, expected)
