"""An out_dir left behind by a failed or concurrent run stays usable, and is never shared by two jobs.

A run killed by a file-size limit (SIGXFSZ) or stopped by one (EFBIG), a corrupt job file,
and a second process on the same out_dir: the next run works, ``overwrite=True`` recovers
any directory of ours, and a process holding the directory is named in the error.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import shutil
import signal
import socket
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import tdhook_fn
import tdhook_fn.data
from tdhook_fn.attribution import saliency
from tdhook_fn.data import _job as job_files
from tdhook_fn.data._lock import LOCK, DirLock

N, BATCH = 12, 4

def _job():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    data = TensorDict(input=torch.randn(N, 3, generator=torch.Generator().manual_seed(1)), batch_size=[N])
    return tdhook_fn.functional(net), tdhook_fn.params(net), data


def run(out, **extra):  # type: ignore[no-untyped-def]
    f, p, data = _job()
    return tdhook_fn.data.attribute(saliency, f, p, data, out, batch_size=BATCH, progress=False,
                                    **{"target": 1, **extra})


def _expected() -> torch.Tensor:
    f, p, data = _job()
    return saliency(f, p, data, target=1)["input"]


def _temporary(out: Path) -> list[str]:
    return [p.name for p in out.rglob("*.tmp")]


def _limited_run(out: str, error: str, restore_signal: bool) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))  # ulimit -f: _job.json is larger
    if restore_signal:  # Python ignores SIGXFSZ (then a write raises OSError EFBIG); a C caller may not
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    try:
        run(out)
    except OSError as e:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        Path(error).write_text(f"{e.errno} {e}")
        os._exit(3)


def _under_a_file_size_limit(out: Path, *, signal_ignored: bool) -> tuple[int | None, str]:
    """Exit code and error of the job run in a forked process under a file-size limit."""
    process = multiprocessing.get_context("fork").Process(  # forked: no import; it fails before computing
        target=_limited_run, args=(str(out), str(out) + ".error", not signal_ignored))
    process.start()
    process.join(120)
    error = Path(str(out) + ".error")
    return process.exitcode, error.read_text() if error.exists() else ""


@pytest.mark.skipif(sys.platform == "win32", reason="no RLIMIT_FSIZE")
@pytest.mark.parametrize("signal_ignored", [False, True], ids=["killed-by-SIGXFSZ", "EFBIG-raised"])
def test_a_run_stopped_by_a_file_size_limit_leaves_a_usable_out_dir(tmp_path, signal_ignored):
    exitcode, error = _under_a_file_size_limit(tmp_path / "r", signal_ignored=signal_ignored)
    if signal_ignored:
        assert exitcode == 3 and error.startswith(f"{errno.EFBIG} ") and "cannot write" in error, error
        assert "_job.json" in error and _temporary(tmp_path / "r") == []  # cleaned on the way out
    else:
        assert exitcode == -signal.SIGXFSZ
        assert _temporary(tmp_path / "r")  # the killed process could clean nothing
    shutil.copytree(tmp_path / "r", tmp_path / "copy")
    torch.testing.assert_close(run(tmp_path / "r")["input"], _expected())  # the next run works
    torch.testing.assert_close(run(tmp_path / "copy", overwrite=True)["input"], _expected())
    assert _temporary(tmp_path / "r") == _temporary(tmp_path / "copy") == []


def test_a_write_failing_midway_names_the_file_and_the_next_run_resumes(tmp_path, monkeypatch):
    real_replace = os.replace

    def full_disk(src, dst):  # the record of batch 1 cannot be written
        if Path(dst).parent.name == "_done" and Path(dst).name == "1":
            raise OSError(errno.EFBIG, "File too large")
        real_replace(src, dst)

    monkeypatch.setattr(job_files.os, "replace", full_disk)
    with pytest.raises(OSError, match=r"cannot write .*_done/1: File too large") as err:
        run(tmp_path / "r")
    assert err.value.errno == errno.EFBIG
    assert _temporary(tmp_path / "r") == [] and sorted(os.listdir(tmp_path / "r" / "_done")) == ["0"]
    monkeypatch.setattr(job_files.os, "replace", real_replace)
    torch.testing.assert_close(run(tmp_path / "r")["input"], _expected())  # the lock was released


def test_a_corrupt_job_file_is_refused_and_overwrite_recovers(tmp_path):
    run(tmp_path / "r")
    (tmp_path / "r" / "_job.json").write_text('{"job": {"method"')
    with pytest.raises(ValueError, match="cannot read .*_job.json.*overwrite=True"):
        run(tmp_path / "r")
    torch.testing.assert_close(run(tmp_path / "r", overwrite=True)["input"], _expected())
    torch.testing.assert_close(run(tmp_path / "r")["input"], _expected())


def _hold(out: str, locked, release) -> None:  # type: ignore[no-untyped-def]
    lock = DirLock(Path(out))
    lock.acquire()
    locked.set()
    release.wait(60)


def _holder(out: Path):  # type: ignore[no-untyped-def]
    """Another process holding ``out``'s lock until its ``release`` event is set (or it is killed)."""
    context = multiprocessing.get_context("fork")  # forks this process: no import, fast
    locked, release = context.Event(), context.Event()
    process = context.Process(target=_hold, args=(str(out), locked, release))
    process.start()
    assert locked.wait(60)
    return process, release


@pytest.mark.skipif(sys.platform == "win32", reason="no flock")
@pytest.mark.parametrize("ends", ["exits", "is-killed"])
def test_an_out_dir_in_use_by_another_process_is_refused_naming_it_until_it_ends(tmp_path, ends):
    run(tmp_path / "r")
    process, release = _holder(tmp_path / "r")
    try:
        for overwrite in (False, True):
            with pytest.raises(RuntimeError, match=rf"in use by process {process.pid} on host "
                                                   rf"'{socket.gethostname()}'.*another out_dir"):
                run(tmp_path / "r", overwrite=overwrite)
        with pytest.raises(RuntimeError, match="in use by process"):
            run(tmp_path / "r", target=0)  # another job is refused in the same words, not as another directory
    finally:
        if ends == "exits":
            release.set()
        else:
            os.kill(process.pid, signal.SIGKILL)  # the OS drops a dead process's lock
        process.join(60)
    torch.testing.assert_close(run(tmp_path / "r")["input"], _expected())


def test_a_new_directory_being_started_by_another_process_is_named_too(tmp_path):
    (tmp_path / "r").mkdir()
    process, release = _holder(tmp_path / "r")  # it has only its lock file so far
    try:
        with pytest.raises(RuntimeError, match=rf"in use by process {process.pid}"):
            run(tmp_path / "r")
    finally:
        release.set()
        process.join(60)
    assert sorted(os.listdir(tmp_path / "r")) == [LOCK]
    torch.testing.assert_close(run(tmp_path / "r")["input"], _expected())
