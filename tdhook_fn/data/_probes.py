"""``fit_probes``: ridge probes at every site over a dataset too large for memory, resumable."""

# NOTE [streamed probes]
# A batch at a time, the model runs once (`tdhook_fn.latent.cache` reads every site), each
# site's ridge statistics are taken (`ridge_statistics`: count, means, centred cross-products)
# and merged into the running ones, exactly; memory is one batch plus ``D x D`` per site. The
# probes are solved once at the end (`solve_ridge`), equal to the in-memory fit on all the
# samples. ``out_dir`` keeps the job's fingerprint (``_job.json``, as `attribute`'s) and the
# running statistics with the number of batches in them (``_statistics.pt``, written to a
# temporary file and renamed, atomically, every ``checkpoint_every`` batches and at the end),
# so a killed run resumes from its last checkpoint and a finished one is solved again at once
# (with any ``alpha``: the penalty is not part of the job). A lazily read ``Dataset``'s
# batches are digested as read and the digests kept; resuming reads those batches again and
# refuses a changed one. One process works in an ``out_dir`` at a time (its lock).

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from tensordict import TensorDict, TensorDictBase

from ..latent import Site, cache
from ..latent.probing import merge_ridge_statistics, ridge_statistics, solve_ridge
from ._fingerprint import Json, fingerprint
from ._job import differences
from ._lock import LOCK, DirLock
from ._progress import progress_bar
from ._source import Source

__all__ = ["fit_probes"]

_JOB, _STATE = "_job.json", "_statistics.pt"
_CALLER = "fit_probes"
Task = Literal["auto", "classification", "regression"]


def fit_probes(
    f: Callable[[TensorDictBase, TensorDictBase], TensorDictBase],
    params: TensorDictBase,
    dataset: Any,
    sites: Site | str | Sequence[Site | str],
    out_dir: str | os.PathLike[str],
    *,
    label_key: str = "label",
    classes: torch.Tensor | None = None,
    task: Task = "auto",
    alpha: float | torch.Tensor = 1.0,
    fit_intercept: bool = True,
    batch_size: int = 64,
    dtype: torch.dtype = torch.float64,
    checkpoint_every: int = 16,
    resume: bool = True,
    overwrite: bool = False,
    progress: bool = True,
) -> TensorDict:
    """Ridge probes at ``sites`` of ``f`` over a whole ``dataset``, streamed and resumable.

    Equal to `tdhook_fn.latent.probing.fit_probes` (``kind="ridge"``) on the activations of
    every sample, without holding them: a batch is cached, its statistics merged into the
    running ones, and the probes solved once at the end. Killed and run again with the same
    arguments it resumes from its last checkpoint; a finished ``out_dir`` is solved again at
    once (``alpha`` and ``fit_intercept`` may change). An ``out_dir`` of another job (model,
    params, dataset, sites, labels, ``batch_size``, ``dtype``) is refused unless
    ``overwrite=True``.

    Args:
        f (Functional): the pure function of the model (`tdhook_fn.functional`).
        params (TensorDict): its parameters.
        dataset (TensorDict | Dataset): a TensorDict with a leading batch dim, or a
            map-style ``Dataset`` of TensorDicts or dicts of tensors, holding the model's
            inputs and the labels under ``label_key``.
        sites (Site | str | Sequence): where to read (see `tdhook_fn.latent.Site`); each
            sample's activation is flattened to one row (select positions with ``index``).
        out_dir (str | PathLike): where the job's records and statistics are kept.
        label_key (str): the labels' key in the dataset. Default: ``"label"``.
        classes (Tensor | None): the sorted classes of a classifier; read from a TensorDict
            dataset's labels when not given, required for a ``Dataset``. Default: ``None``.
        task (str): as for `fit_probes`. Default: ``"auto"``.
        alpha (float | Tensor): the ridge penalty. Default: ``1.0``.
        fit_intercept (bool): fit an unpenalised bias. Default: ``True``.
        batch_size (int): samples per forward. Default: ``64``.
        dtype (torch.dtype): the statistics' dtype. Default: ``torch.float64``.
        checkpoint_every (int): batches between checkpoints. Default: ``16``.
        resume (bool): ``False`` refuses to continue a partial ``out_dir``. Default: ``True``.
        overwrite (bool): delete an ``out_dir`` of another job and start again. Default: ``False``.
        progress (bool): show progress (as `attribute`). Default: ``True``.

    Returns:
        TensorDict: the probes by site key, as `tdhook_fn.latent.probing.fit_probes` returns them.

    Raises:
        ValueError: another job's ``out_dir``, a changed dataset, no ``classes`` for a
            ``Dataset`` classifier, a missing label key, a multi-process group.

    Examples:
        >>> import tempfile, torch
        >>> from tensordict import TensorDict
        >>> import tdhook_fn, tdhook_fn.data
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        >>> x = torch.randn(50, 4)
        >>> data = TensorDict(input=x, label=(x[:, 0] > 0).long(), batch_size=[50])
        >>> f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
        >>> probes = tdhook_fn.data.fit_probes(f, p, data, ["[0]", "[1]"], tempfile.mkdtemp() + "/probes",
        ...                                    batch_size=16, progress=False)
        >>> probes["0", "weight"].shape
        torch.Size([1, 8])
    """
    _refuse_process_groups()
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 1:
        raise ValueError(f"{_CALLER}: checkpoint_every must be a positive int, got {checkpoint_every!r}")
    source = _source(dataset, batch_size)
    classes = _classes(source, label_key, classes, task)
    job = _job(f, params, source, sites, label_key, classes, task, dtype)
    path = Path(out_dir)
    lock = DirLock(path)
    try:
        state = _claim(path, lock, job, overwrite)
        if state is not None and state["batches"] < source.n_batches and not resume:
            raise FileExistsError(f"{_CALLER}: out_dir {str(path)!r} holds an unfinished run of this job and "
                                  "resume=False; pass resume=True to finish it or overwrite=True to start again")
        stats = _run(f, params, source, sites, path, state, label_key, classes, task, dtype, checkpoint_every,
                     progress)
    finally:
        lock.release()
    return solve_ridge(stats, alpha=alpha, fit_intercept=fit_intercept)


