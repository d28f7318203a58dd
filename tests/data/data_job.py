"""A dataset job run in a subprocess (or under torchrun) by the resume and distributed tests.

``python data_job.py OUT_DIR CALLS_DIR`` runs IG with ``per_target`` over 60 samples in
batches of 8, counting each batch it attributes in ``CALLS_DIR/rank-<r>`` (one line per
call). ``KILL_AT=k`` SIGKILLs the process at a k-th batch: ``KILL_WHERE=method`` while
attributing the k-th batch logged in ``CALLS_DIR/rank-<r>``, ``record`` after the rows of
its k-th batch are written but before it is recorded. ``KILL_RANK`` limits the kill to one
rank. ``TWICE=1`` runs the job a second time, into ``OUT_DIR-again``, in the same processes.

The model's last layer has a forward hook reading a global numpy array, so the resumed and
distributed runs (each process with its own hash seed) also show that such a job's
fingerprint is the same in every process.
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np
import torch
from tensordict import TensorDict

import tdhook_fn
import tdhook_fn.data
from tdhook_fn.attribution import integrated_gradients
from tdhook_fn.data import _job

WEIGHTS = np.array([1.0, 0.5, 2.0, 1.0, 0.25], dtype=np.float32)  # read by the hook: part of the job


def weighted(module, args, output):  # type: ignore[no-untyped-def]
    return output * torch.from_numpy(WEIGHTS)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 8 * 8, 5))
    net[3].register_forward_hook(weighted)
    return net


def dataset() -> TensorDict:
    g = torch.Generator().manual_seed(1)
    return TensorDict(input=torch.randn(60, 1, 8, 8, generator=g), batch_size=[60])


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _kill_here(where: str, count: int) -> None:
    wanted = os.environ.get("KILL_RANK")
    if (os.environ.get("KILL_WHERE", "method") == where and count == int(os.environ.get("KILL_AT", "0"))
            and (wanted is None or int(wanted) == _rank())):
        os.kill(os.getpid(), signal.SIGKILL)


def counted_ig(f, params, inputs, **kwargs):  # type: ignore[no-untyped-def]
    # Counted in the file, not in a global: the values of the globals a method reads are part of its job.
    log = os.path.join(os.environ["CALLS_DIR"], f"rank-{_rank()}")
    with open(log, "a") as fh:
        fh.write(f"{inputs.batch_size[0]}\n")
    with open(log) as fh:
        _kill_here("method", len(fh.readlines()))
    return integrated_gradients(f, params, inputs, **kwargs)


_record = _job.OutDir.record
RECORDS = [0]  # read by killing_record only, which is no part of the job


def killing_record(self, result, index, *digests):  # type: ignore[no-untyped-def]
    RECORDS[0] += 1
    _kill_here("record", RECORDS[0])
    _record(self, result, index, *digests)


def main(out_dir: str, calls_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ["CALLS_DIR"] = calls_dir
    _job.OutDir.record = killing_record  # type: ignore[method-assign]
    net = model()
    for target in [out_dir] + ([f"{out_dir}-again"] if os.environ.get("TWICE") else []):
        tdhook_fn.data.attribute(counted_ig, tdhook_fn.functional(net), tdhook_fn.params(net), dataset(), target,
                                 batch_size=8, progress=False, target=(0, 1, 2), per_target=True, baselines=0.0,
                                 n_steps=8)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
