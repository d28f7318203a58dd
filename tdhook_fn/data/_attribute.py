"""``attribute``: any pure method over a whole dataset, into a resumable memory-mapped result."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from ._digest import rows_digest, tensor_digest
from ._fingerprint import Json, fingerprint
from ._job import OutDir, differences
from ._process_group import World, joined
from ._progress import progress_bar
from ._source import Source

__all__ = ["attribute"]

Method = Callable[..., TensorDictBase]
logger = logging.getLogger("tdhook_fn.data")


def attribute(
    method: Method,
    f: Callable[[TensorDictBase, TensorDictBase], TensorDictBase],
    params: TensorDictBase,
    dataset: Any,
    out_dir: str | os.PathLike[str],
    *,
    batch_size: int = 64,
    resume: bool = True,
    overwrite: bool = False,
    progress: bool = True,
    **method_kwargs: Any,
) -> TensorDict:
    """Run ``method(f, params, batch, **method_kwargs)`` over ``dataset`` into ``out_dir``.

    The result is a memory-mapped TensorDict in ``out_dir`` with one row per sample in
    dataset order, holding what the method returns (with ``per_target=True``, whose maps
    come as ``[T, n]``, a row holds the sample's ``T`` maps: ``[N, T, ...]``).
    ``TensorDict.load_memmap(out_dir)`` opens it again later. Memory stays bounded by
    ``batch_size``: one batch is read, attributed and written at a time.

    The run is resumable: killed at any moment and run again
    with the same arguments, it redoes only the batches it had not recorded, and a
    finished ``out_dir`` returns at once. An ``out_dir`` written by a different method,
    ``f``, params, dataset, ``batch_size`` or method argument is refused (each is
    fingerprinted) unless ``overwrite=True``, which deletes it and starts again. Every
    sample counts: a TensorDict dataset is digested whole; a
    ``Dataset``'s batches are digested as they are read, and resuming or returning an
    ``out_dir`` reads its recorded batches again and refuses one that changed.

    Before an ``out_dir`` is resumed or returned, what is on disk is checked: the size of
    every result file, and each recorded batch's rows against a digest taken when they were
    written. Rows lost or damaged since (a truncated or deleted file) are redone, never
    returned. One process at a time works in an ``out_dir``: another is refused, naming the
    pid and host of the one there (whose lock goes when it exits, even if killed).

    Under ``torchrun`` (a ``torch.distributed`` process group, started here from
    torchrun's environment if the script has not), each rank takes a disjoint,
    deterministic share of the batches still to do and writes its rows into the same
    ``out_dir`` (a shared filesystem across machines); every rank returns the whole result
    once all are written, equal to the single-process one.

    Args:
        method: a pure method such as `tdhook_fn.attribution.saliency`,
            `integrated_gradients` or
            `grad_cam`.
        f: the pure function of the model, as for the method.
        params: its parameters, as for the method.
        dataset: a TensorDict with a leading batch dim, or a map-style
            ``torch.utils.data.Dataset`` whose items are TensorDicts or dicts of tensors.
            Keys the model does not read (labels) reach the target as for the methods,
            e.g. ``target=tdhook_fn.label("label")``.
        out_dir: where the result and the job's records are written.
        batch_size: samples per batch (the unit of work and of resuming).
        resume: ``False`` refuses to continue a partial ``out_dir`` (a finished one is
            still returned).
        overwrite: delete an ``out_dir`` of another job (or this one, partial or
            corrupt) and start again. A non-empty directory this function did not write
            is never deleted.
        progress: progress on rank 0: a ``tqdm`` bar on a terminal, elsewhere (Slurm,
            nohup, CI) a line on the ``tdhook_fn.data`` logger at most every 10 seconds
            and one at the end (on stderr while ``logging`` is not configured).
        **method_kwargs: passed to the method; ``baselines`` may also be a callable of
            the batch, called per batch.

    Returns:
        The result, memory-mapped from ``out_dir``, batch size ``[len(dataset), ...]``.

    Examples:
        >>> import tempfile, torch
        >>> from tensordict import TensorDict
        >>> import tdhook_fn, tdhook_fn.data
        >>> from tdhook_fn.attribution import saliency
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3))
        >>> data = TensorDict(input=torch.randn(10, 4), label=torch.arange(10) % 3, batch_size=[10])
        >>> f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
        >>> out = tdhook_fn.data.attribute(saliency, f, p, data, tempfile.mkdtemp() + "/run", batch_size=4,
        ...                                target=tdhook_fn.label("label"), progress=False)
        >>> out["input"].shape
        torch.Size([10, 4])
    """
    if not callable(method):
        raise TypeError(f"attribute: method must be a pure method such as saliency, got {type(method).__name__}")
    if not isinstance(params, TensorDictBase):
        raise TypeError(f"attribute: params must be a TensorDict (tdhook_fn.params(model)), "
                        f"got {type(params).__name__}")
    source = Source(dataset, batch_size)
    per_target = bool(method_kwargs.get("per_target", False))
    run_batch = _batch_runner(method, f, params, method_kwargs, per_target)
    job = _job(method, f, params, source, method_kwargs)
    out = OutDir(out_dir)
    with joined() as world:
        try:
            return _run(world, out, job, source, run_batch, resume, overwrite, progress)
        finally:
            out.release()


def _run(world: World, out: OutDir, job: Json, source: Source, run_batch: Callable[[TensorDict], TensorDictBase],
         resume: bool, overwrite: bool, progress: bool) -> TensorDict:
    plan = _shared_plan(world, out, job, source, run_batch, resume, overwrite)
    damaged = _check_recorded(world, out, source, plan["recorded"])
    if damaged:
        if not resume:
            raise FileExistsError(
                f"attribute: out_dir {str(out.path)!r} holds batches {damaged[:10]} whose rows on disk are damaged "
                f"(they differ from what was written) and resume=False; pass resume=True to redo them or "
                f"overwrite=True to start again")
        if world.rank == 0:
            logger.warning("attribute: out_dir %r: the rows of batches %s differ from what was written; redoing them",
                           str(out.path), damaged[:10])
            out.forget(damaged)
        world.barrier()  # forgotten before any rank records them again
    pending = sorted(plan["pending"] + damaged)
    mine = world.share(pending)
    if mine:
        result = out.result()
        left = sum(_size(source, i) for i in pending)
        with progress_bar(source.length, source.length - left, enabled=progress and world.rank == 0) as bar:
            for index in mine:
                batch, digest = source.read(index)
                _write(out, result, source, index, run_batch(batch), digest)
                bar.update(_size(source, index) * world.size)
    world.barrier()
    if world.rank == 0 and pending:
        missing = sorted(set(range(source.n_batches)) - out.done())
        if missing:
            raise RuntimeError(f"attribute: batches {missing[:10]} of {str(out.path)!r} were not recorded; run again")
        out.finish()
    world.barrier()
    return out.result()


def _shared_plan(world: World, out: OutDir, job: Json, source: Source,
                 run_batch: Callable[[TensorDict], TensorDictBase], resume: bool, overwrite: bool) -> dict[str, Any]:
    """Rank 0's plan on every rank; an error on rank 0 is raised on every rank, so none waits."""
    if world.size == 1:
        return _plan(out, job, source, run_batch, resume, overwrite)
    jobs = world.gather(job)
    odd = {r: differences(jobs[0], other) for r, other in enumerate(jobs) if other != jobs[0]}
    if odd:
        which = "; ".join(f"rank {r}: {d} differ" for r, d in odd.items())
        raise ValueError(f"attribute: ranks {sorted(odd)} run another job than rank 0 ({which}); "
                         f"every rank must call attribute with the same arguments "
                         f"(seed the model's initialisation or load the same weights on every rank, and keep "
                         f"rank-dependent values out of the method and its arguments)")
    plan: dict[str, Any] | None = None
    error: BaseException | None = None
    if world.rank == 0:
        try:
            plan = _plan(out, job, source, run_batch, resume, overwrite)
        except Exception as e:
            error = e
    shared = world.broadcast(plan if error is None else {"error": f"{type(error).__name__}: {error}"})
    if error is not None:
        raise error
    if "error" in shared:
        raise RuntimeError(f"attribute: rank 0 failed to prepare the run: {shared['error']}")
    return cast(dict[str, Any], shared)


