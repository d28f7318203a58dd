"""patching_sweep(causal=True): runs cut to the positions a patch can change, from the corrupted run's cache."""

import pytest
import torch
import transformers
from tensordict import TensorDict

import tdhook_fn
from tdhook_fn.latent import Site, cache, patch, patching_sweep

L, V = 7, 40


def _gpt2(seed=0, attention="sdpa"):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=V, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = attention
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def gpt2():
    model = _gpt2()
    return model, tdhook_fn.functional(model, in_keys=["input_ids"], out_keys=["logits"]), tdhook_fn.params(model)


def _ids(seed, n=3):
    return torch.randint(0, V, (n, L), generator=torch.Generator().manual_seed(seed))


def _pair(n=3):
    return (TensorDict(input_ids=_ids(s, n), batch_size=[n]) for s in (1, 2))


def _metric(out):
    return out["logits"][..., -1, 3] - out["logits"][..., 1, 5]  # reads an early position too


GRID = [Site(f"transformer.h.{layer}", index=(t,)) for layer in range(3) for t in range(L)]


@pytest.mark.parametrize("chunk_size", [None, 1, 5])
def test_causal_equals_the_whole_runs(gpt2, chunk_size):
    _, f, p = gpt2
    clean, corrupt = _pair()
    whole = patching_sweep(f, p, clean, corrupt, GRID, _metric)
    cut = patching_sweep(f, p, clean, corrupt, GRID, _metric, causal=True, chunk_size=chunk_size)
    torch.testing.assert_close(cut, whole, rtol=1e-4, atol=1e-5)


def test_causal_equals_a_loop_of_patch_calls_at_mixed_sites(gpt2):
    model, f, p = gpt2
    clean, corrupt = _pair()
    sites = [Site("transformer.h.1.mlp", index=(3,)), Site("transformer.h.0.attn", index=(-2,)),
             Site("transformer.h.2", index=(4, slice(0, 8))), Site("transformer.h.1"),  # whole: runs whole
             Site("transformer.h.2.ln_1", index=(5,), site="input"), Site("transformer.h.0", index=(0,))]
    got = patching_sweep(f, p, clean, corrupt, sites, _metric, causal=True)
    sources = cache(f, p, clean, sites)
    loop = torch.stack([_metric(patch(f, p, corrupt, s, sources.select(s.key))) for s in sites])
    torch.testing.assert_close(got, loop, rtol=1e-4, atol=1e-5)


def test_causal_with_a_whole_attention_mask_and_keyword_inputs():
    model = _gpt2(1)
    f = tdhook_fn.functional(model, in_keys={"input_ids": "input_ids", "attention_mask": "attention_mask"},
                             out_keys=["logits"])
    p = tdhook_fn.params(model)
    clean, corrupt = _pair()
    for td in (clean, corrupt):
        td["attention_mask"] = torch.ones(3, L, dtype=torch.long)
    torch.testing.assert_close(patching_sweep(f, p, clean, corrupt, GRID, _metric, causal=True),
                               patching_sweep(f, p, clean, corrupt, GRID, _metric), rtol=1e-4, atol=1e-5)


def test_causal_with_one_corrupted_token_skips_and_cuts(gpt2):
    _, f, p = gpt2
    clean, _ = _pair()
    one = clean.clone()
    one["input_ids"][:, 4] = (one["input_ids"][:, 4] + 1) % V
    torch.testing.assert_close(patching_sweep(f, p, clean, one, GRID, _metric, causal=True),
                               patching_sweep(f, p, clean, one, GRID, _metric), rtol=1e-4, atol=1e-5)


def test_causal_with_two_batch_dims(gpt2):
    _, f, p = gpt2
    clean, corrupt = (TensorDict(input_ids=_ids(s, 4).reshape(2, 2, L), batch_size=[2, 2]) for s in (3, 4))
    got = patching_sweep(f, p, clean, corrupt, GRID[::3], _metric, causal=True)
    assert got.shape == (len(GRID[::3]), 2, 2)
    torch.testing.assert_close(got, patching_sweep(f, p, clean, corrupt, GRID[::3], _metric), rtol=1e-4, atol=1e-5)


