"""Dataset-scale runs of the pure methods: streamed, memory-mapped, resumable, distributed.

`attribute` runs any method of `tdhook_fn.attribution` (or any function of
the same shape) over a whole dataset a batch at a time, writes one row per sample into a
memory-mapped TensorDict on disk, records each finished batch so that a killed job
resumes where it stopped, and under ``torchrun`` shares the batches between the ranks of
a ``torch.distributed`` process group. It is a driver: the numbers are the method's.

`fit_probes` streams a dataset through a model and fits ridge probes at every site from
accumulated sufficient statistics, resumable from its checkpoints.
"""

from ._attribute import attribute
from ._probes import fit_probes

__all__ = ["attribute", "fit_probes"]
