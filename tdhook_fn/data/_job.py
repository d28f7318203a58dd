"""An ``out_dir`` on disk: the job that owns it, the result's layout, the batches done."""

# NOTE [resumable out_dir]
# ``out_dir`` holds the result as a memory-mapped TensorDict (``TensorDict.load_memmap(
# out_dir)`` opens it) and entries of ours beside it:
#
# - ``_tdhook_fn.lock``: created first, locked while a run writes (NOTE [out_dir lock]).
# - ``_job.json``: the job's fingerprint (NOTE [job fingerprints]), written first, then
#   rewritten with ``"layout": true`` and the size of every file of the result once the
#   memmap files exist. A directory with a different fingerprint is refused.
# - ``_done/<batch>``: a file per finished batch holding the digest of the batch's samples
#   (NOTE [every row counts]) and the digest of its rows as written, created only after the
#   rows are written and flushed to disk (``fsync``), so a batch is either written and
#   recorded or redone; a process killed at any moment loses at most the batches it had not
#   recorded.
# - ``_complete``: written once every batch is recorded.
#
# Every file of ours is written to a temporary name and renamed, which is atomic; a
# temporary file left by a killed process is removed by the next run, which holds the lock.
#
# Files can still change under us afterwards (a full disk, a file-size limit, a user deleting
# or truncating one), so the disk is checked before a run resumes or returns
# (NOTE [checked out_dir]). A directory is ours when it holds the lock file, a job file of ours, or nothing
# but our entries; one that is not is never written to nor deleted, even with
# ``overwrite=True``. ``overwrite=True`` empties one of ours, partial or corrupt, and starts
# again (the lock file stays: it is held).

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from tensordict import TensorDict, TensorDictBase
from tensordict.memmap import MemoryMappedTensor

from ._fingerprint import Json
from ._lock import LOCK, DirLock

__all__ = ["OutDir", "differences"]

_JOB, _DONE, _COMPLETE = "_job.json", "_done", "_complete"
_TEMPORARY = re.compile(r"\.(_job\.json|_complete|\d+)\.\d+\.tmp")  # what _write renames from
_OURS = {_JOB, _DONE, _COMPLETE, LOCK}
logger = logging.getLogger("tdhook_fn.data")


