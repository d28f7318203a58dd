"""One job at a time in an ``out_dir``: an advisory ``flock`` on a lock file inside it."""

# NOTE [out_dir lock]
# Two processes writing one ``out_dir`` would interleave their files (and each would see the
# other's half-written ones), so the process that claims an ``out_dir`` holds an exclusive
# ``fcntl.flock`` on ``_tdhook_fn.lock`` in it until its run ends, and writes its pid and
# host into the file; a second process is refused at once with an error naming them. The OS
# drops the lock when its process dies, however it dies, so a killed run never blocks the next
# one; the file stays (deleting it would let a third process lock a new file while the second
# still holds the old one) and marks the directory as ours (NOTE [resumable out_dir]). Under
# ``torchrun`` rank 0 holds the lock for all the ranks of the job, which follow its plan.
# ``flock`` is advisory and per host on some network filesystems: it keeps apart our own runs,
# not other programs. Where ``fcntl`` does not exist (Windows) nothing is locked.

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

__all__ = ["LOCK", "DirLock"]

LOCK = "_tdhook_fn.lock"


class DirLock:
    """The exclusive lock on ``LOCK`` in a directory, held from `acquire` to `release`."""

    def __init__(self, directory: Path):
        self.file = directory / LOCK
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise naming the process that holds it."""
        if self._fd is not None:
            return
        fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not _try_lock(fd):
                raise RuntimeError(
                    f"attribute: out_dir {str(self.file.parent)!r} is in use by {_holder(fd)}, which is running "
                    f"tdhook_fn.data.attribute there; wait until it ends (its lock is released when it exits, "
                    f"even if killed) or use another out_dir")
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Forget the holder and drop the lock (closing the file drops it)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # a process refused later never names a holder that has gone
        finally:
            os.close(fd)


if sys.platform != "win32":
    import fcntl

    def _try_lock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True
else:  # pragma: no cover - no flock on Windows

    def _try_lock(fd: int) -> bool:
        return True


def _holder(fd: int) -> str:
    """``process <pid> on host <host>`` as the holder wrote it, or ``another process`` before it has."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode())
        return f"process {int(holder['pid'])} on host {str(holder['host'])!r}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"
