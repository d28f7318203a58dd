"""A progress bar for dataset runs: tqdm's, on a terminal, when tqdm is installed."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

__all__ = ["progress_bar"]


class Bar(Protocol):
    def update(self, n: int) -> Any: ...


class _Silent:
    def update(self, n: int) -> None:
        pass


@contextmanager
def progress_bar(total: int, done: int, *, enabled: bool) -> Iterator[Bar]:
    """Samples done (from ``done``) out of ``total``, with samples/s and ETA; silent off a terminal."""
    make: Any = None
    if enabled and sys.stderr.isatty():
        try:
            make = importlib.import_module("tqdm.auto").tqdm
        except ImportError:  # tqdm is optional: no bar without it
            make = None
    if make is None:
        yield _Silent()
        return
    bar = make(total=total, initial=done, unit="sample", dynamic_ncols=True, desc="attribute")
    try:
        yield bar
    finally:
        bar.close()
