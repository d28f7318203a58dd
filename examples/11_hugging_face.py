"""Hugging Face models: token-id attributions, caching, patching and steering on GPT-2; BERT.

The steps of docs/methods/hugging-face.md in one script, on small random-init models (no
download): integrated gradients at the token embeddings of left-padded prompts (the
attention mask passed unchanged), a cache of the residual stream, a patching sweep beside
attribution patching, steering with an alpha sweep, and integrated gradients of a BERT
sequence classifier. Random weights make the numbers meaningless; for a real model load
it with ``from_pretrained`` and the calls stay the same. Writes ``11_hugging_face.png``.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import torch
import transformers
from _digits import setup_example
from _plots import SIGNED, robust_limit, save
from tensordict import TensorDict

import tdhook_fn
from tdhook_fn.attribution import integrated_gradients
from tdhook_fn.latent import Site, activation_addition, attribution_patching, cache, patching_sweep, sites, steer

PAD, CLS, SEP = 0, 1, 2
ANSWER, OTHER = 7, 8
BOTH_KEYS = {"input_ids": "input_ids", "attention_mask": "attention_mask"}  # passed by keyword


def gpt2(layers: int) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=100, n_positions=64,
                                     bos_token_id=99, eos_token_id=99, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(config).eval()


def next_token_logit(out: TensorDict) -> torch.Tensor:
    """The logit of the token under the inputs' ``"next"`` key, at the last position."""
    return out["logits"][..., -1, :].gather(-1, out["next"][..., None])[..., 0]


def logit_difference(out: TensorDict) -> torch.Tensor:
    logits = out["logits"][..., -1, :]
    return logits[..., ANSWER] - logits[..., OTHER]


def token_attributions(f: tdhook_fn.Functional, params: TensorDict) -> torch.Tensor:
    ids = torch.tensor([[11, 12, 13, 14, 15, 16], [PAD, PAD, 21, 22, 23, 24]])  # the second left-padded
    prompts = TensorDict(input_ids=ids, attention_mask=(ids != PAD).long(), batch_size=[2])
    prompts["next"] = f(params, prompts)["logits"][:, -1].argmax(-1)
    attr, delta = integrated_gradients(f, params, prompts, PAD, target=next_token_logit, layers=["transformer.wte"],
                                       input_keys=["input_ids"], n_steps=32, return_convergence_delta=True)
    print(f"GPT-2 integrated gradients at the token embeddings: convergence delta {delta.abs().max():.1e}")
    acts = cache(f, params, prompts, sites(f.model, r"transformer\.h\.\d+"))
    print("cached residual stream:", {key: tuple(value.shape) for key, value in acts.items()})
    return attr["transformer.wte"].sum(-1)


