"""Progress of dataset runs: tqdm's bar on a terminal, rate-limited log lines elsewhere."""

# NOTE [progress without a terminal]
# Under Slurm, nohup or CI stderr is a file, where a bar's carriage returns pile up into one
# unreadable line, so off a terminal (or without tqdm) progress goes to the ``logging``
# logger ``tdhook_fn.data`` at INFO: at most one line every ``LOG_EVERY`` seconds (samples
# done, rate, time left) and a last line when the run ends. A script that has not configured
# ``logging`` would never see INFO lines (Python's last-resort handler shows warnings only),
# so while no handler would take them they are written to stderr as they are; once the script
# configures logging, its handlers decide (and ``logging.getLogger("tdhook_fn.data").setLevel(
# logging.WARNING)`` silences the lines either way).

from __future__ import annotations

import importlib
import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

__all__ = ["LOG_EVERY", "progress_bar"]

LOG_EVERY = 10.0  # seconds between two progress lines off a terminal
logger = logging.getLogger("tdhook_fn.data")
clock: Callable[[], float] = time.monotonic  # a test replaces it with a fake clock


class Bar(Protocol):
    def update(self, n: int) -> Any: ...


class _Silent:
    def update(self, n: int) -> None:
        pass


class _LogLines:
    """Samples done out of ``total`` as log lines, one per ``LOG_EVERY`` seconds at most."""

    def __init__(self, total: int, done: int):
        self.total, self.done, self.start_done = total, done, done
        self.start = self.last = clock()

    def update(self, n: int) -> None:
        self.done = min(self.total, self.done + n)
        now = clock()
        if now - self.last >= LOG_EVERY and self.done < self.total:  # the last line says the end
            self.last = now
            rate = (self.done - self.start_done) / max(now - self.start, 1e-9)
            left = _duration((self.total - self.done) / rate) if rate > 0 else "unknown"
            _log(f"attribute: {self.done}/{self.total} samples ({100 * self.done // self.total}%), "
                 f"{rate:.3g} samples/s, {left} left")

    def close(self) -> None:
        seconds = clock() - self.start
        rate = (self.done - self.start_done) / max(seconds, 1e-9)
        ended = "done" if self.done >= self.total else "stopped"
        _log(f"attribute: {ended}, {self.done}/{self.total} samples, {self.done - self.start_done} in "
             f"{_duration(seconds)} ({rate:.3g} samples/s)")


@contextmanager
def progress_bar(total: int, done: int, *, enabled: bool) -> Iterator[Bar]:
    """Samples done (from ``done``) out of ``total``, with samples/s and time left; log lines off a terminal."""
    if not enabled:
        yield _Silent()
        return
    make: Any = None
    if sys.stderr.isatty():
        try:
            make = importlib.import_module("tqdm.auto").tqdm
        except ImportError:  # tqdm is optional: log lines without it
            make = None
    bar = (make(total=total, initial=done, unit="sample", dynamic_ncols=True, desc="attribute")
           if make is not None else _LogLines(total, done))
    try:
        yield bar
    finally:
        bar.close()


def _log(line: str) -> None:
    if not logger.hasHandlers():  # NOTE [progress without a terminal]; setLevel on the logger still silences it
        if logger.level <= logging.INFO:
            print(line, file=sys.stderr, flush=True)
    else:
        logger.info(line)


def _duration(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"
