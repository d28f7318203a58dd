"""patching_sweep's default on models with torch's fused attention (sdpa): the loop's numbers, no vmap warning."""

import warnings

import pytest
import torch
import transformers
from tensordict import TensorDict

import tdhook_fn
from tdhook_fn.latent import Site, cache, patch, patching_sweep
from tdhook_fn.latent._chunks import RunSize, chunked

L, V = 6, 40


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=V, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    assert config._attn_implementation in (None, "sdpa")  # the default: torch's fused attention
    model = transformers.GPT2LMHeadModel(config).eval()
    return model, tdhook_fn.functional(model, in_keys=["input_ids"], out_keys=["logits"]), tdhook_fn.params(model)


@pytest.fixture(scope="module")
def gpt2():
    return _gpt2()


@pytest.fixture(scope="module")
def bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.BertForSequenceClassification(config).eval()
    assert model.config._attn_implementation == "sdpa"
    f = tdhook_fn.functional(model, in_keys={"input_ids": "input_ids", "attention_mask": "attention_mask"},
                             out_keys=["logits"])
    return model, f, tdhook_fn.params(model)


def _pair(n=3, padded=False):
    out = []
    for seed in (1, 2):
        ids = torch.randint(0, V, (n, L), generator=torch.Generator().manual_seed(seed))
        td = TensorDict(input_ids=ids, batch_size=[n])
        if padded:  # a mask per sample: the folded attention must give each run its samples' rows
            td["attention_mask"] = torch.ones(n, L, dtype=torch.long)
            td["attention_mask"][1, -2:] = 0
        out.append(td)
    return out


def _metric(out):
    return out["logits"][..., -1, 3] - out["logits"][..., 1, 5]


def _bert_metric(out):
    return out["logits"][..., 1] - out["logits"][..., 0]


def _loop(f, p, clean, corrupt, sites, metric):
    sources = cache(f, p, clean, sites)
    return torch.stack([metric(patch(f, p, corrupt, s, sources.select(s.key))) for s in sites])


def _quiet_sweep(*args, **kwargs):
    """The sweep, asserting it lets no batching-rule warning out."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values = patching_sweep(*args, **kwargs)
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "batching rule" in m], messages
    return values


GRID = [Site(f"transformer.h.{layer}", index=(t,)) for layer in range(3) for t in range(L)]
# one head of the attention (the input of its output projection, per position) and an MLP feature
HEADS = [Site(f"transformer.h.{layer}.attn.c_proj", index=(t, slice(8 * h, 8 * h + 8)), site="input")
         for layer in (0, 2) for t in (1, 4) for h in range(4)] + [Site("transformer.h.1.mlp", index=(slice(None), 7))]


@pytest.mark.parametrize("chunk_size", [None, 1, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_gpt2_default_sweep_equals_the_loop_without_a_vmap_warning(gpt2, chunk_size, causal):
    _, f, p = gpt2
    clean, corrupt = _pair()
    got = _quiet_sweep(f, p, clean, corrupt, GRID, _metric, chunk_size=chunk_size, causal=causal)
    torch.testing.assert_close(got, _loop(f, p, clean, corrupt, GRID, _metric), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_gpt2_heads_and_features_equal_the_loop(gpt2, causal):
    _, f, p = gpt2
    clean, corrupt = _pair()
    got = _quiet_sweep(f, p, clean, corrupt, HEADS, _metric, causal=causal, chunk_size=None if causal else 3)
    torch.testing.assert_close(got, _loop(f, p, clean, corrupt, HEADS, _metric), rtol=1e-4, atol=1e-5)


def test_runs_out_of_module_order_come_back_in_the_callers_order(gpt2):
    _, f, p = gpt2
    clean, corrupt = _pair()
    by_position = [Site(f"transformer.h.{layer}", index=(t,)) for t in range(L) for layer in (2, 0, 1)]
    got = _quiet_sweep(f, p, clean, corrupt, by_position, _metric)
    torch.testing.assert_close(got, _loop(f, p, clean, corrupt, by_position, _metric), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_bert_with_a_padding_mask_equals_the_loop(bert, chunk_size):
    _, f, p = bert
    clean, corrupt = _pair(padded=True)
    corrupt["attention_mask"] = clean["attention_mask"]
    grid = [Site(f"bert.encoder.layer.{layer}", index=(t,)) for layer in range(2) for t in range(L)]
    got = _quiet_sweep(f, p, clean, corrupt, grid, _bert_metric, chunk_size=chunk_size)
    torch.testing.assert_close(got, _loop(f, p, clean, corrupt, grid, _bert_metric), rtol=1e-4, atol=1e-5)


def test_gradients_through_the_folded_attention_equal_the_loops():
    _, f, p = _gpt2()
    clean, corrupt = _pair(2)
    sites = GRID[::4]
    leaves = p.apply(lambda t: t.detach().requires_grad_())
    weight = leaves["transformer", "h", "1", "attn", "c_attn", "weight"]
    (grad_sweep,) = torch.autograd.grad(_quiet_sweep(f, leaves, clean, corrupt, sites, _metric).sum(), weight)
    (grad_loop,) = torch.autograd.grad(_loop(f, leaves, clean, corrupt, sites, _metric).sum(), weight)
    torch.testing.assert_close(grad_sweep, grad_loop, rtol=1e-4, atol=1e-5)


def test_a_module_that_runs_twice_is_named_by_the_sweep():
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.head = torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.head(self.block(self.block(x)))

    model = Twice().eval()
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    clean, corrupt = (TensorDict(input=torch.randn(4, 3), batch_size=[4]) for _ in range(2))
    for batching in ("vmap", "fold"):
        with pytest.raises(ValueError, match=r"patching_sweep: site 'block' ran 2 times.*call=") as info:
            patching_sweep(f, p, clean, corrupt, [Site("block", index=(0,))], lambda o: o["output"][..., 0],
                           batching=batching)
        assert "_tdhook_fn" not in str(info.value)


def test_default_chunks_follow_the_modules_within_memory(gpt2):
    model, _, _ = gpt2
    runs = [Site(f"transformer.h.{layer}", index=(t,)) for t in range(4) for layer in (2, 0)]
    chunks = chunked(model, runs, RunSize(rows=8, bytes=1000), None, share=True)
    order = [k for chunk in chunks for k in chunk]
    assert sorted(order) == list(range(len(runs)))
    assert [runs[k].path for k in order] == ["transformer.h.0"] * 4 + ["transformer.h.2"] * 4  # layer by layer
    assert all(len(c) == 1 for c in chunked(model, runs, RunSize(rows=8, bytes=1 << 40), None, share=True))
    assert [len(c) for c in chunked(model, runs, RunSize(rows=8, bytes=1000), 3, share=True)] == [3, 3, 2]