def test_causal_leaves_the_model_as_it_was(gpt2):
    model, f, p = gpt2
    before = {k: v.clone() for k, v in model.state_dict().items()}
    clean, corrupt = _pair()
    patching_sweep(f, p, clean, corrupt, GRID, _metric, causal=True)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def _padded(attention):
    model = _gpt2(2, attention)
    f = tdhook_fn.functional(model, in_keys={"input_ids": "input_ids", "attention_mask": "attention_mask"},
                             out_keys=["logits"])
    clean, corrupt = _pair()
    for td in (clean, corrupt):
        td["attention_mask"] = torch.ones(3, L, dtype=torch.long)
        td["attention_mask"][0, :2] = 0
    return f, tdhook_fn.params(model), clean, corrupt


def test_left_padding_is_refused_where_hidden_positions_attend_everywhere():
    f, p, clean, corrupt = _padded("eager")  # eager attention lets a fully hidden position attend to every one
    with pytest.raises(RuntimeError, match="left padding"):
        patching_sweep(f, p, clean, corrupt, GRID, _metric, causal=True)


def test_left_padding_with_sdpa_equals_the_whole_runs():
    f, p, clean, corrupt = _padded("sdpa")
    torch.testing.assert_close(patching_sweep(f, p, clean, corrupt, GRID, _metric, causal=True),
                               patching_sweep(f, p, clean, corrupt, GRID, _metric), rtol=1e-4, atol=1e-5)


class _Bidirectional(torch.nn.Module):
    """A decoder with a cache whose logits also see every position: not causal."""

    def __init__(self):
        super().__init__()
        self.gpt = _gpt2(3)

    def forward(self, input_ids, cache=None, use_cache=None):
        logits = self.gpt(input_ids, cache=cache, use_cache=use_cache).logits
        return {"logits": logits + logits.mean(1, keepdim=True)}


def test_a_model_that_is_not_causal_is_refused():
    model = _Bidirectional().eval()
    f = tdhook_fn.functional(model, in_keys=["input_ids"], out_keys=["logits"])
    clean, corrupt = _pair()
    sites = [Site(f"gpt.transformer.h.{layer}", index=(t,)) for layer in range(3) for t in range(L)]
    with pytest.raises(RuntimeError, match="not causal|attends to later positions"):
        patching_sweep(f, tdhook_fn.params(model), clean, corrupt, sites, _metric, causal=True)


def test_what_causal_cannot_do_is_refused(gpt2):
    model, f, p = gpt2
    clean, corrupt = _pair()
    with pytest.raises(TypeError, match="causal must be a bool"):
        patching_sweep(f, p, clean, corrupt, GRID, _metric, causal=1)
    with pytest.raises(ValueError, match="batching='vmap'"):
        patching_sweep(f, p, clean, corrupt, GRID, _metric, causal=True, batching="fold")
    with pytest.raises(ValueError, match="without taps"):
        patching_sweep(f.with_taps(tdhook_fn.capture("transformer.h.0")), p, clean, corrupt, GRID, _metric,
                       causal=True)
    labelled = tdhook_fn.functional(model, in_keys={"input_ids": "input_ids", "labels": "labels"},
                                    out_keys=["logits"])
    with_labels = [td.clone().set("labels", td["input_ids"]) for td in (clean, corrupt)]
    with pytest.raises(ValueError, match="labels"):
        patching_sweep(labelled, p, *with_labels, GRID, _metric, causal=True)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    g, q = tdhook_fn.pure(net)
    x, y = (TensorDict(input=torch.randn(3, 4), batch_size=[3]) for _ in range(2))
    with pytest.raises(TypeError, match="key/value cache"):
        patching_sweep(g, q, x, y, [Site("[1]", index=(0,))], lambda out: out["output"][..., 0], causal=True)


def test_causal_refuses_transforms(gpt2):
    _, f, p = gpt2
    clean, corrupt = _pair()

    def swept(ids):
        td = TensorDict(input_ids=ids, batch_size=ids.shape[:1])
        return patching_sweep(f, p, clean, td, GRID, _metric, causal=True)

    with pytest.raises(NotImplementedError, match="functorch transform"):
        torch.func.vmap(swept)(corrupt["input_ids"].unsqueeze(0))


