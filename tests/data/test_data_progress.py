"""Progress where there is no terminal (Slurm, nohup, CI): rate-limited log lines, not a bar.

A fake clock stands in for time: each reading advances it, so the tests never sleep.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from tensordict import TensorDict

import tdhook_fn
import tdhook_fn.data
from tdhook_fn.attribution import saliency
from tdhook_fn.data import _progress

N, BATCH = 23, 2  # 12 batches: batch 0 lays the result out, 11 more are shown as progress


class FakeClock:
    """Seconds that advance by ``step`` at each reading."""

    def __init__(self, step: float):
        self.now, self.step = 1000.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def _run(tmp_path, monkeypatch, step: float, **extra):
    monkeypatch.setattr(_progress, "clock", FakeClock(step))
    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 2))
    data = TensorDict(input=torch.randn(N, 3), batch_size=[N])
    return tdhook_fn.data.attribute(saliency, tdhook_fn.functional(net), tdhook_fn.params(net), data,
                                    tmp_path / "r", batch_size=BATCH, target=1, **extra)


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tdhook_fn.data" and r.levelno == logging.INFO]


def test_off_a_terminal_progress_is_logged_at_most_once_per_interval_and_at_the_end(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="tdhook_fn.data")
    _run(tmp_path, monkeypatch, step=3.0)  # 3 s a batch: a line every fourth batch
    lines = _lines(caplog)
    assert len(lines) == 3, lines  # at 12 s and 24 s of the 33 s, then the last line
    assert lines[0] == "attribute: 10/23 samples (43%), 0.667 samples/s, 0:00:20 left"
    assert re.fullmatch(r"attribute: 18/23 samples \(78%\), 0.667 samples/s, 0:00:0\d left", lines[1])
    assert lines[-1] == "attribute: done, 23/23 samples, 21 in 0:00:36 (0.583 samples/s)"


def test_a_fast_run_logs_only_its_last_line(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="tdhook_fn.data")
    _run(tmp_path, monkeypatch, step=0.01)
    assert len(_lines(caplog)) == 1 and _lines(caplog)[0].startswith("attribute: done, 23/23 samples")


def test_progress_false_logs_nothing(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="tdhook_fn.data")
    _run(tmp_path, monkeypatch, step=30.0, progress=False)
    assert _lines(caplog) == []


def test_without_logging_configured_the_lines_go_to_stderr(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_progress.logger, "hasHandlers", lambda: False)  # as in a script that set up no logging
    _run(tmp_path, monkeypatch, step=3.0)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and err[-1].startswith("attribute: done, 23/23 samples"), err
    monkeypatch.setattr(_progress.logger, "level", logging.WARNING)  # silenced by the user
    _run(tmp_path, monkeypatch, step=3.0, overwrite=True)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("tqdm_installed", [True, False])
def test_on_a_terminal_without_tqdm_the_lines_are_logged(tmp_path, monkeypatch, caplog, tqdm_installed):
    caplog.set_level(logging.INFO, logger="tdhook_fn.data")
    real_import = _progress.importlib.import_module

    def no_tqdm(name: str):
        if name.startswith("tqdm"):
            raise ImportError(name)
        return real_import(name)

    if not tqdm_installed:
        monkeypatch.setattr(_progress.importlib, "import_module", no_tqdm)
    monkeypatch.setattr(_progress, "clock", FakeClock(3.0))
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 2))
    data = TensorDict(input=torch.randn(N, 3), batch_size=[N])
    tdhook_fn.data.attribute(saliency, tdhook_fn.functional(net), tdhook_fn.params(net), data, tmp_path / "r",
                             batch_size=BATCH, target=1)
    assert (len(_lines(caplog)) == 3) != tqdm_installed
