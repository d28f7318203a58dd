"""lrp on real model patterns: GPT-2 (fused q/k/v, LayerNorm, Conv1D), accelerate hooks."""

from __future__ import annotations

import copy
from typing import Any

import accelerate
import pytest
import torch
import transformers
from _tolerance import assert_close_ulps
from tensordict import TensorDict
from torch import nn
from transformers.activations import NewGELUActivation
from transformers.pytorch_utils import Conv1D
from zoo import same, snapshot

import tdhook_fn
from tdhook_fn.attribution import AHQKV, Epsilon, LayerNorm, Pass, lrp

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")

RULES: dict[Any, Any] = {
    r"transformer\.h\.\d+\.attn\.c_attn": AHQKV(),
    Conv1D: Epsilon(),
    nn.Linear: Epsilon(),
    nn.LayerNorm: LayerNorm(),
    NewGELUActivation: Pass(),
}


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=12, n_head=2, vocab_size=30, n_positions=8,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).eval()


def last_token(td: TensorDict) -> TensorDict:
    return TensorDict(logits=td["logits"][..., -1, 3], batch_size=td.batch_size)


def run(model: nn.Module, ids: torch.Tensor, **options: Any) -> TensorDict:
    f = tdhook_fn.functional(model, in_keys=["input_ids"], out_keys=["logits"])
    td = TensorDict(input_ids=ids, batch_size=ids.shape[:1])
    return lrp(f, tdhook_fn.params(model), td, target=last_token, rules=RULES, layers=["transformer.wte"],
               use_inputs=False, warn_on_missing_rule=False, **options)


def test_gpt2_relevance_of_the_token_embeddings() -> None:
    model = gpt2()
    before = snapshot(model)
    ids = torch.randint(0, 30, (3, 5))
    relevance = run(model, ids)["transformer.wte"]
    assert relevance.shape == (3, 5, 12) and bool(relevance.isfinite().all()) and relevance.abs().sum() > 0
    f = tdhook_fn.functional(model, in_keys=["input_ids"], out_keys=["logits"])
    one = lambda i: lrp(f, tdhook_fn.params(model), TensorDict(input_ids=i, batch_size=[]), target=last_token,
                        rules=RULES, layers=["transformer.wte"], use_inputs=False, warn_on_missing_rule=False)
    assert_close_ulps(torch.func.vmap(one)(ids)["transformer.wte"], relevance, ulps=16)
    assert same(before, snapshot(model))


def test_gpt2_rules_change_the_map() -> None:
    """The fused-qkv rule sends nothing through q and k: the map differs from epsilon everywhere."""
    model = gpt2()
    ids = torch.randint(0, 30, (2, 5))
    with_ahqkv = run(model, ids)["transformer.wte"]
    RULES_EPS = {k: v for k, v in RULES.items() if not isinstance(v, AHQKV)}
    f = tdhook_fn.functional(model, in_keys=["input_ids"], out_keys=["logits"])
    eps = lrp(f, tdhook_fn.params(model), TensorDict(input_ids=ids, batch_size=[2]), target=last_token,
              rules=RULES_EPS, layers=["transformer.wte"], use_inputs=False, warn_on_missing_rule=False)
    assert not torch.allclose(with_ahqkv, eps["transformer.wte"])


def test_accelerate_dispatched_gpt2_gives_the_plain_models_map() -> None:
    model = gpt2()
    reference = copy.deepcopy(model)
    accelerate.dispatch_model(model, device_map={"transformer.h.0": "cpu", "transformer.h.1": "cpu", "": "cpu"},
                              force_hooks=True)
    ids = torch.randint(0, 30, (2, 5))
    expected = run(reference, ids)
    try:
        actual = run(model, ids)
    except TypeError as error:  # what we cannot handle must say so
        pytest.fail(f"accelerate: {error}")
    assert_close_ulps(actual, expected)