def _run(f: Any, params: TensorDictBase, source: Source, sites: Any, path: Path, state: dict[str, Any] | None,
         label_key: str, classes: torch.Tensor | None, task: Task, dtype: torch.dtype, every: int,
         progress: bool) -> TensorDict:
    done = 0 if state is None else int(state["batches"])
    digests: list[str] = [] if state is None else list(state["digests"])
    stats = None if state is None else TensorDict.from_dict(state["stats"])
    _check_recorded(source, digests, path)
    start = source.bounds(done)[0] if done < source.n_batches else source.length
    with progress_bar(source.length, start, enabled=progress) as bar, torch.no_grad():
        for index in range(done, source.n_batches):
            batch, digest = source.read(index)
            if label_key not in batch.keys():
                raise ValueError(f"{_CALLER}: batch {index} has no labels under label_key={label_key!r}; its keys "
                                 f"are {sorted(map(str, batch.keys()))}")
            acts = cache(f, params, batch.exclude(label_key), sites, detach=True, dtype=dtype)
            labels = batch.get(label_key)
            if classes is None and task != "regression" and not labels.is_floating_point():
                raise ValueError(f"{_CALLER}: a Dataset is read a batch at a time and a batch may miss a class; "
                                 "give classes= (the sorted classes of the whole dataset)")
            part = ridge_statistics(acts, labels, task=task, classes=classes)
            stats = part if stats is None else merge_ridge_statistics(stats, part)
            digests.append(digest)
            if (index + 1) % every == 0 or index + 1 == source.n_batches:
                _save(path, stats, index + 1, digests)
            start, stop = source.bounds(index)
            bar.update(stop - start)
    assert stats is not None
    return stats


def _refuse_process_groups() -> None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(f"{_CALLER}: runs in one process; under torchrun call it on rank 0 only "
                         "(the statistics of a batch are cheap next to the forward of the whole dataset)")


