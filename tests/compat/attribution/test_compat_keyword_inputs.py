"""Keyword inputs (``in_keys`` given as a dict) in the compat contexts, against tdhook 0.1.3.

In transformers 5 GPT-2's second positional argument is the cache, so a dict is how an
``attention_mask`` reaches the model. As in tdhook (through tensordict's
``TensorDictModule``), the dict maps a forward keyword to the TensorDict key it is read
from: ``{"inputs_embeds": "embeds"}`` reads ``td["embeds"]`` and writes
``("attr", "embeds")``. Each test runs tdhook on a deep copy of the model and ours on the
model itself, with some rows padded.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import tdhook.attribution
import tdhook.weights
import torch
import transformers
from tensordict import TensorDict
from test_compat_attr_api import OURS, REF, assert_same
from test_compat_weights_adapters import SAE
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from zoo import same, snapshot

import tdhook_fn
import tdhook_fn.compat.attribution
import tdhook_fn.compat.weights
from tdhook_fn.attribution import guided_backprop

EMBEDS = {"inputs_embeds": "embeds", "attention_mask": "mask"}  # forward keyword -> TensorDict key
TOKENS = {"input_ids": "ids", "attention_mask": "mask"}
N, L = 3, 6
# tdhook's guided backprop puts a backward hook on GPT2Model, whose output is no tensor
pytestmark = pytest.mark.filterwarnings("ignore:For backward hooks to be called:UserWarning")


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()


def padded_mask() -> torch.Tensor:
    mask = torch.ones(N, L, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    mask[2, :1] = 0
    return mask


def embeds_td(mask: torch.Tensor | None = None) -> TensorDict:
    g = torch.Generator().manual_seed(1)
    embeds = torch.randn(N, L, 32, generator=g)
    return TensorDict(embeds=embeds, mask=padded_mask() if mask is None else mask,
                      baseline=TensorDict(embeds=0.1 * embeds.flip(1), batch_size=[N]), batch_size=[N])


def tokens_td() -> TensorDict:
    ids = torch.randint(0, 100, (N, L), generator=torch.Generator().manual_seed(2))
    return TensorDict(ids=ids, mask=padded_mask(), batch_size=[N])


def last_logit(outputs: TensorDict, additional: TensorDict) -> TensorDict:
    return TensorDict(out=outputs["logits"][..., -1, 3], batch_size=outputs.batch_size)


def only_embeds(inputs: TensorDict, additional: TensorDict) -> TensorDict:
    return inputs.select("embeds")  # the mask is an input, not an attributed one


def run(lib: Any, make: Callable[[Any], Any], model: torch.nn.Module, td: TensorDict, in_keys: dict[str, str],
        ) -> TensorDict:
    with make(lib).prepare(model, in_keys=in_keys, out_keys=["logits"]) as hooked:
        return hooked(td.clone())  # type: ignore[no-any-return]


def compare(make: Callable[[Any], Any], td: TensorDict, in_keys: dict[str, str]) -> TensorDict:
    """tdhook's and our output for the same factory, model and inputs; the model is left as it was."""
    model = gpt2()
    before = snapshot(model)
    ref = run(REF, make, copy.deepcopy(model), td, in_keys)
    ours = run(OURS, make, model, td, in_keys)
    assert same(before, snapshot(model))
    assert_same(ref, ours)
    return ours


def lrp(lib: Any, **options: Any) -> Any:
    return (tdhook.attribution if lib is REF else tdhook_fn.compat.attribution).LRP(**options)


EMBEDS_CASES: dict[str, Callable[[Any], Any]] = {
    "saliency": lambda lib: lib.Saliency(init_attr_targets=last_logit, init_attr_inputs=only_embeds),
    "saliency_abs_times_input": lambda lib: lib.Saliency(
        init_attr_targets=last_logit, init_attr_inputs=only_embeds, absolute=True, multiply_by_inputs=True),
    # tdhook's backward hook on a GPT2Block fails on the boolean mask it is given (see the test below)
    "guided_backprop": lambda lib: lib.GuidedBackpropagation(
        init_attr_targets=last_logit, init_attr_inputs=only_embeds, classes_to_skip=(GPT2Block,)),
    "integrated_gradients": lambda lib: lib.IntegratedGradients(
        init_attr_targets=last_logit, init_attr_inputs=only_embeds, n_steps=6),
    "lrp": lambda lib: lrp(lib, init_attr_targets=last_logit, init_attr_inputs=only_embeds,
                           warn_on_missing_rule=False),
}


@pytest.mark.parametrize("name", list(EMBEDS_CASES))
def test_embeddings_with_a_padded_attention_mask_match_tdhook(name: str) -> None:
    ours = compare(EMBEDS_CASES[name], embeds_td(), EMBEDS)
    assert list(ours["attr"].keys()) == ["embeds"]
    assert ours["attr", "embeds"].shape == (N, L, 32)
    unmasked = run(OURS, EMBEDS_CASES[name], gpt2(), embeds_td(torch.ones(N, L, dtype=torch.long)), EMBEDS)
    assert not torch.allclose(ours["attr", "embeds"], unmasked["attr", "embeds"])  # the mask got in


