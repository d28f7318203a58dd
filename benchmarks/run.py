"""Run every benchmark and print their tables (``make bench``).

Each benchmark runs in a process of its own: calls of one library can slow another's
later calls in the same process (measured: after any tdhook call, ours run 30-40% slower;
see ``bench_lrp.py``), and the tables should not depend on their order. Ratios are
always taken within one process.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import torch

BENCHMARKS = ("bench_call", "bench_ig", "bench_weights", "bench_lrp", "bench_latent", "bench_metrics",
              "bench_dimension", "bench_similarity", "bench_probing", "bench_compat_probing", "bench_conductance",
              "bench_noise", "bench_surrogate", "bench_perturbation", "bench_deeplift", "bench_captum_rest",
              "bench_data", "bench_compile")


def main() -> None:
    print(f"machine: {platform.machine()} {platform.processor() or ''}, python {platform.python_version()}, "
          f"torch {torch.__version__}, 1 intra-op thread; times are medians, ratios per column", flush=True)
    here = Path(__file__).parent
    for name in BENCHMARKS:
        subprocess.run([sys.executable, str(here / f"{name}.py")], check=True, cwd=here)


if __name__ == "__main__":
    main()
