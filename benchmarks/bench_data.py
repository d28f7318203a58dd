"""Dataset-scale IG: tdhook_fn.data.attribute against an in-memory loop, and 2 ranks against 1.

On the digits CNN (random init) over all 1,797 digits, IG with 32 steps at each sample's
label, batches of 64, one intra-op thread per process:

- one process: ``attribute`` (memmap, fsync and records per batch) against a hand-written
  loop that keeps every batch's map in memory and concatenates them, in the same run;
- ``torchrun --nproc_per_node=2`` (gloo) against ``--nproc_per_node=1``, timed inside the
  ranks from a barrier before the call to the end of ``attribute`` (start-up excluded);
- the checks of what is on disk: digesting each batch's rows as written (part of the run),
  and returning the finished ``out_dir`` (file sizes, and every batch's rows digested again),
  each as a share of the one-process run.

``python bench_data.py --rank-job OUT`` is the job each torchrun rank runs.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from _digits import make_cnn
from sklearn.datasets import load_digits

import tdhook_fn
import tdhook_fn.data
from tdhook_fn.attribution import integrated_gradients
from tdhook_fn.data._digest import rows_digest

BATCH, STEPS = 64, 32


def digits() -> TensorDict:
    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return TensorDict(input=x, label=torch.tensor(bunch.target), batch_size=[len(x)])


def _kwargs() -> dict[str, object]:
    return dict(target=tdhook_fn.label("label", "output"), baselines=0.0, n_steps=STEPS)


def in_memory_loop(f: tdhook_fn.Functional, params: TensorDict, data: TensorDict) -> torch.Tensor:
    """The loop a user writes: every batch's map kept in RAM, concatenated at the end."""
    maps = [integrated_gradients(f, params, data[i:i + BATCH], **_kwargs())["input"]  # type: ignore[arg-type]
            for i in range(0, data.batch_size[0], BATCH)]
    return torch.cat(maps)


def rank_job(out_dir: str) -> None:
    torch.set_num_threads(1)
    net = make_cnn()
    f, params, data = tdhook_fn.functional(net), tdhook_fn.params(net), digits()
    dist.init_process_group("gloo")
    dist.barrier()
    start = time.perf_counter()
    tdhook_fn.data.attribute(integrated_gradients, f, params, data, out_dir, batch_size=BATCH, progress=False,
                             **_kwargs())  # type: ignore[arg-type]
    elapsed = time.perf_counter() - start
    if dist.get_rank() == 0:
        print(f"ELAPSED {elapsed:.4f}")
    dist.destroy_process_group()


def _torchrun(ranks: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                   __file__, "--rank-job", str(Path(tmp) / "out")]
        done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True, check=True)
    return float(next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("ELAPSED")))


def main(rounds: int = 3) -> None:
    torch.set_num_threads(1)
    net = make_cnn()
    f, params, data = tdhook_fn.functional(net), tdhook_fn.params(net), digits()
    n = data.batch_size[0]
    loop_times, ours_times, return_times, digest_times = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):  # interleaved, so that both see the same machine state
            start = time.perf_counter()
            reference = in_memory_loop(f, params, data)
            loop_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            out = tdhook_fn.data.attribute(integrated_gradients, f, params, data, Path(tmp) / f"r{r}",
                                           batch_size=BATCH, progress=False, **_kwargs())  # type: ignore[arg-type]
            ours_times.append(time.perf_counter() - start)
            torch.testing.assert_close(out["input"].clone(), reference, rtol=0, atol=0)
            start = time.perf_counter()  # a finished out_dir: sizes checked, every batch's rows digested again
            tdhook_fn.data.attribute(integrated_gradients, f, params, data, Path(tmp) / f"r{r}",
                                     batch_size=BATCH, progress=False, **_kwargs())  # type: ignore[arg-type]
            return_times.append(time.perf_counter() - start)
            start = time.perf_counter()  # what digesting the rows as they are written costs the run
            for i in range(0, n, BATCH):
                rows_digest(out, i, min(i + BATCH, n))
            digest_times.append(time.perf_counter() - start)
    loop, ours = statistics.median(loop_times), statistics.median(ours_times)
    returning, digests = statistics.median(return_times), statistics.median(digest_times)
    one, two = _torchrun(1), _torchrun(2)
    print(f"\ndataset-scale IG ({n} digits, {STEPS} steps, batches of {BATCH}, 1 thread per process)")
    print(f"  {'variant':<44}{'seconds':>10}{'samples/s':>12}{'speed ratio':>14}")
    rows = [("hand-written in-memory loop", loop, loop), ("data.attribute, one process", ours, loop),
            ("data.attribute, torchrun 1 rank", one, one), ("data.attribute, torchrun 2 ranks", two, one)]
    for label, seconds, base in rows:
        print(f"  {label:<44}{seconds:>10.2f}{n / seconds:>12.0f}{base / seconds:>13.2f}x")
    print("  (speed ratio: the row's samples/s over the loop's, and for 2 ranks over 1 rank; targets >= 0.9x and "
          ">= 1.6x. The torchrun ranks run with OMP_NUM_THREADS=1, the in-process rows with torch.set_num_threads(1))")
    print("\nchecking what is on disk, against the one-process run above")
    print(f"  {'step':<60}{'seconds':>10}{'of the run':>12}")
    print(f"  {'digesting every batch as written (inside the run)':<60}{digests:>10.4f}{digests / ours:>11.2%}")
    print(f"  {'returning the finished out_dir (sizes, every digest again)':<60}{returning:>10.4f}"
          f"{returning / ours:>11.2%}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rank-job":
        rank_job(sys.argv[2])
    else:
        main()