def test_causal_on_an_accelerate_hooked_model():
    """A block with accelerate's instance forward (``add_hook_to_module``): the cut runs still take our params."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    model = _gpt2(4)
    add_hook_to_module(model.transformer.h[1], ModelHook())
    f, p = tdhook_fn.functional(model, in_keys=["input_ids"], out_keys=["logits"]), tdhook_fn.params(model)
    clean, corrupt = _pair()
    doubled = p.apply(lambda t: t * 1.5)  # other params than the model's own
    torch.testing.assert_close(patching_sweep(f, doubled, clean, corrupt, GRID, _metric, causal=True),
                               patching_sweep(f, doubled, clean, corrupt, GRID, _metric), rtol=1e-4, atol=1e-5)
    assert "forward" in vars(model.transformer.h[1])  # accelerate's hook is still the model's


def _last(out):
    return out["logits"][..., -1, 3]


def _last_and_a_hidden_early_read(out):  # the early read has no gradient: the noise test must catch it
    return out["logits"][..., -1, 3] + out["logits"][..., 2, 5].detach()


def _argmax_at_the_end(out):  # no gradient at all
    return out["logits"][..., -1, :].argmax(-1).to(torch.float32)


def _mean_of_the_last_three(out):
    return out["logits"][..., -3:, 7].mean(-1)


def _zero_weighted_early_positions(out):  # gradient 0 before position 5, values read (x 0): still exact
    weights = torch.zeros(L)
    weights[5:] = 1.0
    return (out["logits"][..., 0] * weights).sum(-1)


@pytest.mark.parametrize("metric", [_last, _last_and_a_hidden_early_read, _argmax_at_the_end,
                                    _mean_of_the_last_three, _zero_weighted_early_positions])
def test_causal_with_metrics_reading_some_positions_equals_the_whole_runs(gpt2, metric):
    _, f, p = gpt2
    clean, corrupt = _pair()
    torch.testing.assert_close(patching_sweep(f, p, clean, corrupt, GRID, metric, causal=True),
                               patching_sweep(f, p, clean, corrupt, GRID, metric), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("metric", "most"), [(_last, 1), (_mean_of_the_last_three, 3),
                                               (_last_and_a_hidden_early_read, L - 2)])
def test_causal_runs_the_lm_head_at_the_positions_the_metric_reads(metric, most):
    model = _gpt2()
    f = tdhook_fn.functional(model, in_keys=["input_ids"], out_keys=["logits"])
    clean, corrupt = _pair()
    seen = []
    handle = model.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[-2]))
    try:
        with torch.no_grad():  # runs patching positions 2 to 6 of the last block: from 2 on, 5 positions at most
            patching_sweep(f, tdhook_fn.params(model), clean, corrupt, GRID[-L + 2:], metric, causal=True)
    finally:
        handle.remove()
    cut = [n for n in seen if n != L]  # the clean, corrupted and check runs run whole
    assert max(cut) == most


@pytest.mark.parametrize(("metric", "most"), [(_last, 1), (_mean_of_the_last_three, 3),
                                               (_last_and_a_hidden_early_read, L), (_argmax_at_the_end, L)])
def test_the_default_sweep_runs_the_lm_head_at_the_positions_the_metric_reads(gpt2, metric, most):
    model, f, p = gpt2
    clean, corrupt = _pair()
    seen = []
    handle = model.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[-2]))
    try:
        with torch.no_grad():
            sweep = patching_sweep(f, p, clean, corrupt, GRID, metric, skip_unchanged=False)
    finally:
        handle.remove()
    assert max(seen[3:]) == most  # after the clean, corrupted and shape-finding runs
    loop = torch.stack([metric(patch(f, p, corrupt, s, cache(f, p, clean, s))) for s in GRID])
    torch.testing.assert_close(sweep, loop, rtol=1e-4, atol=1e-5)


class _Seen:
    """A metric reading the last position's logit 3 in one of three ways, noting how many positions it is given."""

    def __init__(self, how):
        self.how, self.lengths = how, []

    def __call__(self, out):
        logits = out["logits"]
        self.lengths.append(logits.shape[-2])
        if self.how == "from the end":
            return logits[..., -1, 3]
        if self.how == "from the front":  # logits[:, 6] is no position of the last one alone
            return logits[..., L - 1, 3]
        return logits[..., -1, 3] / logits.shape[-2]  # "per position": reads the length too


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("how", "alone"), [("from the end", True), ("from the front", False),
                                            ("per position", False)])
def test_runs_hand_the_metric_the_last_positions_alone_only_where_it_gives_the_same(gpt2, causal, how, alone):
    _, f, p = gpt2
    clean, corrupt = _pair()
    with torch.no_grad():
        metric = _Seen(how)
        sweep = patching_sweep(f, p, clean, corrupt, GRID, metric, causal=causal, skip_unchanged=False, chunk_size=5)
        whole = patching_sweep(f, p, clean, corrupt, GRID, _Seen(how), batching="fold")
    torch.testing.assert_close(sweep, whole, rtol=1e-4, atol=1e-5)
    assert (metric.lengths.count(1) > 2) == alone  # the test of the cut outputs calls it on one position twice