def _plan(out: OutDir, job: Json, source: Source, run_batch: Callable[[TensorDict], TensorDictBase],
          resume: bool, overwrite: bool) -> dict[str, Any]:
    """Claim ``out_dir``, lay it out if new, and list the batches to do and the recorded ones to check."""
    state = out.claim(job, overwrite)
    recorded = sorted(out.done())
    if state == "new":  # batch 0 gives the layout's shapes and dtypes, and is kept
        batch, digest = source.read(0)
        first = run_batch(batch)
        out.lay_out(job, first[:1], source.length)
        _write(out, out.result(), source, 0, first, digest)
    pending = sorted(set(range(source.n_batches)) - out.done())  # a finished run's records may have gone since
    if state != "new" and pending and not resume:
        raise FileExistsError(f"attribute: out_dir {str(out.path)!r} holds an unfinished run of this job and "
                              f"resume=False; pass resume=True to finish it or overwrite=True to start again")
    return {"pending": pending, "recorded": recorded}


# NOTE [checked out_dir]
# What is on disk is checked before an out_dir is resumed or returned, so that rows lost
# or damaged since they were written (a truncated or deleted file, a full disk) are never
# returned as results. Rank 0 compares every result file's size with the size recorded at
# the layout (a stat per file; OutDir.claim), and every recorded batch's rows are digested
# again, a share per rank, against the digest computed when they were written: a batch
# that differs is redone (or, with resume=False, refused). Reading and hashing the rows
# costs a small fraction of attributing them (benchmarks/bench_data.py measures it).
def _check_recorded(world: World, out: OutDir, source: Source, recorded: list[int]) -> list[int]:
    """The recorded batches whose rows are damaged, on every rank; a batch of a changed dataset raises on every rank."""
    if not recorded:  # the same plan on every rank: all return here, or none
        return []
    result = out.result()
    changed: int | None = None
    damaged: list[int] = []
    for index in world.share(recorded):
        record = out.recorded(index)
        if record is not None and source.lazy and source.digest(index) != record["samples"]:
            changed = index
            break
        if record is None or rows_digest(result, *source.bounds(index)) != record["rows"]:
            damaged.append(index)
    found = world.gather((changed, damaged))
    changes = [c for c, _ in found if c is not None]
    if changes:
        start, stop = source.bounds(min(changes))
        raise ValueError(
            f"attribute: batch {min(changes)} (samples {start} to {stop - 1}) of the dataset differs from the one "
            f"recorded in out_dir {str(out.path)!r}: a sample or the order changed since, so the rows there are "
            f"another dataset's. Use a new out_dir, or delete the old one (overwrite=True) to start again")
    return sorted(i for _, some in found for i in some)


