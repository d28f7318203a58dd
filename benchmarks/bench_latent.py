"""The latent toolkit on random-init models, no grad.

First, ``patching_sweep``'s default against a loop of ``patch`` calls on default-config
GPT-2 (``GPT2LMHeadModel(GPT2Config())``, sdpa attention) and BERT
(``BertForSequenceClassification(BertConfig())``), a layer x position grid of the
residual stream; the sizes come from the environment, to fit a slow machine:
``LATENT_LAYERS`` (12, the default configs'), ``LATENT_TOKENS`` (16), ``LATENT_BATCH``
(1), ``LATENT_ROUNDS`` (3). Times are CPU seconds of this process (one thread: its wall
time on an idle machine, and steadier on a shared one), medians of interleaved rounds.
``--default-configs`` runs only this part.

Then, on a GPT-2 with 6 layers, d=256, 8 heads, eager attention, batch 8 x 64 tokens:

- caching every block's output, against a plain forward, tdhook 0.1.3's ActivationCaching
  and nnsight;
- a layer x position patching sweep of the residual stream (6 x 64 = 384 patched runs):
  ``patching_sweep`` (with ``causal=True``, and without) against loops of ``patch``, of
  tdhook's ActivationPatching and of nnsight traces (the loops are timed on a slice of
  the sites and reported per run);
- attribution patching over the same 384 sites against one forward and backward.

Every variant is first checked to give the same numbers.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import warnings
from collections.abc import Callable

import torch
import transformers
from _timing import cpu_medians, interleaved_medians, peak_rss_growth_mib, print_table
from tensordict import TensorDict

import tdhook_fn
from tdhook_fn.latent import Site, attribution_patching, cache, patch, patching_sweep, sites

warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()
LAYERS, TOKENS, BATCH, TOKEN = 6, 64, 8, 3
LOOP_SLICE = 16  # sites timed in the loops (per-run cost is what is compared)
# eager attention: torch's fused CPU attention has no vmap batching rule (vmap then loops over the runs)
ATTENTION = "eager"


def gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=LAYERS, n_embd=256, n_head=8, vocab_size=1000, n_positions=TOKENS,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = ATTENTION
    return transformers.GPT2LMHeadModel(config).eval()


def metric(out: TensorDict) -> torch.Tensor:
    return out["logits"][..., -1, TOKEN]


def _patch_loop(f, p, corrupt, part, sources, score):  # type: ignore[no-untyped-def]
    """One ``patch`` call per site of ``part`` (a position of a block), from the clean blocks ``sources``."""
    return torch.stack([score(patch(f, p, corrupt, s, TensorDict({s.key: sources[s.path][:, s.index[0]]},
                                                                   batch_size=corrupt.batch_size))) for s in part])


def bench_default_configs() -> None:
    """``patching_sweep``'s default (and ``causal=True``) against a loop of ``patch``, default-config models."""
    layers, tokens = int(os.environ.get("LATENT_LAYERS", 12)), int(os.environ.get("LATENT_TOKENS", 16))
    batch, rounds = int(os.environ.get("LATENT_BATCH", 1)), int(os.environ.get("LATENT_ROUNDS", 3))
    torch.manual_seed(0)
    gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=layers)).eval()
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(num_hidden_layers=layers)).eval()
    cases = [
        ("GPT-2", gpt, ["input_ids"], "transformer.h", lambda out: out["logits"][..., -1, TOKEN], True),
        ("BERT", bert, {"input_ids": "input_ids"}, "bert.encoder.layer",
         lambda out: out["logits"][..., 1] - out["logits"][..., 0], False),
    ]
    for name, model, in_keys, blocks, score, causal in cases:
        assert model.config._attn_implementation == "sdpa"
        f = tdhook_fn.functional(model, in_keys=in_keys, out_keys=["logits"])
        p = tdhook_fn.params(model)
        g = torch.Generator().manual_seed(0)
        clean, corrupt = (TensorDict(input_ids=torch.randint(0, model.config.vocab_size, (batch, tokens), generator=g),
                                     batch_size=[batch]) for _ in range(2))
        grid = [Site(f"{blocks}.{layer}", index=(t,)) for layer in range(layers) for t in range(tokens)]
        part = grid[::4]  # the loop's runs: every 4th site
        sources = cache(f, p, clean, [f"{blocks}.{i}" for i in range(layers)])

        loop = functools.partial(_patch_loop, f, p, corrupt, part, sources, score)
        impls: dict[str, Callable[[], object]] = {
            "loop of tdhook_fn.latent.patch": loop,
            "patching_sweep, default": functools.partial(patching_sweep, f, p, clean, corrupt, grid, score),
        }
        if causal:
            impls["patching_sweep, causal=True"] = functools.partial(patching_sweep, f, p, clean, corrupt, grid, score,
                                                                     causal=True)
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sweep = patching_sweep(f, p, clean, corrupt, grid, score)
            torch.testing.assert_close(loop(), sweep[::4], rtol=1e-4, atol=1e-4, msg=f"{name}: the loop differs")
            if causal:
                torch.testing.assert_close(patching_sweep(f, p, clean, corrupt, grid, score, causal=True), sweep,
                                           rtol=1e-4, atol=1e-4, msg=f"{name}: the causal sweep differs")
            times = cpu_medians(impls, rounds=rounds)
        assert not [w for w in caught if "batching rule" in str(w.message)], [str(w.message) for w in caught]
        per_run = [(label, seconds / (len(part) if label.startswith("loop") else len(grid)))
                   for label, seconds in times.items()]
        print_table(f"patching sweep, default-config {name} ({layers} layers, sdpa), batch {batch}x{tokens}, "
                    f"{len(grid)} runs; CPU time per patched run (loop timed over {len(part)} runs)", per_run,
                    {"loop": per_run[0][1]})
        print("  speed-up over the loop: " + ", ".join(f"{label} {per_run[0][1] / t:.2f}x"
                                                       for label, t in per_run[1:]))


