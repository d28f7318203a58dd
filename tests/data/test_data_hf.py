"""tdhook_fn.data.attribute on a Hugging Face GPT-2 from a config: integer ids, an attention mask, labels."""

from __future__ import annotations

import torch
import transformers
from tensordict import TensorDict
from torch.utils.data import Dataset

import tdhook_fn
import tdhook_fn.data
from tdhook_fn.attribution import integrated_gradients


class Prompts(Dataset):
    """Token ids with a left-padding mask and a label token per prompt, as a tokenizer's output would be."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 40, (n, 6), generator=g)
        self.mask = torch.ones(n, 6, dtype=torch.long)
        self.mask[::3, :2] = 0
        self.label = torch.randint(0, 40, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "label": self.label[i]}


def test_embedding_ig_over_a_dataset_of_prompts_equals_one_call(tmp_path) -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=40, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).eval()
    f = tdhook_fn.functional(model, in_keys={"input_ids": "input_ids", "attention_mask": "attention_mask"},
                             out_keys=["logits"])
    p = tdhook_fn.params(model)
    data = Prompts(10)

    def label_logit(out: TensorDict) -> torch.Tensor:  # the label token's logit at the last position
        logits = out["logits"][..., -1, :]
        return logits.gather(-1, out["label"].expand(logits.shape[:-1]).unsqueeze(-1)).squeeze(-1)

    kwargs = dict(target=label_logit, layers=["transformer.wte"], input_keys=["input_ids"], n_steps=8)
    out = tdhook_fn.data.attribute(integrated_gradients, f, p, data, tmp_path / "gpt2", batch_size=4,
                                   progress=False, baselines=0, **kwargs)
    whole = TensorDict(input_ids=data.ids, attention_mask=data.mask, label=data.label, batch_size=[10])
    expected = integrated_gradients(f, p, whole, 0, **kwargs)
    assert out["transformer.wte"].shape == (10, 6, 16)
    torch.testing.assert_close(out["transformer.wte"], expected["transformer.wte"], rtol=1e-5, atol=1e-6)
