"""The latent toolkit on random-init Hugging Face models, against hand-written hook references."""

import copy

import pytest
import torch
import transformers
from tensordict import TensorDict

import tdhook_fn
from tdhook_fn.latent import (
    Site,
    activation_addition,
    attribution_patching,
    cache,
    patch,
    patching_sweep,
    sites,
    steer,
)

L, V = 6, 40


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=V, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).eval()
    f = tdhook_fn.functional(model, in_keys={"input_ids": "input_ids", "attention_mask": "attention_mask"},
                             out_keys=["logits"])
    return model, f, tdhook_fn.params(model)


def _batch(seed, n=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (n, L), generator=g)
    mask = torch.ones(n, L, dtype=torch.long)
    mask[1, :2] = 0  # left padding in the second sample
    return TensorDict(input_ids=ids, attention_mask=mask, batch_size=[n])


def _run_with_hook(model, td, path, fn):
    """A plain forward of a copy of the model with a torch hook replacing ``path``'s output."""
    twin = copy.deepcopy(model)
    handle = twin.get_submodule(path).register_forward_hook(lambda m, a, o: fn(o))
    try:
        return twin(input_ids=td["input_ids"], attention_mask=td["attention_mask"]).logits
    finally:
        handle.remove()


def _last_logit(out):
    return out["logits"][..., -1, 3]


def test_cache_blocks_equals_hidden_states(gpt2):
    model, f, p = gpt2
    td = _batch(0)
    blocks = sites(model, r"transformer\.h\.\d+")
    acts = cache(f, p, td, blocks, outputs=True)
    hidden = model(input_ids=td["input_ids"], attention_mask=td["attention_mask"], output_hidden_states=True)
    for i in range(2):  # the last hidden state has ln_f applied
        torch.testing.assert_close(acts[f"transformer.h.{i}"], hidden.hidden_states[i + 1])
    torch.testing.assert_close(acts["logits"], hidden.logits)
    attn = cache(f, p, td, Site("transformer.h.1.attn", index=(slice(None), 0)))  # element 0 of (out, weights)
    assert attn["transformer.h.1.attn[:][0]"].shape == (2, L)


def test_patch_equals_a_hook_reference(gpt2):
    model, f, p = gpt2
    clean, corrupt = _batch(1), _batch(2)
    site = Site("transformer.h.1", index=(3,))
    source = cache(f, p, clean, site)
    ours = patch(f, p, corrupt, site, source)["logits"]

    def replace(out):
        out = out.clone()
        out[:, 3] = source[site.key]
        return out

    torch.testing.assert_close(ours, _run_with_hook(model, corrupt, "transformer.h.1", replace))