def _batch_runner(method: Method, f: Any, params: TensorDictBase, kwargs: dict[str, Any],
                  per_target: bool) -> Callable[[TensorDict], TensorDictBase]:
    name = getattr(method, "__name__", type(method).__name__)

    def run(batch: TensorDict) -> TensorDictBase:
        extra = dict(kwargs)
        if callable(extra.get("baselines")):
            extra["baselines"] = extra["baselines"](batch)
        out = method(f, params, batch, **extra)
        if not isinstance(out, TensorDictBase):
            raise TypeError(f"attribute: {name} returned a {type(out).__name__}, not a TensorDict")
        dim = 1 if per_target else 0
        if out.batch_dims <= dim or out.batch_size[dim] != batch.batch_size[0]:
            raise ValueError(f"attribute: {name} returned batch size {list(out.batch_size)} for a batch of "
                             f"{batch.batch_size[0]} samples; expected the samples along dim {dim}")
        return out.permute(1, 0, *range(2, out.batch_dims)) if per_target else out

    return run


def _job(method: Method, f: Any, params: TensorDictBase, source: Source, kwargs: dict[str, Any]) -> Json:
    job: dict[str, Json] = {
        "method": _described("method", method),
        "f": _described("f", f),
        "params": sorted([".".join(k) if isinstance(k, tuple) else k, tensor_digest(cast(torch.Tensor, v))]
                         for k, v in params.items(True, True)),
        "dataset": source.describe(),
        "batch_size": source.batch_size,
    }
    for key, value in sorted(kwargs.items()):
        job[f"argument {key}"] = _described(f"argument {key}", value)
    return job


def _described(what: str, value: object) -> Json:
    try:
        return fingerprint(value)
    except TypeError as e:
        raise TypeError(f"attribute: {what}: {e}") from e


def _write(out: OutDir, result: TensorDict, source: Source, index: int, rows: TensorDictBase, digest: str) -> None:
    start, stop = source.bounds(index)
    result[start:stop] = rows
    out.record(result, index, digest, rows_digest(result, start, stop))


def _size(source: Source, index: int) -> int:
    start, stop = source.bounds(index)
    return stop - start
