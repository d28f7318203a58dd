"""A TensorDict built without tensordict's checks, for entries the caller made with the batch in front."""

# NOTE [unchecked TensorDicts]
# ``TensorDict(entries, batch_size=b)`` checks every entry's leading dims against ``b``
# and parses the batch size: about twice what ``TensorDict._new_unsafe`` costs, and a
# gradient call builds several (the target values, the maps, the outputs, the
# cotangents). Where the entries were just made from a TensorDict of that batch (an
# output's column, a gradient of an input, a ones_like), the check cannot fail, so those
# are built unchecked. Only one-name (str) keys: ``_new_unsafe`` stores a tuple key as
# one name (a nested key would come back missing); callers with another key take the
# checked constructor. Under torch.compile ``_new_unsafe`` builds the checked one.

from __future__ import annotations

from typing import Any, cast

import torch
from tensordict import TensorDict

__all__ = ["unchecked_td"]


def unchecked_td(entries: dict[str, Any], batch: torch.Size, device: torch.device | None = None) -> TensorDict:
    """``TensorDict(entries, batch_size=batch, device=device)`` for str keys and tensors whose leading dims are
    ``batch`` (the caller's guarantee; NOTE [unchecked TensorDicts])."""
    return TensorDict._new_unsafe(cast(Any, entries), batch_size=batch, device=device)
