"""What a site cannot do on a Hugging Face model raises, naming the site and saying what to do instead."""

import pytest
import torch
import transformers
from tensordict import TensorDict

import tdhook_fn
from tdhook_fn.latent import Site, activation_addition, attribution_patching, cache, patch, patching_sweep, steer

V, D = 100, 32


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=D, n_head=2, vocab_size=V, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    f = tdhook_fn.functional(model, in_keys={"input_ids": "input_ids"}, out_keys=["logits"])
    return model, f, tdhook_fn.params(model)


def _ids(length, seed=0, n=2):
    g = torch.Generator().manual_seed(seed)
    return TensorDict(input_ids=torch.randint(0, V, (n, length), generator=g), batch_size=[n])


def _last_logit(out):
    return out["logits"][..., -1, 0]


TOKEN_IDS = Site("transformer.wte", site="input")
INTEGER = r"'transformer\.wte:input'.*integer activation \(torch\.int64.*token ids.*float activation"


def test_attribution_patching_refuses_token_ids(gpt2):
    _, f, p = gpt2
    with pytest.raises(TypeError, match=INTEGER + r".*Site\('transformer\.wte'\)"):
        attribution_patching(f, p, _ids(5, 1), _ids(5, 2), [TOKEN_IDS], _last_logit)
    est = attribution_patching(f, p, _ids(5, 1), _ids(5, 2), [Site("transformer.wte")], _last_logit)
    assert est.shape == (1, 2) and est.dtype == torch.float32  # the embedding's output is the float site


@pytest.mark.parametrize("alpha", [1.0, torch.tensor([0.0, 1.0])])
def test_steer_refuses_token_ids(gpt2, alpha):
    _, f, p = gpt2
    with pytest.raises(TypeError, match=INTEGER + r".*Site\('transformer\.wte'\)"):
        steer(f, p, _ids(5), TOKEN_IDS, TensorDict({TOKEN_IDS.key: torch.tensor(1)}), alpha=alpha)


def test_activation_addition_refuses_token_ids(gpt2):
    _, f, p = gpt2
    with pytest.raises(TypeError, match=INTEGER):
        activation_addition(f, p, _ids(5, 1), _ids(5, 2), TOKEN_IDS)


def test_patching_token_ids_is_patching_tokens(gpt2):
    """Integer sites stay usable where the edit is a copy: a patched token id is the clean token."""
    _, f, p = gpt2
    clean, corrupt = _ids(5, 1), _ids(5, 2)
    site = Site("transformer.wte", site="input", index=(3,))
    swapped = corrupt.clone()
    swapped["input_ids"][:, 3] = clean["input_ids"][:, 3]
    expected = _last_logit(f(p, swapped))
    torch.testing.assert_close(_last_logit(patch(f, p, corrupt, site, cache(f, p, clean, site))), expected)
    torch.testing.assert_close(patching_sweep(f, p, clean, corrupt, [site], _last_logit)[0], expected)


def test_an_input_site_of_a_module_called_with_keywords_only_reads_its_first_parameter(gpt2):
    _, f, p = gpt2  # f passes input_ids by name: the model's forward gets it as its first parameter's argument
    ids = _ids(5)
    torch.testing.assert_close(cache(f, p, ids, Site("", site="input"))["root:input"], ids["input_ids"])


OUT_OF_RANGE = r"'transformer\.h\.0\[7\]'.*index \(7,\).*\(5, 32\) per sample.*\(2, 5, 32\)"
SITE = Site("transformer.h.0", index=(7,))
CALLS = {
    "cache": lambda f, p: cache(f, p, _ids(5), SITE),
    "patch": lambda f, p: patch(f, p, _ids(5), SITE, TensorDict({SITE.key: torch.zeros(D)})),
    "steer": lambda f, p: steer(f, p, _ids(5), SITE, TensorDict({SITE.key: torch.zeros(D)})),
    "patching_sweep-vmap": lambda f, p: patching_sweep(f, p, _ids(5, 1), _ids(5, 2), [SITE], _last_logit),
    "patching_sweep-fold": lambda f, p: patching_sweep(f, p, _ids(5, 1), _ids(5, 2), [SITE], _last_logit,
                                                       batching="fold", skip_unchanged=False),
    "attribution_patching": lambda f, p: attribution_patching(f, p, _ids(5, 1), _ids(5, 2), [SITE], _last_logit),
}


@pytest.mark.parametrize("method", list(CALLS))
def test_an_index_out_of_range_names_the_site_and_the_shape(gpt2, method):
    _, f, p = gpt2
    with pytest.raises(IndexError, match=OUT_OF_RANGE):
        CALLS[method](f, p)


def test_an_index_with_more_parts_than_dims_names_the_site(gpt2):
    _, f, p = gpt2
    with pytest.raises(IndexError, match=r"'transformer\.h\.0\[0\]\[1\]\[2\]'.*\(5, 32\) per sample"):
        cache(f, p, _ids(5), Site("transformer.h.0", index=(0, 1, 2)))


@pytest.mark.parametrize("clean_length", [6, 1])
@pytest.mark.parametrize("method", ["vmap", "fold", "fold-all", "attribution_patching"])
def test_clean_and_corrupted_of_different_lengths_are_refused(gpt2, clean_length, method):
    """A clean run of one position would broadcast to every corrupted position: refused, never a number."""
    _, f, p = gpt2
    clean, corrupt = _ids(clean_length, 1), _ids(5, 2)
    site = Site("transformer.h.0")
    words = (rf"'transformer\.h\.0'.*clean inputs give .*\(2, {clean_length}, 32\).*corrupted inputs "
             r"\(2, 5, 32\).*one shape.*one length")
    with pytest.raises(ValueError, match=words):
        if method == "attribution_patching":
            attribution_patching(f, p, clean, corrupt, [site], _last_logit)
        else:
            patching_sweep(f, p, clean, corrupt, [site], _last_logit, batching=method[:4],
                           skip_unchanged=method != "fold-all")


def test_a_sweep_of_positions_refuses_prompts_of_different_lengths(gpt2):
    _, f, p = gpt2
    with pytest.raises(ValueError, match=r"'transformer\.h\.1\[0\]'.*\(2, 1, 32\).*\(2, 5, 32\)"):
        patching_sweep(f, p, _ids(1, 1), _ids(5, 2), [Site("transformer.h.1", index=(0,))], _last_logit)


def test_a_folded_sweep_of_the_last_position_takes_prompts_of_other_lengths(gpt2):
    """batching='fold' patches each site's selection only: the last position of a shorter clean prompt, as patch."""
    _, f, p = gpt2
    clean, corrupt = _ids(4, 1), _ids(6, 2)
    last = Site("transformer.h.0", index=(-1,))
    got = patching_sweep(f, p, clean, corrupt, [last], _last_logit, batching="fold")
    expected = _last_logit(patch(f, p, corrupt, last, cache(f, p, clean, last)))
    torch.testing.assert_close(got.reshape(-1), expected.reshape(-1))
    with pytest.raises(ValueError, match=r"'transformer\.h\.0\[-1\]'.*batching='fold'"):
        patching_sweep(f, p, clean, corrupt, [last], _last_logit, batching="vmap")
