"""tdhook_fn.data.attribute killed with SIGKILL and re-run, and under torchrun with 2 gloo ranks.

The job is ``data_job.py`` beside this file: IG with ``per_target`` over 60 samples in 8
batches; each process logs one line per batch it attributes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

JOB = Path(__file__).with_name("data_job.py")
N_BATCHES = 8


def _run(out: Path, calls: Path, *, ranks: int = 1, **env: str) -> subprocess.CompletedProcess[str]:
    calls.mkdir(exist_ok=True)
    command = [sys.executable, str(JOB), str(out), str(calls)]
    if ranks > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                   *command[1:]]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    with subprocess.Popen(command, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=300)
        finally:
            _kill_group(process.pid)  # a rank torchrun left running after a failure must not write on
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _kill_group(group: int) -> None:
    """SIGKILL every process left in ``group`` and wait until none runs (zombies do not write)."""
    deadline = time.monotonic() + 30
    while _running_in(group):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of group {group} survived SIGKILL")
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def _running_in(group: int) -> bool:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        if fields[0] != "Z" and int(fields[2]) == group:  # state, ppid, pgrp
            return True
    return False


def _calls(calls: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in calls.glob("rank-*"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> TensorDict:
    """The whole job in one process, never killed: the reference for every other run."""
    root = tmp_path_factory.mktemp("reference")
    done = _run(root / "out", root / "calls")
    assert done.returncode == 0, done.stderr
    assert _calls(root / "calls") == N_BATCHES
    return TensorDict.load_memmap(root / "out").to_tensordict()


def _equal(out: Path, reference: TensorDict) -> None:
    result = TensorDict.load_memmap(out)
    assert result.batch_size == reference.batch_size == torch.Size([60, 3])
    torch.testing.assert_close(result["input"], reference["input"], rtol=0, atol=0)  # same batches, same kernels


@pytest.mark.parametrize(("where", "at"), [("method", 1), ("method", 4), ("record", 3)])
def test_a_job_killed_at_any_point_resumes_without_redoing_recorded_batches(tmp_path, uninterrupted, where, at):
    killed = _run(tmp_path / "out", tmp_path / "calls", KILL_WHERE=where, KILL_AT=str(at))
    assert killed.returncode == -signal.SIGKILL
    recorded = len(os.listdir(tmp_path / "out" / "_done"))
    assert recorded == at - 1
    before = _calls(tmp_path / "calls")
    resumed = _run(tmp_path / "out", tmp_path / "calls")
    assert resumed.returncode == 0, resumed.stderr
    assert _calls(tmp_path / "calls") - before == N_BATCHES - recorded  # recorded batches are not redone
    _equal(tmp_path / "out", uninterrupted)


def test_torchrun_with_two_ranks_equals_one_process(tmp_path, uninterrupted):
    done = _run(tmp_path / "out", tmp_path / "calls", ranks=2, TWICE="1")  # two runs in the same processes
    assert done.returncode == 0, done.stderr
    per_rank = [len((tmp_path / "calls" / f"rank-{r}").read_text().splitlines()) for r in (0, 1)]
    assert sum(per_rank) == 2 * N_BATCHES and min(per_rank) >= 6  # disjoint shares, each rank working
    _equal(tmp_path / "out", uninterrupted)
    _equal(tmp_path / "out-again", uninterrupted)


def test_a_rank_killed_mid_run_loses_only_its_unrecorded_batches(tmp_path, uninterrupted):
    killed = _run(tmp_path / "out", tmp_path / "calls", ranks=2, KILL_RANK="1", KILL_AT="2")
    assert killed.returncode != 0
    recorded = len(os.listdir(tmp_path / "out" / "_done"))
    assert 1 <= recorded < N_BATCHES
    before = _calls(tmp_path / "calls")
    resumed = _run(tmp_path / "out", tmp_path / "calls", ranks=2)
    assert resumed.returncode == 0, resumed.stderr
    assert _calls(tmp_path / "calls") - before == N_BATCHES - recorded
    _equal(tmp_path / "out", uninterrupted)
    again = _run(tmp_path / "out", tmp_path / "calls", ranks=2)  # finished: returns without attributing
    assert again.returncode == 0 and _calls(tmp_path / "calls") - before == N_BATCHES - recorded