def test_patching_sweep_equals_the_loop(gpt2):
    model, f, p = gpt2
    clean, corrupt = _batch(1), _batch(2)
    grid = [Site(f"transformer.h.{layer}", index=(t,)) for layer in range(3) for t in range(L)]
    sweep = patching_sweep(f, p, clean, corrupt, grid, _last_logit)
    loop = torch.stack([_last_logit(patch(f, p, corrupt, s, cache(f, p, clean, s))) for s in grid])
    assert sweep.shape == (3 * L, 2)
    torch.testing.assert_close(sweep, loop, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(patching_sweep(f, p, clean, corrupt, grid, _last_logit, chunk_size=5), sweep,
                               rtol=1e-5, atol=1e-5)
    folded = patching_sweep(f, p, clean, corrupt, grid, _last_logit, chunk_size=7, batching="fold")
    torch.testing.assert_close(folded, sweep, rtol=1e-5, atol=1e-5)


def _one_token_corrupted(position):
    clean = _batch(1)
    corrupt = clean.clone()
    corrupt["input_ids"][:, position] = (clean["input_ids"][:, position] + 1) % V
    return clean, corrupt


@pytest.mark.parametrize("batching", ["vmap", "fold"])
def test_a_sweep_runs_only_the_sites_that_patch_something(gpt2, monkeypatch, batching):
    """Causal model, one corrupted token: the positions before it are the corrupted run, at every layer."""
    from tdhook_fn.latent import _patch

    model, f, p = gpt2
    clean, corrupt = _one_token_corrupted(3)
    grid = [Site(f"transformer.h.{layer}", index=(t,)) for layer in range(3) for t in range(L)]
    ran = []
    runner = "_mapped" if batching == "vmap" else "_folded"
    real = getattr(_patch, runner)
    monkeypatch.setattr(_patch, runner, lambda *a, **k: ran.append(len(a[3])) or real(*a, **k))
    sweep = patching_sweep(f, p, clean, corrupt, grid, _last_logit, chunk_size=4, batching=batching)
    assert sum(ran) == 3 * (L - 3)  # positions 3.. at each of the 3 layers
    loop = torch.stack([_last_logit(patch(f, p, corrupt, s, cache(f, p, clean, s))) for s in grid])
    torch.testing.assert_close(sweep, loop, rtol=1e-5, atol=1e-5)
    unpatched = _last_logit(f(p, corrupt))
    for k, site in enumerate(grid):
        if site.index[0] < 3:
            assert torch.equal(sweep[k], unpatched)
    ran.clear()
    every = patching_sweep(f, p, clean, corrupt, grid, _last_logit, chunk_size=4, batching=batching,
                           skip_unchanged=False)
    assert sum(ran) == len(grid)
    torch.testing.assert_close(every, sweep, rtol=1e-5, atol=1e-5)


def test_no_run_is_skipped_where_a_gradient_or_a_transform_sees_it(gpt2, monkeypatch):
    from tdhook_fn.latent import _patch

    model, f, p = gpt2
    clean, corrupt = _one_token_corrupted(3)
    grid = [Site("transformer.h.1", index=(t,)) for t in range(L)]
    ran = []
    real = _patch._mapped
    monkeypatch.setattr(_patch, "_mapped", lambda *a, **k: ran.append(len(a[3])) or real(*a, **k))
    expected = patching_sweep(f, p, clean, corrupt, grid, _last_logit, skip_unchanged=False)
    ran.clear()
    live = p.apply(lambda t: t.detach().requires_grad_())
    with torch.enable_grad():
        values = patching_sweep(f, live, clean, corrupt, grid, _last_logit)
        grads = torch.autograd.grad(values.sum(), list(live.values(True, True)), allow_unused=True)
    assert ran == [len(grid)]  # a no-op patch still takes its value through the clean run's params
    torch.testing.assert_close(values, expected, rtol=1e-5, atol=1e-5)
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    ran.clear()
    transformed = torch.func.grad(lambda q: patching_sweep(f, q, clean, corrupt, grid, _last_logit).sum())(p)
    assert ran == [len(grid)]  # under a transform the data cannot choose the runs
    for key, g in zip(live.keys(True, True), grads, strict=True):
        torch.testing.assert_close(transformed[key], torch.zeros_like(transformed[key]) if g is None else g,
                                   rtol=1e-4, atol=1e-6)
    with pytest.raises(TypeError, match="skip_unchanged must be a bool"):
        patching_sweep(f, p, clean, corrupt, grid, _last_logit, skip_unchanged=1)


def test_attribution_patching_is_exact_where_the_metric_is_linear(gpt2):
    model, f, p = gpt2
    clean, corrupt = _batch(1), _batch(2)
    heads = [Site("lm_head", site="input", index=(t,)) for t in range(L)]  # logits are linear in it
    estimate = attribution_patching(f, p, clean, corrupt, heads, _last_logit)
    exact = patching_sweep(f, p, clean, corrupt, heads, _last_logit) - _last_logit(f(p, corrupt))
    torch.testing.assert_close(estimate, exact, rtol=1e-4, atol=1e-5)


def test_attribution_patching_equals_a_hand_written_gradient(gpt2):
    model, f, p = gpt2
    clean, corrupt = _batch(1), _batch(2)
    grid = [Site(f"transformer.h.{layer}", index=(t,)) for layer in range(3) for t in range(L)]
    estimate = attribution_patching(f, p, clean, corrupt, grid, _last_logit).reshape(3, L, 2)
    twin = copy.deepcopy(model)
    seen = {}

    def keep(i):
        def hook(m, a, out):
            if out.requires_grad:
                out.retain_grad()
            seen[i] = out
        return hook

    handles = [twin.transformer.h[i].register_forward_hook(keep(i)) for i in range(3)]
    with torch.no_grad():
        hidden = twin(input_ids=clean["input_ids"], attention_mask=clean["attention_mask"],
                      output_hidden_states=True).hidden_states
    clean_acts = {i: hidden[i + 1] for i in range(2)}
    with torch.no_grad():
        twin(input_ids=clean["input_ids"], attention_mask=clean["attention_mask"])
        clean_acts[2] = seen[2].clone()
    logits = twin(input_ids=corrupt["input_ids"], attention_mask=corrupt["attention_mask"]).logits
    logits[..., -1, 3].sum().backward()
    for h in handles:
        h.remove()
    for i in range(3):
        expected = ((clean_acts[i] - seen[i].detach()) * seen[i].grad).sum(-1).T  # [L, N]
        torch.testing.assert_close(estimate[i], expected, rtol=1e-4, atol=1e-6)


def test_attribution_patching_is_first_order_for_small_changes():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                              torch.nn.Linear(8, 2)).double()
    f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
    x = torch.randn(3, 4, dtype=torch.float64)
    corrupt = TensorDict(input=x, batch_size=[3])
    clean = TensorDict(input=x + 1e-4 * torch.randn_like(x), batch_size=[3])
    grid = [Site(path, index=(i,)) for path in ("[1]", "[3]") for i in range(8)]
    metric = lambda out: out["output"][..., 1]
    estimate = attribution_patching(f, p, clean, corrupt, grid, metric)
    exact = patching_sweep(f, p, clean, corrupt, grid, metric) - metric(f(p, corrupt))
    assert (estimate - exact).abs().max() < 1e-3 * exact.abs().max()


