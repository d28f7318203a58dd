"""A dataset job run in a subprocess (or under torchrun) by the resume and distributed tests.

``python data_job.py OUT_DIR CALLS_DIR`` runs IG with ``per_target`` over 60 samples in
batches of 8, counting each batch it attributes in ``CALLS_DIR/rank-<r>`` (one line per
call). ``KILL_AT=k`` SIGKILLs the process at its k-th batch: ``KILL_WHERE=method`` while
attributing it, ``record`` after its rows are written but before it is recorded.
``KILL_RANK`` limits the kill to one rank. ``TWICE=1`` runs the job a second time, into
``OUT_DIR-again``, in the same processes.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from tensordict import TensorDict

import tdhook_fn
import tdhook_fn.data
from tdhook_fn.attribution import integrated_gradients
from tdhook_fn.data import _job


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 8 * 8, 5))


def dataset() -> TensorDict:
    g = torch.Generator().manual_seed(1)
    return TensorDict(input=torch.randn(60, 1, 8, 8, generator=g), batch_size=[60])


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


KILLS = {"method": 0, "record": 0}  # globals, not closure cells: the job's fingerprint is the same on every rank


def _kill_here(where: str) -> None:
    KILLS[where] += 1
    wanted = os.environ.get("KILL_RANK")
    if (os.environ.get("KILL_WHERE", "method") == where and KILLS[where] == int(os.environ.get("KILL_AT", "0"))
            and (wanted is None or int(wanted) == _rank())):
        os.kill(os.getpid(), signal.SIGKILL)


def counted_ig(f, params, inputs, **kwargs):  # type: ignore[no-untyped-def]
    with open(os.path.join(os.environ["CALLS_DIR"], f"rank-{_rank()}"), "a") as fh:
        fh.write(f"{inputs.batch_size[0]}\n")
    _kill_here("method")
    return integrated_gradients(f, params, inputs, **kwargs)


_record = _job.OutDir.record


def killing_record(self, result, index):  # type: ignore[no-untyped-def]
    _kill_here("record")
    _record(self, result, index)


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