def patching(f: tdhook_fn.Functional, params: TensorDict, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    clean = TensorDict(input_ids=torch.tensor([[11, 12, 13, 14, 15, 16], [31, 32, 33, 34, 35, 36]]), batch_size=[2])
    clean["attention_mask"] = torch.ones_like(clean["input_ids"])
    corrupted = clean.clone()
    corrupted["input_ids"][:, 2] = 50
    grid = [Site(f"transformer.h.{layer}", index=(t,)) for layer in range(layers) for t in range(6)]
    change = patching_sweep(f, params, clean, corrupted, grid, logit_difference)
    change = change - logit_difference(f(params, corrupted))
    estimates = attribution_patching(f, params, clean, corrupted, grid, logit_difference)
    correlation = torch.corrcoef(torch.stack([change.flatten(), estimates.flatten()]))[0, 1]
    print(f"patching sweep over {len(grid)} sites; attribution patching's correlation with it: {correlation:.3f}")
    return change.mean(-1).reshape(layers, 6), estimates.mean(-1).reshape(layers, 6)


def steering(f: tdhook_fn.Functional, params: TensorDict, alphas: torch.Tensor) -> torch.Tensor:
    clean = TensorDict(input_ids=torch.tensor([[11, 12, 13, 14, 15, 16], [31, 32, 33, 34, 35, 36]]), batch_size=[2])
    clean["attention_mask"] = torch.ones_like(clean["input_ids"])
    positive = clean.clone()
    positive["input_ids"][:, 3] = 60
    site = Site("transformer.h.1", index=(-1,))
    vector = activation_addition(f, params, positive, clean, site)
    return logit_difference(steer(f, params, clean, site, vector, alpha=alphas)).mean(-1)


def bert_attributions() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64, num_labels=3,
                                     pad_token_id=PAD, attn_implementation="eager")
    bert = transformers.BertForSequenceClassification(config).eval()
    ids = torch.tensor([[CLS, 11, 12, 13, 14, SEP], [CLS, 21, 22, SEP, PAD, PAD]])
    sentences = TensorDict(input_ids=ids, attention_mask=(ids != PAD).long(), batch_size=[2])
    g, params = tdhook_fn.functional(bert, in_keys=BOTH_KEYS, out_keys=["logits"]), tdhook_fn.params(bert)
    predicted = g(params, sentences)["logits"].argmax(-1)
    special = (ids == CLS) | (ids == SEP)
    baseline = TensorDict(input_ids=torch.where(special, ids, PAD), batch_size=[2])
    scores, delta = integrated_gradients(g, params, sentences, baseline, target=predicted,
                                         layers=["bert.embeddings.word_embeddings"], input_keys=["input_ids"],
                                         n_steps=32, return_convergence_delta=True)
    print(f"BERT classifier, integrated gradients at the word embeddings: convergence delta {delta.abs().max():.1e}")
    return scores["bert.embeddings.word_embeddings"].sum(-1), ids


def main() -> None:
    args = setup_example(__doc__.splitlines()[0])
    layers = 2 if args.quick else 4
    model = gpt2(layers)
    f = tdhook_fn.functional(model, in_keys=BOTH_KEYS, out_keys=["logits"])
    params = tdhook_fn.params(model)
    tokens = token_attributions(f, params)
    patched, estimated = patching(f, params, layers)
    alphas = torch.linspace(0.0, 4.0, 9)
    steered = steering(f, params, alphas)
    bert_scores, bert_ids = bert_attributions()

    fig, axes = plt.subplots(1, 5, figsize=(20, 3.6), layout="constrained")
    for row, label in enumerate(["prompt 1", "prompt 2 (2 pads)"]):
        axes[0].bar(torch.arange(6) + 0.4 * row - 0.2, tokens[row], width=0.4, label=label)
    axes[0].set(title="GPT-2: IG per token (token ids)", xlabel="position", ylabel="attribution")
    axes[0].legend(fontsize=8)
    limit = max(robust_limit(patched, 1.0), robust_limit(estimated, 1.0))
    for ax, values, title in [(axes[1], patched, "patching_sweep"), (axes[2], estimated, "attribution_patching")]:
        image = ax.imshow(values.numpy(), cmap=SIGNED, vmin=-limit, vmax=limit, aspect="auto")
        ax.set(title=title, xlabel="position", ylabel="layer", yticks=range(layers))
    fig.colorbar(image, ax=axes[1:3], label="change of the logit difference\n(patched - corrupted)")
    axes[3].plot(alphas, steered, marker="o")
    axes[3].set(title="steer: alpha sweep in one call", xlabel="alpha", ylabel="logit difference")
    special = (bert_ids == CLS) | (bert_ids == SEP) | (bert_ids == PAD)  # 0 by construction: not drawn
    for row in range(2):
        shown = bert_scores[row].masked_fill(special[row], float("nan"))
        axes[4].bar(torch.arange(6) + 0.4 * row - 0.2, shown, width=0.4, label=f"sentence {row + 1}")
    axes[4].set(title="BERT classifier: IG per token", xlabel="position", ylabel="attribution")
    axes[4].legend(fontsize=8)
    fig.suptitle("Random-init Hugging Face models (the numbers are meaningless; the calls are the point)")
    print(f"picture: {save(fig, args.out, '11_hugging_face.png')}")


if __name__ == "__main__":
    main()