def _nnsight(model: torch.nn.Module):  # type: ignore[no-untyped-def]
    try:
        import nnsight
    except ImportError:
        return None
    return nnsight.NNsight(copy.deepcopy(model))  # its own copy: nnsight wraps the modules it is given


def bench_caching(model, f, p, td, nn_model) -> None:  # type: ignore[no-untyped-def]
    from tdhook.latent.activation_caching import ActivationCaching

    blocks = sites(model, r"transformer\.h\.\d+")
    ids = td["input_ids"]

    def tdhook_cache():  # type: ignore[no-untyped-def]
        with ActivationCaching(r"transformer\.h\.\d+$").prepare(model, in_keys=["input_ids"],
                                                               out_keys=["logits"]) as hooked:
            hooked(td.clone())
            return hooked.hooking_context.cache

    def nnsight_cache():  # type: ignore[no-untyped-def]
        saved = []
        with nn_model.trace(ids):
            for i in range(LAYERS):
                saved.append(nn_model.transformer.h[i].output.save())
        return saved

    ours = cache(f, p, td, blocks)
    theirs = tdhook_cache()
    for i in range(LAYERS):
        torch.testing.assert_close(ours[f"transformer.h.{i}"], theirs[f"transformer.h.{i}"])
    impls = {
        "plain forward": lambda: model(ids),
        "tdhook_fn.latent.cache": lambda: cache(f, p, td, blocks),
        "tdhook 0.1.3 ActivationCaching": tdhook_cache,
    }
    if nn_model is not None:
        for i, value in enumerate(nnsight_cache()):
            torch.testing.assert_close(ours[f"transformer.h.{i}"], value)
        impls["nnsight 0.8 trace"] = nnsight_cache
    times = interleaved_medians(impls, rounds=9)
    print_table(f"caching the output of every block, GPT-2 {LAYERS}x256, batch {BATCH}x{TOKENS}",
                list(times.items()), {"forward": times["plain forward"]})
    if nn_model is None:
        print("  (nnsight is not installed: pip install nnsight>=0.8, the bench extra)")