TOKENS_CASES: dict[str, Callable[[Any], Any]] = {
    "saliency_of_the_embedding": lambda lib: lib.Saliency(
        init_attr_targets=last_logit, use_inputs=False, input_modules=["transformer.wte"], multiply_by_inputs=True),
    "grad_cam_embedding": lambda lib: lib.GradCAM(
        {"transformer.wte": lib.DimsConfig((1,), (2,))}, init_attr_targets=last_logit),
    "grad_cam_mlp": lambda lib: lib.GradCAM(
        {"transformer.h.0.mlp": lib.DimsConfig((1,), (2,))}, init_attr_targets=last_logit, absolute=True),
}


@pytest.mark.parametrize("name", list(TOKENS_CASES))
def test_token_ids_with_a_padded_attention_mask_match_tdhook(name: str) -> None:
    ours = compare(TOKENS_CASES[name], tokens_td(), TOKENS)
    assert len(list(ours["attr"].keys())) == 1


def test_guided_backprop_where_tdhook_fails_on_the_boolean_mask() -> None:
    """GPT-2 hands its blocks a boolean mask; tdhook's backward hook ReLUs its gradient and fails.

    Ours applies the ReLU to the gradients of floating-point inputs only, as the pure method does.
    """
    make = EMBEDS_CASES["saliency"]
    guided = lambda lib: lib.GuidedBackpropagation(init_attr_targets=last_logit, init_attr_inputs=only_embeds)
    with pytest.raises(RuntimeError, match="Boolean inputs not supported for relu"):
        run(REF, guided, gpt2(), embeds_td(), EMBEDS)
    model = gpt2()
    ours = run(OURS, guided, model, embeds_td(), EMBEDS)
    f = tdhook_fn.functional(model, {"embeds": "inputs_embeds", "mask": "attention_mask"}, ["logits"])
    expected = guided_backprop(f, tdhook_fn.params(model), embeds_td().exclude("baseline"),
                               target=lambda out: out["logits"][..., -1, 3], input_keys=["embeds"])
    torch.testing.assert_close(ours["attr", "embeds"], expected["embeds"])
    plain = run(OURS, make, gpt2(), embeds_td(), EMBEDS)
    assert not torch.allclose(ours["attr", "embeds"], plain["attr", "embeds"])


def test_an_integer_mask_is_not_attributed_unless_chosen() -> None:
    """Without ``init_attr_inputs`` every in_key is attributed: an integer mask is refused, naming it."""
    with pytest.raises(RuntimeError, match="floating point"):
        run(REF, lambda lib: lib.Saliency(init_attr_targets=last_logit), gpt2(), embeds_td(), EMBEDS)
    with pytest.raises(TypeError, match="'mask'"):
        run(OURS, lambda lib: lib.Saliency(init_attr_targets=last_logit), gpt2(), embeds_td(), EMBEDS)


def test_a_float_mask_the_model_only_compares_gets_zero_attributions() -> None:
    """tdhook fails in ``autograd.grad`` (the mask is unused in the graph); its gradient is zero."""
    td = embeds_td(padded_mask().float())
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        run(REF, lambda lib: lib.Saliency(init_attr_targets=last_logit), gpt2(), td, EMBEDS)
    ours = run(OURS, lambda lib: lib.Saliency(init_attr_targets=last_logit), gpt2(), td, EMBEDS)
    chosen = run(OURS, EMBEDS_CASES["saliency"], gpt2(), td, EMBEDS)
    assert torch.equal(ours["attr", "mask"], torch.zeros(N, L))
    torch.testing.assert_close(ours["attr", "embeds"], chosen["attr", "embeds"])


def test_adapters_with_keyword_inputs_match_tdhook() -> None:
    model = gpt2()
    outputs = []
    for lib, on in ((tdhook.weights, copy.deepcopy(model)), (tdhook_fn.compat.weights, model)):
        torch.manual_seed(1)
        adapters = {"sae": (SAE(32), "transformer.h.0.mlp", "transformer.h.0.mlp")}
        with lib.Adapters(adapters).prepare(on, in_keys=TOKENS, out_keys=["logits"]) as hooked:
            outputs.append(hooked(tokens_td())["logits"].detach())
    torch.testing.assert_close(outputs[1], outputs[0])


def test_integrated_gradients_times_inputs_add_up_with_the_mask() -> None:
    """tdhook 0.1.3 fails here (it multiplies and sums every in_key, the mask too); ours keeps completeness."""
    model, td = gpt2(), embeds_td()
    make = lambda lib: lib.IntegratedGradients(init_attr_targets=last_logit, init_attr_inputs=only_embeds, n_steps=50,
                                               multiply_by_inputs=True, compute_convergence_delta=True)
    with pytest.raises(KeyError):
        run(REF, make, copy.deepcopy(model), td, EMBEDS)
    ours = run(OURS, make, model, td, EMBEDS)
    with torch.no_grad():
        logit = lambda x: model(inputs_embeds=x, attention_mask=td["mask"]).logits[:, -1, 3]
        change = logit(td["embeds"]) - logit(td["baseline", "embeds"])
    torch.testing.assert_close(ours["attr", "embeds"].sum((1, 2)), change, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours["convergence_delta"], torch.zeros(N), atol=1e-5, rtol=0)
