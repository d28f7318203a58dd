"""``k`` copies of every sample on one flat batch dim: what the noise, surrogate and metric methods feed a forward."""

# NOTE [flat copies]
# Copies of every sample (noisy inputs, perturbed inputs) go to a forward flattened to one batch dim, ``[N * k]`` in
# ``repeat_interleave`` memory order (`flat_copies`): the engine runs the model on one batch dim anyway, and a batch it
# need not reshape costs it no TensorDict reshapes on the way in and out (a fixed cost per
# call, which shows on small models). The maps come back
# ``[*T, N * k]`` and are summed over the copies by tensor views (`fold_copies`), as are
# the ``[*T, *B, k]`` maps of a user's attribution method (which is still given ``[*B, k]``).

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from .._functional import fresh_tensordict
from .._types import NestedKey

__all__ = ["flat_copies", "flat_target"]


def flat_copies(inputs: TensorDictBase, k: int, replaced: Mapping[NestedKey, torch.Tensor]) -> TensorDictBase:
    """``k`` copies of every sample on one flat batch dim ``[N * k]`` (NOTE [flat copies]).

    ``replaced`` holds, by key, the copies to use instead (``[*B, k, ...]``, or broadcasting
    to it); every other entry is repeated.
    """
    batch = inputs.batch_size
    if type(inputs) is TensorDict:  # every entry a tensor under a one-name key: built unchecked (on every call)
        entries: dict[Any, Any] = {}
        for key, value in inputs.__dict__["_tensordict"].items():
            if type(value) is not torch.Tensor:
                break
            entries[key] = _flattened(replaced[key] if key in replaced else value.unsqueeze(len(batch)), batch, k)
        else:
            if replaced.keys() <= entries.keys():  # (else a key spelled otherwise, ("input",) for "input")
                return fresh_tensordict(entries, [batch.numel() * k])
    out = TensorDict({}, batch_size=[batch.numel() * k])
    used = set()
    for key, leaf in inputs.items(True, True):
        copy = replaced[key] if key in replaced else cast(torch.Tensor, leaf).unsqueeze(len(batch))
        out.set(key, _flattened(copy, batch, k))
        used.add(key)
    for spelled in replaced.keys() - used:  # (a key spelled otherwise, ("input",) for "input")
        out.set(spelled, _flattened(replaced[spelled], batch, k))
    for key, value in inputs.non_tensor_items(True):  # a string or number kwarg the forward also takes
        out.set_non_tensor(key, value)
    return out


def _flattened(copy: torch.Tensor, batch: torch.Size, k: int) -> torch.Tensor:
    """Copies ``[*B, k or 1, ...]`` as ``[N * k, ...]`` (a view where they are whole)."""
    feature = copy.shape[len(batch) + 1:]
    return copy.expand(*batch, k, *feature).reshape(-1, *feature)


def flat_target(target: Any, batch: torch.Size, k: int) -> Any:
    """A tensor of class indices (one per sample, ``[*B]``) for the flat copies ``[N * k]``."""
    if isinstance(target, torch.Tensor) and target.dim():
        return target.unsqueeze(-1).expand(*batch, k).reshape(-1)
    return target
