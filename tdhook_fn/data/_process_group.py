"""The processes of a run: one, or the ranks of a ``torch.distributed`` process group.

Under ``torchrun`` with no process group yet, `joined` starts one from the
environment torchrun sets (gloo on CPU, nccl when CUDA is available) and keeps it for
the later runs of the process (starting a group again on torchrun's rendezvous port can
hang), ending it at exit; a group the caller started is used as it is and left alone.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["World", "joined"]


@dataclass(frozen=True)
class World:
    """This process's rank among ``size`` processes (``size == 1``: no process group)."""

    rank: int
    size: int

    def share(self, items: list[int]) -> list[int]:
        """This rank's deterministic, disjoint share of ``items``."""
        return items[self.rank::self.size]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


@contextmanager
def joined() -> Iterator[World]:
    """The world of this process, starting a process group under torchrun if none exists."""
    if dist.is_available() and not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        atexit.register(_end)
    if dist.is_available() and dist.is_initialized():
        yield World(dist.get_rank(), dist.get_world_size())
    else:
        yield World(0, 1)


def _end() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
