"""An ``out_dir`` on disk: the job that owns it, the result's layout, the batches done.

# NOTE [resumable out_dir]
``out_dir`` holds the result as a memory-mapped TensorDict (``TensorDict.load_memmap(
out_dir)`` opens it) and three entries of ours beside it:

- ``_job.json``: the job's fingerprint (NOTE [job fingerprints]), written first, then
  rewritten with ``"layout": true`` once the memmap files exist. A directory with a
  different fingerprint is refused, and one we did not write is never deleted.
- ``_done/<batch>``: a file per finished batch holding the digest of the batch's samples
  (NOTE [every row counts]), created only after the batch's rows are written and flushed
  to disk (``fsync``), so a batch is either written and recorded or redone; a process
  killed at any moment loses at most the batches it had not recorded.
- ``_complete``: written once every batch is recorded; a re-run returns at once.

Every file of ours is written to a temporary name and renamed, which is atomic.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from tensordict import TensorDict, TensorDictBase
from tensordict.memmap import MemoryMappedTensor

from ._fingerprint import Json

__all__ = ["OutDir", "differences"]

_JOB, _DONE, _COMPLETE = "_job.json", "_done", "_complete"


class OutDir:
    """The files of one job in ``path`` (see NOTE [resumable out_dir])."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)

    # -- the job ------------------------------------------------------------------
    def claim(self, job: Json, overwrite: bool) -> str:
        """Make ``path`` this job's; ``"new"``, ``"partial"`` (resume) or ``"complete"``."""
        if self.path.exists() and not self.path.is_dir():
            raise NotADirectoryError(f"attribute: out_dir {str(self.path)!r} exists and is not a directory")
        entries = sorted(os.listdir(self.path)) if self.path.exists() else []
        old = self._read_job() if _JOB in entries else None
        if entries and old is None:
            raise FileExistsError(
                f"attribute: out_dir {str(self.path)!r} is not empty and was not written by tdhook_fn.data.attribute "
                f"(it has no {_JOB}); choose an empty or new directory. It is never deleted, even with overwrite=True")
        if old is not None and (overwrite or old["job"] != job):
            if not overwrite:
                raise ValueError(
                    f"attribute: out_dir {str(self.path)!r} holds another job: {differences(old['job'], job)} differ. "
                    f"Use another out_dir, or pass overwrite=True to delete it and start again")
            shutil.rmtree(self.path)
            old = None
        if old is not None and old.get("layout") and (self.path / _COMPLETE).exists():
            return "complete"
        if old is not None and old.get("layout"):
            return "partial"
        if old is not None:  # killed while writing the layout: start the layout again
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / _DONE).mkdir(exist_ok=True)
        self._write(_JOB, json.dumps({"job": job, "layout": False}))
        return "new"

    def lay_out(self, job: Json, template: TensorDictBase, length: int) -> None:
        """Create the memmap files for ``length`` rows shaped like ``template``'s rows."""
        template.expand(length, *template.batch_size[1:]).memmap_like(str(self.path))
        self._write(_JOB, json.dumps({"job": job, "layout": True}))

    def _read_job(self) -> dict[str, Any]:
        try:
            data = json.loads((self.path / _JOB).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"attribute: cannot read {self.path / _JOB} ({e}); "
                             f"pass overwrite=True to start again") from e
        if not isinstance(data, dict) or "job" not in data:
            raise ValueError(f"attribute: {self.path / _JOB} is not a job file; pass overwrite=True to start again")
        return data

    # -- the result and the batches done -------------------------------------------
    def result(self) -> TensorDict:
        """The memory-mapped result (writable: rows are written into it in place)."""
        return TensorDict.load_memmap(str(self.path))

    def done(self) -> set[int]:
        return {int(name) for name in os.listdir(self.path / _DONE) if name.isdigit()}

    def record(self, result: TensorDictBase, index: int, digest: str) -> None:
        """Flush the result's files to disk, then mark batch ``index`` as done, read with ``digest``."""
        for leaf in result.values(True, True):
            if isinstance(leaf, MemoryMappedTensor) and leaf.filename is not None:
                _fsync(leaf.filename)
        self._write(f"{_DONE}/{index}", digest)

    def digest(self, index: int) -> str:
        """The digest recorded with batch ``index``."""
        return (self.path / _DONE / str(index)).read_text()

    def finish(self) -> None:
        self._write(_COMPLETE, "")

    def _write(self, name: str, text: str) -> None:
        target = self.path / name
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)


def _fsync(filename: str) -> None:
    fd = os.open(filename, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def differences(old: Json, new: Json) -> str:
    """The names of the fields in which two job fingerprints differ."""
    keys = sorted(set(old) | set(new))
    changed = [k for k in keys if old.get(k) != new.get(k)]
    return ", ".join(changed) or "the job files"
