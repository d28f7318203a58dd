"""torch's random state, kept to replay a forward's draws when the forward has to run again."""

# NOTE [a forward run again draws the same numbers]
# Some calls run a forward a second time on the same inputs: the layer pullbacks after a
# later module wrote a kept activation in place (NOTE [activations read without a copy]),
# or where the first run reaches a tensor that requires grad and `torch.func.vjp` must
# redo it, and the layer specs' retry after a stale spec. A model that draws (dropout in
# training mode, a forward calling ``torch.rand``) would draw other numbers the second
# time, so the result would be that of another call, and the caller's generator would
# advance twice. So the state is saved before the first run and put back before the
# second: the second draws what the first drew, and the generator ends where one forward
# leaves it. Saved: the CPU generator, and each GPU's where CUDA is initialised (a
# forward can draw on no GPU before CUDA is; ``get_rng_state_all`` reads a few bytes per
# device and never initialises one).

from __future__ import annotations

import torch

__all__ = ["RandomState"]


class RandomState:
    """torch's generators as they are now (NOTE [a forward run again draws the same numbers])."""

    __slots__ = ("cpu", "cuda")

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]

    def restore(self) -> None:
        """Put the generators back as they were when this was made."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