def bench_sweep(model, f, p, clean, corrupt, nn_model, corruption, memory=True) -> None:  # type: ignore[no-untyped-def]
    from tdhook.latent.activation_patching import ActivationPatching

    grid = [Site(f"transformer.h.{layer}", index=(t,)) for layer in range(LAYERS) for t in range(TOKENS)]
    part = grid[:: len(grid) // LOOP_SLICE][:LOOP_SLICE]
    sources = cache(f, p, clean, [f"transformer.h.{i}" for i in range(LAYERS)])  # whole blocks, for the loops
    blocks = {f"transformer.h.{i}": sources[f"transformer.h.{i}"] for i in range(LAYERS)}

    def loop_patch():  # type: ignore[no-untyped-def]
        return torch.stack([metric(patch(f, p, corrupt, s, TensorDict({s.key: blocks[s.path][:, s.index[0]]},
                                                                        batch_size=[BATCH]))) for s in part])

    def loop_tdhook():  # type: ignore[no-untyped-def]
        values = []
        for s in part:
            t = s.index[0]

            def at_position(module_key, output, output_to_patch, t=t):  # type: ignore[no-untyped-def]
                new = output.clone()
                new[:, t] = output_to_patch[:, t]
                return new

            with ActivationPatching([s.path], patch_fn=at_position).prepare(
                    model, in_keys=["input_ids"], out_keys=["logits"]) as hooked:
                td = TensorDict(input_ids=clean["input_ids"], patched=corrupt.clone(), batch_size=[BATCH])
                values.append(hooked(td)["patched", "logits"][..., -1, TOKEN])
        return torch.stack(values)

    def loop_nnsight():  # type: ignore[no-untyped-def]
        values = []
        for s in part:
            layer, t = int(s.path.rsplit(".", 1)[1]), s.index[0]
            with nn_model.trace(corrupt["input_ids"]):
                nn_model.transformer.h[layer].output[:, t] = blocks[s.path][:, t]
                saved = nn_model.lm_head.output[:, -1, TOKEN].save()
            values.append(saved)
        return torch.stack(values)

    sweep = patching_sweep(f, p, clean, corrupt, grid, metric, chunk_size=32)
    torch.testing.assert_close(patching_sweep(f, p, clean, corrupt, grid, metric, chunk_size=32, causal=True), sweep,
                               rtol=1e-4, atol=1e-5, msg="causal sweep differs")
    index = [grid.index(s) for s in part]
    for name, fn in (("patch", loop_patch), ("tdhook", loop_tdhook)) + (
            (("nnsight", loop_nnsight),) if nn_model is not None else ()):
        torch.testing.assert_close(fn(), sweep[index], rtol=1e-4, atol=1e-5, msg=f"{name} loop differs")
    impls = {
        "tdhook_fn patching_sweep, causal": lambda: patching_sweep(f, p, clean, corrupt, grid, metric, chunk_size=32,
                                                                   causal=True),
        "tdhook_fn patching_sweep, chunk 32": lambda: patching_sweep(f, p, clean, corrupt, grid, metric, chunk_size=32),
        "loop of tdhook_fn.latent.patch": loop_patch,
        "loop of tdhook 0.1.3 ActivationPatching": loop_tdhook,
    }
    if nn_model is not None:
        impls["loop of nnsight 0.8 traces"] = loop_nnsight
    times = interleaved_medians(impls, rounds=3)
    runs = {name: len(grid) if name.startswith("tdhook_fn patching") else len(part) for name in impls}
    per_run = [(name, seconds / runs[name]) for name, seconds in times.items()]
    ours = per_run[0][1]
    print_table(f"patching sweep, {corruption}, {LAYERS} layers x {TOKENS} positions = {len(grid)} runs, time per "
                f"patched run (loops timed over {len(part)} runs)", per_run, {"sweep": ours})
    for size in (16, 128) if memory else ():
        mib = peak_rss_growth_mib(lambda: patching_sweep(f, p, clean, corrupt, grid, metric, chunk_size=size))
        print(f"  peak RSS growth, chunk_size={size:<4} {mib:8.1f} MiB")


def bench_atp(model, f, p, clean, corrupt) -> None:  # type: ignore[no-untyped-def]
    grid = [Site(f"transformer.h.{layer}", index=(t,)) for layer in range(LAYERS) for t in range(TOKENS)]
    embeds = model.transformer.wte(corrupt["input_ids"]).detach()

    def forward_backward():  # type: ignore[no-untyped-def]
        x = embeds.clone().requires_grad_()
        model(inputs_embeds=x).logits[..., -1, TOKEN].sum().backward()
        return x.grad

    with torch.enable_grad():
        times = interleaved_medians({
            "one forward + backward": forward_backward,
            "tdhook_fn attribution_patching": lambda: attribution_patching(f, p, clean, corrupt, grid, metric),
        }, rounds=7)
    print_table(f"attribution patching over the same {len(grid)} sites", list(times.items()),
                {"fwd+bwd": times["one forward + backward"]})


def main() -> None:
    bench_default_configs()  # first: after any tdhook call ours run slower in the same process (bench_lrp.py)
    if "--default-configs" in sys.argv:
        return
    model = gpt2()
    f = tdhook_fn.functional(model, in_keys=["input_ids"], out_keys=["logits"])
    p = tdhook_fn.params(model)
    g = torch.Generator().manual_seed(0)
    clean, corrupt = (TensorDict(input_ids=torch.randint(0, 1000, (BATCH, TOKENS), generator=g), batch_size=[BATCH])
                      for _ in range(2))
    nn_model = _nnsight(model)
    with torch.no_grad():
        bench_caching(model, f, p, clean, nn_model)
        bench_sweep(model, f, p, clean, corrupt, nn_model, "random tokens at every position")
        # the usual corrupted prompt (a name or fact swapped): one token; in a causal model the
        # positions before it patch nothing, and the sweep does not run them (NOTE [unchanged sites])
        one = clean.clone()
        one["input_ids"][:, TOKENS // 2] = (clean["input_ids"][:, TOKENS // 2] + 1) % 1000
        bench_sweep(model, f, p, clean, one, nn_model, f"one token corrupted (position {TOKENS // 2})",
                    memory=False)
    bench_atp(model, f, p, clean, corrupt)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