def test_steer_equals_a_hook_reference_and_batches_alphas(gpt2):
    model, f, p = gpt2
    td = _batch(3)
    vector = activation_addition(f, p, _batch(4), _batch(5), "transformer.h.0")
    ours = steer(f, p, td, "transformer.h.0", vector, alpha=2.0)["logits"]
    reference = _run_with_hook(model, td, "transformer.h.0", lambda out: out + 2.0 * vector["transformer.h.0"])
    torch.testing.assert_close(ours, reference)
    alphas = torch.tensor([0.0, 1.0, 2.0])
    swept = steer(f, p, td, "transformer.h.0", vector, alpha=alphas)["logits"]
    for i, a in enumerate(alphas):
        torch.testing.assert_close(swept[i], steer(f, p, td, "transformer.h.0", vector, alpha=float(a))["logits"],
                                   rtol=1e-5, atol=1e-5)


def test_the_model_is_untouched(gpt2):
    model, f, p = gpt2
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hooks = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    clean, corrupt = _batch(1), _batch(2)
    grid = [Site("transformer.h.0", index=(t,)) for t in range(L)]
    patching_sweep(f, p, clean, corrupt, grid, _last_logit)
    attribution_patching(f, p, clean, corrupt, grid, _last_logit)
    with pytest.raises(ValueError, match="never ran"):
        cache(f, p, clean, Site("transformer.h.0.attn.attn_dropout", call=5))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert hooks == [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]


def test_bert_encoder_with_attention_mask():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    model = transformers.BertModel(config).eval()
    f = tdhook_fn.functional(model, in_keys={"input_ids": "input_ids", "attention_mask": "attention_mask"},
                             out_keys=["last_hidden_state"])
    td = _batch(6)
    acts = cache(f, tdhook_fn.params(model), td, sites(model, r"encoder\.layer\.\d+"))
    hidden = model(input_ids=td["input_ids"], attention_mask=td["attention_mask"], output_hidden_states=True)
    for i in range(2):
        torch.testing.assert_close(acts[f"encoder.layer.{i}"], hidden.hidden_states[i + 1])