class OutDir:
    """The files of one job in ``path`` (see NOTE [resumable out_dir])."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.lock = DirLock(self.path)

    # -- the job ------------------------------------------------------------------
    def claim(self, job: Json, overwrite: bool) -> str:
        """Lock ``path`` and make it this job's; ``"new"``, ``"partial"`` (resume) or ``"complete"``.

        The lock is held until `release`, also when this raises.
        """
        if self.path.exists() and not self.path.is_dir():
            raise NotADirectoryError(f"attribute: out_dir {str(self.path)!r} exists and is not a directory")
        entries = os.listdir(self.path) if self.path.exists() else []
        if entries and not self._ours(entries):
            raise FileExistsError(
                f"attribute: out_dir {str(self.path)!r} is not empty and was not written by tdhook_fn.data.attribute "
                f"(it has neither {LOCK} nor a job file of ours, {_JOB}); choose an empty or new directory. "
                f"It is never deleted, even with overwrite=True")
        self.path.mkdir(parents=True, exist_ok=True)
        self.lock.acquire()
        self._remove_temporary()  # under the lock, no other process of ours writes here
        old, problem = self._read_job()
        if overwrite:
            return self._start(job)
        if problem is not None:
            raise ValueError(f"attribute: cannot use out_dir {str(self.path)!r}: {problem}; "
                             f"pass overwrite=True to delete what is there and start again")
        if old is not None and old["job"] != job:
            raise ValueError(
                f"attribute: out_dir {str(self.path)!r} holds another job: {differences(old['job'], job)} differ. "
                f"Use another out_dir, or pass overwrite=True to delete it and start again")
        if old is None or not old.get("layout"):  # new, or killed before the layout was written
            return self._start(job)
        if not self._layout_intact(old.get("files")):
            return self._start(job)
        (self.path / _DONE).mkdir(exist_ok=True)  # gone: every batch is redone
        return "complete" if (self.path / _COMPLETE).exists() else "partial"

    def release(self) -> None:
        self.lock.release()

    def lay_out(self, job: Json, template: TensorDictBase, length: int) -> None:
        """Create the memmap files for ``length`` rows shaped like ``template``'s rows, and record their sizes."""
        template.expand(length, *template.batch_size[1:]).memmap_like(str(self.path))
        files = {str(p.relative_to(self.path)): p.stat().st_size for p in sorted(self.path.rglob("*"))
                 if p.is_file() and p.relative_to(self.path).parts[0] not in _OURS}
        self._write(_JOB, json.dumps({"job": job, "layout": True, "files": files}))

    def _start(self, job: Json) -> str:
        self._clear()
        (self.path / _DONE).mkdir()
        self._write(_JOB, json.dumps({"job": job, "layout": False}))
        return "new"

    def _ours(self, entries: list[str]) -> bool:
        if LOCK in entries or all(e in _OURS or _TEMPORARY.fullmatch(e) for e in entries):
            return True
        return _JOB in entries and self._read_job()[1] is None

    def _read_job(self) -> tuple[dict[str, Any] | None, str | None]:
        """The job file's content, or why it cannot be read; ``(None, None)`` when there is none."""
        try:
            data = json.loads((self.path / _JOB).read_text())
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError) as e:
            return None, f"cannot read {self.path / _JOB} ({e})"
        if not isinstance(data, dict) or "job" not in data:
            return None, f"{self.path / _JOB} is not a job file"
        return data, None

    def _remove_temporary(self) -> None:
        for folder in (self.path, self.path / _DONE):
            if folder.is_dir():
                for name in os.listdir(folder):
                    if _TEMPORARY.fullmatch(name):
                        (folder / name).unlink(missing_ok=True)

    def _clear(self) -> None:
        """Delete everything here but the lock file; the job file last, so the directory stays ours meanwhile."""
        for name in sorted(os.listdir(self.path), key=lambda n: n == _JOB):
            entry = self.path / name
            if name == LOCK:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()

    # -- what is on disk ----------------------------------------------------------
    def _layout_intact(self, files: object) -> bool:
        """Check the result's files against the sizes recorded at the layout (NOTE [checked out_dir]).

        A memmap file of the wrong size, or missing, is given its size back (the rows it lost
        then fail their batches' digests and are redone); anything else amiss (a ``meta.json``)
        means laying the result out again: False.
        """
        if not isinstance(files, dict):
            return self._damaged("the sizes of its result files are not recorded")
        for name, size in files.items():
            relative = Path(name)
            if relative.is_absolute() or ".." in relative.parts or not isinstance(size, int):
                return self._damaged(f"{_JOB} names a file {name!r} outside it")
            file = self.path / relative
            actual = file.stat().st_size if file.is_file() else None
            if actual == size:
                continue
            if not name.endswith(".memmap"):
                return self._damaged(f"{name} is {'missing' if actual is None else f'{actual} bytes, not {size}'}")
            logger.warning("attribute: out_dir %r: %s is %s; the batches whose rows it lost are redone",
                           str(self.path), name, "missing" if actual is None else f"{actual} bytes, not {size}")
            with open(file, "ab") as fh:
                fh.truncate(size)
        try:
            self.result()
        except Exception as e:  # any failure to open it means laying it out again
            return self._damaged(f"the result cannot be opened ({type(e).__name__}: {e})")
        return True

    def _damaged(self, why: str) -> bool:
        logger.warning("attribute: out_dir %r: %s; laying the result out again and redoing every batch",
                       str(self.path), why)
        return False

    # -- the result and the batches done -------------------------------------------
    def result(self) -> TensorDict:
        """The memory-mapped result (writable: rows are written into it in place)."""
        return TensorDict.load_memmap(str(self.path))

    def done(self) -> set[int]:
        return {int(name) for name in os.listdir(self.path / _DONE) if name.isdigit()}

    def record(self, result: TensorDictBase, index: int, samples: str, rows: str) -> None:
        """Flush the result's files to disk, then mark batch ``index`` done with the digests of its samples and rows."""
        for leaf in result.values(True, True):
            if isinstance(leaf, MemoryMappedTensor) and leaf.filename is not None:
                _fsync(leaf.filename)
        self._write(f"{_DONE}/{index}", json.dumps({"samples": samples, "rows": rows}))

    def recorded(self, index: int) -> dict[str, str] | None:
        """The digests recorded with batch ``index``: ``samples`` and ``rows``; None if unreadable."""
        try:
            data = json.loads((self.path / _DONE / str(index)).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in ("samples", "rows")):
            return None
        return {"samples": data["samples"], "rows": data["rows"]}

    def forget(self, indices: list[int]) -> None:
        """Unrecord batches (their rows are damaged) and the completion: they are redone."""
        (self.path / _COMPLETE).unlink(missing_ok=True)
        for index in indices:
            (self.path / _DONE / str(index)).unlink(missing_ok=True)

    def finish(self) -> None:
        self._write(_COMPLETE, "")

    def _write(self, name: str, text: str) -> None:
        target = self.path / name
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "w") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            if isinstance(e, OSError):  # a full disk or a file-size limit: say which file
                raise OSError(e.errno, f"attribute: cannot write {target}: {e.strerror or e}") from e
            raise


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
