"""What is on disk is checked before an out_dir is returned or resumed: lost or damaged rows are redone.

Result files truncated, deleted or overwritten after their batches were recorded (a full
disk, a quota, a user) must never come back as rows of zeros or an empty TensorDict.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import tdhook_fn
import tdhook_fn.data
from tdhook_fn.attribution import saliency

N, BATCH = 40, 4  # ten batches of 4 rows; a row of input is 3 doubles


@pytest.fixture
def job():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).double()
    data = TensorDict(input=torch.randn(N, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64),
                      batch_size=[N])
    return tdhook_fn.functional(net), tdhook_fn.params(net), data


def _counting(log: Path):
    """saliency counting its calls in a file (a list it grows would change the job), and the count."""
    path = str(log)

    def counted_saliency(f, params, inputs, **kwargs):
        with open(path, "a") as fh:
            fh.write(f"{inputs.batch_size[0]}\n")
        return saliency(f, params, inputs, **kwargs)

    return counted_saliency, lambda: len(log.read_text().split()) if log.exists() else 0


def _run(job, out: Path, method=saliency, **extra):
    f, p, data = job
    return tdhook_fn.data.attribute(method, f, p, data, out, batch_size=BATCH, target=1, progress=False, **extra)


def _expected(job) -> torch.Tensor:
    f, p, data = job
    return saliency(f, p, data, target=1)["input"]


def _truncate_last_rows(out: Path, rows: int) -> None:
    file = out / "input.memmap"
    os.truncate(file, file.stat().st_size - rows * 3 * 8)


def _zero_a_middle_batch(out: Path) -> None:
    with open(out / "input.memmap", "r+b") as fh:  # same size, other bytes: only the digest tells
        fh.seek(5 * BATCH * 3 * 8)
        fh.write(bytes(BATCH * 3 * 8))


@pytest.mark.parametrize(("damage", "redone"), [
    (lambda out: _truncate_last_rows(out, 2), 1),  # the last batch lost two rows
    (lambda out: (out / "input.memmap").unlink(), N // BATCH),
    (_zero_a_middle_batch, 1),
    (lambda out: (out / "meta.json").unlink(), N // BATCH),  # the layout itself: laid out again
    (lambda out: (out / "_done" / "7").unlink(), 1),  # a record of a finished run
    (lambda out: shutil.rmtree(out / "_done"), N // BATCH),
    (lambda out: (out / "_done" / "7").write_text("3f2a"), 1),  # a record not ours
], ids=["truncated", "deleted", "overwritten", "meta-deleted", "record-deleted", "records-deleted",
        "record-unreadable"])
def test_a_finished_out_dir_with_damaged_files_redoes_the_damaged_batches(job, tmp_path, damage, redone):
    method, calls = _counting(tmp_path / "calls")
    _run(job, tmp_path / "r", method)
    assert calls() == N // BATCH
    damage(tmp_path / "r")
    out = _run(job, tmp_path / "r", method)
    assert calls() - N // BATCH == redone
    torch.testing.assert_close(out["input"], _expected(job), rtol=1e-12, atol=1e-12)
    assert (tmp_path / "r" / "_complete").exists()
    again = _run(job, tmp_path / "r", method)  # intact now: returned without attributing
    assert calls() - N // BATCH == redone
    torch.testing.assert_close(again["input"], _expected(job), rtol=1e-12, atol=1e-12)


def test_a_partial_out_dir_with_a_truncated_file_redoes_the_lost_batches_too(job, tmp_path):
    method, calls = _counting(tmp_path / "calls")
    _run(job, tmp_path / "r", method)
    for name in ("2", "3"):  # killed before batches 2 and 3 were recorded
        (tmp_path / "r" / "_done" / name).unlink()
    (tmp_path / "r" / "_complete").unlink()
    _truncate_last_rows(tmp_path / "r", BATCH + 1)  # and the last two batches' rows lost
    out = _run(job, tmp_path / "r", method)
    assert calls() - N // BATCH == 4  # batches 2, 3, 8 and 9
    torch.testing.assert_close(out["input"], _expected(job), rtol=1e-12, atol=1e-12)


def test_damaged_rows_with_resume_false_are_refused(job, tmp_path):
    _run(job, tmp_path / "r")
    _zero_a_middle_batch(tmp_path / "r")
    with pytest.raises(FileExistsError, match=r"batches \[5\] whose rows on disk are damaged.*resume=True"):
        _run(job, tmp_path / "r", resume=False)
    torch.testing.assert_close(_run(job, tmp_path / "r")["input"], _expected(job), rtol=1e-12, atol=1e-12)


def test_each_record_holds_the_digest_of_its_rows_as_written(job, tmp_path):
    _run(job, tmp_path / "r")
    record = json.loads((tmp_path / "r" / "_done" / "3").read_text())
    assert set(record) == {"samples", "rows"} and len(record["rows"]) == 64
    layout = json.loads((tmp_path / "r" / "_job.json").read_text())
    assert layout["files"]["input.memmap"] == N * 3 * 8
