"""Induction heads found by patching: a 2-layer attention-only transformer trained in seconds.

The task has a known mechanism. Each sequence is a random prefix, a block of random tokens
and the same block again; the loss is on the second block, which only an induction
circuit predicts (a previous-token head in layer 0, an induction head in layer 1 that
attends to the token after the last occurrence of the current one and copies it). The
prefix has a random length, so the offset of the repeat varies and no head can solve the
task by position alone.

With ``tdhook_fn.latent``: the activation-patching heatmap (layer x position of the
residual stream) beside its attribution-patching (AtP) estimate, the effect of patching
each head, and a steering vector from ``activation_addition`` that changes the copied
token, swept over alpha in one ``steer`` call. Writes ``08_induction_patching.png``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import matplotlib.pyplot as plt
import torch
from _digits import setup_example
from _plots import SIGNED, save
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.latent import Site, activation_addition, attribution_patching, cache, patch, patching_sweep, steer

VOCAB, BLOCK, MAX_PREFIX = 48, 8, 6
LENGTH = MAX_PREFIX + 2 * BLOCK  # every sequence: prefix, block, block, filler up to LENGTH
D_MODEL, HEADS, LAYERS = 64, 4, 2
RESIDUAL = ["embed", *(f"blocks.{i}" for i in range(LAYERS))]  # residual stream before and after each layer
# the demonstration sequence: prefix of 3, block at 3..10, repeat at 11..18; token 5 of the
# first block (position 8) is changed; the induction query is the repeat's token 4 (position 15)
PREFIX, CHANGED = 3, 5
QUERY = PREFIX + BLOCK + CHANGED - 1


# -- the model ---------------------------------------------------------------------------------


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Embedding(VOCAB, D_MODEL)
        self.position = nn.Embedding(LENGTH, D_MODEL)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.token(ids) + self.position.weight[: ids.shape[-1]]


class Attention(nn.Module):
    """Causal multi-head self-attention; ``out``'s input holds the heads side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.out = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(n, length, 3, HEADS, D_MODEL // HEADS).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(D_MODEL // HEADS)  # [N, H, L, L]
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        mixed = scores.masked_fill(future, -math.inf).softmax(-1) @ v  # [N, H, L, dh]
        return self.out(mixed.transpose(1, 2).reshape(n, length, D_MODEL))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x)


class AttentionOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = Embed()
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(D_MODEL)
        self.unembed = nn.Linear(D_MODEL, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.norm(x))


# -- the task ----------------------------------------------------------------------------------


