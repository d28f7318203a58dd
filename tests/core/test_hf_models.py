"""Real model patterns: dict and ModelOutput outputs, Hugging Face models, accelerate dispatch."""

import copy

import accelerate
import pytest
import torch
import transformers
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import integrated_gradients


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return {"logits": self.lin(x), "hidden": torch.tanh(self.lin(x))}  # not in sorted order


def test_dict_outputs_are_mapped_by_key():
    model = TwoHeads()
    x = torch.randn(4, 3)
    td = TensorDict(input=x, batch_size=[4])
    out = tdhook_fn.functional(model, out_keys=["logits", "hidden"])(tdhook_fn.params(model), td)
    torch.testing.assert_close(out["logits"], model.lin(x))
    torch.testing.assert_close(out["hidden"], torch.tanh(model.lin(x)))
    only = tdhook_fn.functional(model, out_keys=["hidden"])(tdhook_fn.params(model), td)
    assert set(only.keys()) == {"hidden"}


def test_dict_output_key_mismatch_names_the_keys():
    model = TwoHeads()
    f = tdhook_fn.functional(model, out_keys=["output"])
    with pytest.raises(KeyError, match=r"no 'output'.*\['logits', 'hidden'\]"):
        f(tdhook_fn.params(model), TensorDict(input=torch.randn(2, 3), batch_size=[2]))


def test_nested_dict_output_by_tuple_key():
    class Nested(nn.Module):
        def forward(self, x):
            return {"a": {"b": x * 2, "c": x}}

    f = tdhook_fn.functional(Nested(), out_keys=[("a", "c"), ("a", "b")])
    out = f(TensorDict(), TensorDict(input=torch.ones(2), batch_size=[2]))
    assert torch.equal(out["a", "b"], 2 * torch.ones(2)) and torch.equal(out["a", "c"], torch.ones(2))


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=40, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).eval()


def test_model_output_logits_by_key():
    model = _gpt2()
    ids = torch.randint(0, 40, (2, 6))
    f = tdhook_fn.functional(model, in_keys=["input_ids"], out_keys=["logits"])
    out = f(tdhook_fn.params(model), TensorDict(input_ids=ids, batch_size=[2]))
    torch.testing.assert_close(out["logits"], model(ids).logits)


def test_accelerate_dispatched_model_uses_the_given_params():
    model = _gpt2()
    reference = copy.deepcopy(model)
    accelerate.dispatch_model(model, device_map={"transformer.h.0": "cpu", "transformer.h.1": "cpu", "": "cpu"},
                              force_hooks=True)
    assert hasattr(model.transformer.h[0], "_hf_hook")
    ids = torch.randint(0, 40, (2, 6))
    p = tdhook_fn.params(reference).apply(lambda t: t * 0.5 if t.is_floating_point() else t)
    ours = tdhook_fn.call(model, p, ids).logits
    expected = tdhook_fn.call(reference, p, ids).logits
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_embedding_ig_on_gpt2():
    model = _gpt2()
    ids = torch.randint(1, 40, (2, 6))
    last = lambda td: TensorDict(logits=td["logits"][..., -1, 3], batch_size=td.batch_size)
    f = tdhook_fn.functional(model, in_keys=["input_ids"], out_keys=["logits"])
    attr, delta = integrated_gradients(f, tdhook_fn.params(model), TensorDict(input_ids=ids, batch_size=[2]), 0,
                                       target=last, layers=["transformer.wte"], n_steps=64,
                                       return_convergence_delta=True)
    assert attr["transformer.wte"].shape == (2, 6, 16)
    assert delta.abs().max() < 1e-3


def test_embedding_ig_with_an_attention_mask_matches_captum():
    from captum.attr import LayerIntegratedGradients

    model = _gpt2()
    f = tdhook_fn.functional(model, in_keys={"input_ids": "input_ids", "attention_mask": "attention_mask"},
                             out_keys=["logits"])
    ids = torch.randint(1, 40, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    td = TensorDict(input_ids=ids, attention_mask=mask, batch_size=[2])
    last = lambda out: TensorDict(logits=out["logits"][..., -1, 3], batch_size=out.batch_size)
    p = tdhook_fn.params(model)
    with pytest.raises(ValueError, match=r"keyword arguments.*input_keys=\['input_ids'\]"):
        integrated_gradients(f, p, td, 0, target=last, layers=["transformer.wte"])
    ours = integrated_gradients(f, p, td, 0, target=last, layers=["transformer.wte"], input_keys=["input_ids"],
                                n_steps=16)["transformer.wte"]
    forward = lambda i, m: model(input_ids=i, attention_mask=m).logits[:, -1, 3]
    theirs = LayerIntegratedGradients(forward, model.transformer.wte).attribute(
        ids, torch.zeros_like(ids), additional_forward_args=(mask,), n_steps=16)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)


def test_activation_checkpointing_in_training_mode_is_refused() -> None:
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=30, n_positions=8)
    model = transformers.GPT2LMHeadModel(config)
    model.gradient_checkpointing_enable()
    model.train()
    f, p = tdhook_fn.pure(model, in_keys=["input_ids"], out_keys=["logits"])
    ids = TensorDict(input_ids=torch.randint(0, 30, (2, 5)), batch_size=[2])
    with pytest.raises(RuntimeError, match=r"uses activation checkpointing \(gradient_checkpointing=True"):
        f(p, ids)
    model.eval()  # the layers check ``self.training`` before they checkpoint
    assert f(p, ids)["logits"].shape == (2, 5, 30)
