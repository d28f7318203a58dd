"""Overhead of ``tdhook_fn.call`` against the module's own forward and ``functional_call``."""

from __future__ import annotations

import torch
from _timing import interleaved_medians, median_seconds, print_table
from torch import nn
from torch.func import functional_call, vmap

import tdhook_fn


def _models() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    mlp_small = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    widths = [128, 256, 256, 256, 256, 10]
    mlp = nn.Sequential(*[m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.ReLU())][:-1])
    cnn = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                        nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    enc = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True)
    return {
        "mlp 16-32-4, batch 8": (mlp_small.eval(), torch.randn(8, 16)),
        "mlp 128-256x4-10, batch 64": (mlp.eval(), torch.randn(64, 128)),
        "cnn 8x8, batch 64": (cnn.eval(), torch.randn(64, 1, 8, 8)),
        "transformer layer d64, batch 8x16": (enc.eval(), torch.randn(8, 16, 64)),
    }


def main() -> None:
    torch.set_num_threads(1)
    for name, (model, x) in _models().items():
        params = tdhook_fn.params(model)
        plain = {".".join(k): v for k, v in params.items(include_nested=True, leaves_only=True)}
        with torch.no_grad():
            forward = median_seconds(lambda: model(x))
            fcall = median_seconds(lambda: functional_call(model, plain, (x,)))
            ours = median_seconds(lambda: tdhook_fn.call(model, params, x))
        print_table(f"call overhead: {name}", [
            ("module forward", forward),
            ("torch.func.functional_call", fcall),
            ("tdhook_fn.call", ours),
        ], {"forward": forward, "functional_call": fcall})

    model, x = _models()["mlp 128-256x4-10, batch 64"]
    params = tdhook_fn.params(model)
    stacked = torch.stack([params] * 5)
    plain = [{".".join(k): v for k, v in params.items(include_nested=True, leaves_only=True)}] * 5
    stacked_plain = {k: torch.stack([v] * 5) for k, v in plain[0].items()}  # the hand-written vmap's input
    with torch.no_grad():  # in alternating rounds, so that all three share the machine's drift
        times = interleaved_medians({
            "loop of functional_call": lambda: [functional_call(model, p, (x,)) for p in plain],
            "vmap of functional_call": lambda: vmap(lambda p: functional_call(model, p, (x,)))(stacked_plain),
            "vmap(tdhook_fn.call)": lambda: vmap(tdhook_fn.call, (None, 0, None))(model, stacked, x),
        }, rounds=15, number=5)
    print_table("ensemble of 5 parameter sets, mlp 128-256x4-10, batch 64", list(times.items()),
                {"loop": times["loop of functional_call"], "vmap floor": times["vmap of functional_call"]})


if __name__ == "__main__":
    main()
