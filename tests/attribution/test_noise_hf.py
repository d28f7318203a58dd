"""smoothgrad and gradient_shap on a Hugging Face GPT-2 (random init), noising its input embeddings, with a mask."""

import captum.attr as ca
import numpy as np
import pytest
import torch
import transformers
from tensordict import TensorDict
from zoo import tiny_gpt2

import tdhook_fn
from tdhook_fn.attribution._gradient_shap import gradient_shap
from tdhook_fn.attribution._smoothgrad import smoothgrad

pytestmark = [pytest.mark.filterwarnings("ignore:Input Tensor .* did not already require gradients:UserWarning")]


def _gpt2_on_embeddings():
    model = tiny_gpt2(transformers)
    f = tdhook_fn.functional(model, in_keys={"inputs_embeds": "inputs_embeds", "attention_mask": "attention_mask"},
                             out_keys=["logits"])
    ids = torch.randint(1, 40, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    with torch.no_grad():
        embeds = model.transformer.wte(ids)
    td = TensorDict(inputs_embeds=embeds, attention_mask=mask, batch_size=[2])
    forward = lambda e, m: model(inputs_embeds=e, attention_mask=m).logits[:, -1, 3]
    return model, f, td, forward


def _last(out):
    return TensorDict(logits=out["logits"][..., -1, 3], batch_size=out.batch_size)


def test_smoothgrad_on_gpt2_embeddings_equals_captum_noise_tunnel():
    model, f, td, forward = _gpt2_on_embeddings()
    torch.manual_seed(4)
    ours = smoothgrad(f, tdhook_fn.params(model), td, target=_last, input_keys=["inputs_embeds"], nt_type="vargrad",
                      nt_samples=5, stdevs=0.1)["inputs_embeds"]
    torch.manual_seed(4)
    theirs = ca.NoiseTunnel(ca.Saliency(forward)).attribute(
        td["inputs_embeds"].clone(), nt_type="vargrad", nt_samples=5, stdevs=0.1, abs=False,
        additional_forward_args=(td["attention_mask"],))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-8)


def test_gradient_shap_on_gpt2_embeddings_equals_captum_given_its_draws():
    model, f, td, forward = _gpt2_on_embeddings()
    refs = TensorDict(inputs_embeds=0.1 * torch.randn(4, 6, 16), batch_size=[4])
    np.random.seed(0)
    torch.manual_seed(0)
    index = torch.tensor(np.random.choice(4, 2 * 3)).view(2, 3)
    noise = (torch.randn(2 * 3, 6, 16) * 0.05).view(2, 3, 6, 16)
    alpha = torch.tensor(np.random.uniform(0.0, 1.0, 2 * 3)).view(2, 3)
    draws = TensorDict(index=index, alpha=alpha, noise=TensorDict(inputs_embeds=noise, batch_size=[2, 3]),
                       batch_size=[2, 3])
    ours, delta = gradient_shap(f, tdhook_fn.params(model), td, refs, target=_last, input_keys=["inputs_embeds"],
                                n_samples=3, draws=draws, return_convergence_delta=True)
    np.random.seed(0)
    torch.manual_seed(0)
    theirs, their_delta = ca.GradientShap(forward).attribute(
        td["inputs_embeds"].clone(), refs["inputs_embeds"], n_samples=3, stdevs=0.05,
        additional_forward_args=(td["attention_mask"],), return_convergence_delta=True)
    torch.testing.assert_close(ours["inputs_embeds"], theirs, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(delta.reshape(-1), their_delta, rtol=1e-4, atol=1e-6)
