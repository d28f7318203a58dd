"""Run every benchmark in one process and print their tables (``make bench``)."""

from __future__ import annotations

import platform

import bench_call
import bench_compile
import bench_data
import bench_ig
import bench_latent
import bench_lrp
import bench_weights
import torch


def main() -> None:
    print(f"machine: {platform.machine()} {platform.processor() or ''}, python {platform.python_version()}, "
          f"torch {torch.__version__}, 1 intra-op thread; times are medians, ratios per column")
    bench_call.main()
    bench_ig.main()
    bench_weights.main()
    bench_lrp.main()
    bench_latent.main()
    bench_data.main()
    bench_compile.main()


if __name__ == "__main__":
    main()
