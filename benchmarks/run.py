"""Run every benchmark in one process and print their tables (``make bench``)."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_call


def main() -> None:
    print(f"machine: {platform.machine()} {platform.processor() or ''}, python {platform.python_version()}, "
          f"torch {torch.__version__}, 1 intra-op thread")
    bench_call.main()


if __name__ == "__main__":
    main()