def induction_batch(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sequences and the mask of the positions whose next token is in the repeat (bar its first)."""
    ids = torch.randint(VOCAB, (n, LENGTH), generator=generator)
    tokens = torch.rand(n, VOCAB, generator=generator).argsort(-1)[:, : MAX_PREFIX + BLOCK]  # distinct tokens
    prefixes = torch.randint(MAX_PREFIX + 1, (n,), generator=generator)
    scored = torch.zeros(n, LENGTH, dtype=torch.bool)
    for row, (p, seq) in enumerate(zip(prefixes.tolist(), tokens, strict=True)):
        block = seq[MAX_PREFIX : MAX_PREFIX + BLOCK]
        ids[row, :p] = seq[:p]
        ids[row, p : p + BLOCK] = block
        ids[row, p + BLOCK : p + 2 * BLOCK] = block
        scored[row, p + BLOCK : p + 2 * BLOCK - 1] = True  # these positions predict repeat tokens 1..7
    return ids, scored


def train(steps: int, progress: bool) -> tuple[nn.Module, float, float]:
    """The model trained with Adam on fresh batches; (model, seconds, second-half accuracy)."""
    torch.manual_seed(0)
    model = AttentionOnly()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for step in range(steps):
        ids, scored = induction_batch(64, generator)
        logits = model(ids)[:, :-1][scored[:, :-1]]
        loss = nn.functional.cross_entropy(logits, ids[:, 1:][scored[:, :-1]])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if progress and (step % 200 == 0 or step == steps - 1):
            print(f"  step {step:5d}  loss {loss.item():.3f}")
    seconds = time.perf_counter() - start
    model.eval()
    ids, scored = induction_batch(1000, torch.Generator().manual_seed(1))
    with torch.no_grad():
        right = model(ids)[:, :-1].argmax(-1) == ids[:, 1:]
    return model, seconds, float(right[scored[:, :-1]].float().mean())


# -- clean and corrupted prompts ---------------------------------------------------------------


def prompts(n: int, seed: int, avoid: int | None = None) -> torch.Tensor:
    """``n`` repeated sequences with the demonstration layout (prefix of ``PREFIX``); no ``avoid`` token."""
    generator = torch.Generator().manual_seed(seed)
    pool = torch.tensor([t for t in range(VOCAB) if t != avoid])
    order = torch.rand(n, len(pool), generator=generator).argsort(-1)
    tokens = pool[order[:, : PREFIX + BLOCK]]  # distinct within each row
    block = tokens[:, PREFIX : PREFIX + BLOCK]
    filler = pool[torch.randint(len(pool), (n, LENGTH - PREFIX - 2 * BLOCK), generator=generator)]
    return torch.cat([tokens[:, :PREFIX], block, block, filler], dim=1)


def corrupt(clean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The clean ids with first-block token ``CHANGED`` replaced by an unused token; (ids, right, wrong)."""
    right = clean[:, PREFIX + CHANGED]
    generator = torch.Generator().manual_seed(5)
    unused = [torch.arange(VOCAB)[~torch.isin(torch.arange(VOCAB), row)] for row in clean]
    wrong = torch.stack([u[torch.randint(len(u), (), generator=generator)] for u in unused])
    corrupted = clean.clone()
    corrupted[:, PREFIX + CHANGED] = wrong
    return corrupted, right, wrong


def logit_difference(right: torch.Tensor, wrong: torch.Tensor) -> Callable[[TensorDict], torch.Tensor]:
    """The metric: logit of the clean token minus that of the corrupted one at the query position."""
    def metric(out: TensorDict) -> torch.Tensor:
        logits = out["output"][..., QUERY, :]  # [*runs, N, V]
        pick = lambda t: logits.gather(-1, t.expand(logits.shape[:-1]).unsqueeze(-1)).squeeze(-1)
        return pick(right) - pick(wrong)

    return metric


# -- the analyses ------------------------------------------------------------------------------


def analyse(model: nn.Module, n: int) -> dict[str, object]:
    """The three analyses on ``n`` clean/corrupted prompt pairs; their results by name."""
    f, params = tdhook_fn.functional(model), tdhook_fn.params(model)
    ids = prompts(n, seed=2)
    bad, right, wrong = corrupt(ids)
    clean, corrupted = (TensorDict(input=x, batch_size=[n]) for x in (ids, bad))
    metric = logit_difference(right, wrong)
    base, top = metric(f(params, corrupted)), metric(f(params, clean))
    print(f"logit difference at position {QUERY}: clean {top.mean():.2f}, corrupted {base.mean():.2f}")
    scale = (top - base).mean()

    def effects(sites: list[Site]) -> tuple[torch.Tensor, torch.Tensor]:
        """Patching and AtP effects, mean over prompts, as fractions of the clean-corrupted gap."""
        swept = patching_sweep(f, params, clean, corrupted, sites, metric) - base
        estimated = attribution_patching(f, params, clean, corrupted, sites, metric)
        return swept.mean(-1) / scale, estimated.mean(-1) / scale

    # (1) the residual stream: every layer x every position up to the query
    residual = [Site(path, index=(t,)) for path in RESIDUAL for t in range(QUERY + 1)]
    time_sweep_and_loop(f, params, clean, corrupted, residual, metric)
    patched, estimated = (e.reshape(len(RESIDUAL), -1) for e in effects(residual))
    correlation = float(torch.corrcoef(torch.stack([patched.flatten(), estimated.flatten()]))[0, 1])
    print(f"correlation of the patching and AtP heatmaps: {correlation:.3f}")

    # (2) each head: its slice of the input of the attention's output projection, every position
    dh = D_MODEL // HEADS
    heads = [Site(f"blocks.{layer}.attn.out", site="input", index=(slice(None), slice(h * dh, (h + 1) * dh)))
             for layer in range(LAYERS) for h in range(HEADS)]
    head_patched, head_estimated = effects(heads)
    for k, (a, b) in enumerate(zip(head_patched.tolist(), head_estimated.tolist(), strict=True)):
        print(f"  head L{k // HEADS}.H{k % HEADS}: patching {a:+.2f}  AtP {b:+.2f}")
    return dict(patched=patched, estimated=estimated, correlation=correlation, head_patched=head_patched,
                head_estimated=head_estimated, **steering(f, params, n))


def time_sweep_and_loop(f: tdhook_fn.Functional, params: TensorDict, clean: TensorDict, corrupted: TensorDict,
                        sites: list[Site], metric: Callable[[TensorDict], torch.Tensor]) -> None:
    """Print the time of one ``patching_sweep`` and of the same runs as a loop of ``patch`` calls."""
    def loop() -> torch.Tensor:
        sources = cache(f, params, clean, sites)
        return torch.stack([metric(patch(f, params, corrupted, site, sources)) for site in sites])

    sweep = lambda: patching_sweep(f, params, clean, corrupted, sites, metric)
    seconds, values = {}, {}
    for name, run in (("patching_sweep", sweep), ("a loop of patch calls", loop)):
        run()  # warm-up
        start = time.perf_counter()
        values[name] = run()
        seconds[name] = time.perf_counter() - start
    difference = float((values["patching_sweep"] - values["a loop of patch calls"]).abs().max())
    timings = ", ".join(f"{name} {s * 1e3:.0f} ms" for name, s in seconds.items())
    print(f"{len(sites)} patched runs of {clean.batch_size[0]} prompts: {timings} (max difference {difference:.1e})")


def steering(f: tdhook_fn.Functional, params: TensorDict, n: int) -> dict[str, object]:
    """P(TARGET) at the query against alpha, for a vector towards "the copied token is TARGET"
    from pairs of prompt sets, added at the key position after layer 0 or at the query after layer 1."""
    target = 0
    steered = [Site("blocks.0", index=(PREFIX + CHANGED,)), Site("blocks.1", index=(QUERY,))]
    negative = prompts(n, seed=3, avoid=target)
    positive = negative.clone()
    positive[:, [PREFIX + CHANGED, PREFIX + BLOCK + CHANGED]] = target  # the repeat now continues with TARGET
    vectors = activation_addition(f, params, TensorDict(input=positive, batch_size=[n]),
                                  TensorDict(input=negative, batch_size=[n]), steered)
    test = TensorDict(input=prompts(n, seed=4, avoid=target), batch_size=[n])
    copied = test["input"][:, PREFIX + CHANGED]
    alphas = torch.linspace(0, 3, 31)
    curves = {}
    for site in steered:
        probs = steer(f, params, test, site, vectors, alpha=alphas)["output"][:, :, QUERY].softmax(-1)  # [A, N, V]
        p_copied = probs.gather(-1, copied.expand(len(alphas), n).unsqueeze(-1)).squeeze(-1)
        curves[site.key] = (probs[..., target].mean(-1), p_copied.mean(-1))
        print(f"steering at {site.key}: P(token {target}) {curves[site.key][0][0]:.3f} at alpha 0, "
              + ", ".join(f"{curves[site.key][0][int(a * 10)]:.3f} at alpha {a}" for a in (1, 2, 3)))
    return dict(alphas=alphas, curves=curves, target=target)


# -- the pictures ------------------------------------------------------------------------------


def draw_heatmap(fig: Figure, ax: Axes, values: torch.Tensor, title: str, limit: float) -> None:
    """Layer x position, on a symmetric scale ``[-limit, limit]`` (white is no effect)."""
    image = ax.imshow(values.detach().numpy(), cmap=SIGNED, vmin=-limit, vmax=limit, aspect="auto")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.02, label="fraction of the clean logit difference")
    ax.set_yticks(range(len(RESIDUAL)), ["embed", *(f"after layer {i}" for i in range(LAYERS))])
    labels = [str(t) for t in range(values.shape[1])]
    labels[PREFIX + CHANGED] += "\nchanged"
    labels[QUERY] += "\nquery"
    ax.set_xticks(range(values.shape[1]), labels, fontsize=8)
    ax.set_xlabel(f"token position (block at {PREFIX}-{PREFIX + BLOCK - 1}, repeat from {PREFIX + BLOCK})")
    ax.set_ylabel("residual stream")
    ax.set_title(title, fontsize=10)