def _source(dataset: Any, batch_size: int) -> Source:
    try:
        return Source(dataset, batch_size)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("attribute:", f"{_CALLER}:", 1)) from e


def _classes(source: Source, label_key: str, classes: torch.Tensor | None, task: Task) -> torch.Tensor | None:
    """The dataset's classes: given, or read from a TensorDict's labels; a lazy dataset must name them."""
    if classes is not None or task == "regression":
        return classes
    if source.lazy:
        if task == "classification":
            raise ValueError(f"{_CALLER}: a Dataset is read a batch at a time and a batch may miss a class; give "
                             "classes= (the sorted classes of the whole dataset)")
        return None  # "auto": checked per batch by the labels' dtype; integer labels then need classes
    if label_key not in source.dataset.keys():
        raise ValueError(f"{_CALLER}: the dataset has no labels under label_key={label_key!r}")
    labels = source.dataset.get(label_key)
    if task == "classification" or not labels.is_floating_point():
        found: torch.Tensor = torch.unique(torch.as_tensor(labels))
        return found
    return None


def _job(f: Any, params: TensorDictBase, source: Source, sites: Any, label_key: str,
         classes: torch.Tensor | None, task: Task, dtype: torch.dtype) -> Json:
    try:
        job = {"method": _CALLER, "f": fingerprint(f), "params": fingerprint(params), "dataset": source.describe(),
                "sites": fingerprint(sites), "label_key": label_key, "classes": fingerprint(classes), "task": task,
                "batch_size": source.batch_size, "dtype": str(dtype)}
    except TypeError as e:
        raise TypeError(f"{_CALLER}: {e}") from e
    return json.loads(json.dumps(job))  # as read back from _job.json


def _claim(path: Path, lock: DirLock, job: Json, overwrite: bool) -> dict[str, Any] | None:
    """Lock ``path`` for this job; the saved state to resume from, or None to start."""
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{_CALLER}: out_dir {str(path)!r} exists and is not a directory")
    entries = set(os.listdir(path)) if path.exists() else set()
    if entries and not entries & {LOCK, _JOB}:
        raise FileExistsError(f"{_CALLER}: out_dir {str(path)!r} is not empty and was not written by "
                              f"tdhook_fn.data.fit_probes; choose an empty or new directory")
    path.mkdir(parents=True, exist_ok=True)
    lock.acquire()
    old = _read_json(path / _JOB)
    if old is not None and old != job and not overwrite:
        raise ValueError(f"{_CALLER}: out_dir {str(path)!r} holds another job: {differences(old, job)} differ. "
                         "Use another out_dir, or pass overwrite=True to delete it and start again")
    if overwrite or old != job:
        (path / _STATE).unlink(missing_ok=True)
        _write(path / _JOB, json.dumps(job).encode())
        return None
    if not (path / _STATE).exists():
        return None
    try:
        state: dict[str, Any] = torch.load(path / _STATE, weights_only=True)
    except Exception as e:  # a damaged checkpoint: start again rather than return wrong numbers
        raise ValueError(f"{_CALLER}: cannot read {path / _STATE} ({type(e).__name__}); pass overwrite=True to "
                         "start again") from e
    return state


def _check_recorded(source: Source, digests: list[str], path: Path) -> None:
    """A lazy dataset's recorded batches are read again: one that changed since is refused."""
    if not source.lazy:
        return
    for index, recorded in enumerate(digests):
        if source.digest(index) != recorded:
            start, stop = source.bounds(index)
            raise ValueError(f"{_CALLER}: batch {index} (samples {start} to {stop - 1}) of the dataset differs from "
                             f"the one in out_dir {str(path)!r}; use a new out_dir or overwrite=True")


def _save(path: Path, stats: TensorDict, batches: int, digests: list[str]) -> None:
    tmp = path / f".{_STATE}.{os.getpid()}.tmp"
    torch.save({"batches": batches, "digests": digests, "stats": stats.to_dict()}, tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path / _STATE)


def _read_json(file: Path) -> Json | None:
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"unreadable": True}


def _write(file: Path, data: bytes) -> None:
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, file)