def draw_heads(ax: Axes, patched: torch.Tensor, estimated: torch.Tensor) -> None:
    names = [f"L{k // HEADS}.H{k % HEADS}" for k in range(len(patched))]
    x = torch.arange(len(names)).float()
    ax.bar(x - 0.2, patched.tolist(), 0.4, label="activation patching")
    ax.bar(x + 0.2, estimated.tolist(), 0.4, label="attribution patching (AtP)")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(x.tolist(), names)
    ax.set_xlabel("attention head (layer.head), output patched at every position")
    ax.set_ylabel("fraction of the clean logit difference")
    ax.set_title("Patching one head at a time", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def draw_steering(ax: Axes, result: dict[str, object]) -> None:
    alphas, target = result["alphas"], result["target"]
    where = {f"blocks.0[{PREFIX + CHANGED}]": "key, after layer 0", f"blocks.1[{QUERY}]": "query, after layer 1"}
    for (key, (p_target, p_copied)), colour in zip(result["curves"].items(), ("tab:blue", "tab:red"), strict=True):
        ax.plot(alphas, p_target, "o-", ms=3, color=colour, label=f"P(token {target}) at {key} ({where[key]})")
        ax.plot(alphas, p_copied, "--", color=colour, label=f"P(copied token) at {key}")
    ax.set_xlabel("alpha (one steer call each, alpha as a 1-d tensor)")
    ax.set_ylabel(f"mean probability at the query position {QUERY}")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"Steering towards token {target} with activation_addition vectors", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    ax.grid(alpha=0.3)


def plot(result: dict[str, object], seconds: float, accuracy: float, args: argparse.Namespace) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(14, 8.5))
    limit = max(float(result["patched"].abs().max()), float(result["estimated"].abs().max()), 1e-6)
    draw_heatmap(fig, axes[0, 0], result["patched"], "Activation patching (patching_sweep)", limit)
    draw_heatmap(fig, axes[0, 1], result["estimated"],
                 f"Attribution patching estimate (correlation {result['correlation']:.3f})", limit)
    draw_heads(axes[1, 0], result["head_patched"], result["head_estimated"])
    draw_steering(axes[1, 1], result)
    fig.suptitle(f"Induction in a 2-layer attention-only transformer (trained {seconds:.0f} s, second-half "
                 f"accuracy {accuracy:.1%}); corrupted: token {PREFIX + CHANGED} changed", fontsize=12)
    fig.tight_layout()
    print("picture:", save(fig, args.out, "08_induction_patching.png"))


def main() -> None:
    args = setup_example(__doc__.splitlines()[0])
    steps = 80 if args.quick else 800
    print(f"training {steps} steps of 64 sequences")
    model, seconds, accuracy = train(steps, args.progress)
    print(f"trained in {seconds:.1f} s; second-half accuracy {accuracy:.1%} (chance {1 / VOCAB:.1%})")
    result = analyse(model, 8 if args.quick else 32)
    plot(result, seconds, accuracy, args)


if __name__ == "__main__":
    main()
