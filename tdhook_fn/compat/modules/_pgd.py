"""``PGDModule``: repeated projected gradient steps around a TensorDictModule (``tdhook.modules``)."""

from __future__ import annotations

import math
from typing import Any

from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase

from tdhook_fn.attribution import pgd_step

from ._wrappers import layout, prefixed

__all__ = ["PGDModule"]


class PGDModule(TensorDictModuleBase):
    """Run ``td_module`` ``n_steps`` times, each followed by a projected gradient step.

    Each key ``td_module`` writes under ``grad_key`` is moved by
    `tdhook_fn.attribution.pgd_step` (``alpha``, ``min_value``, ``max_value``, ``ascent``
    and ``use_sign`` are its arguments; tdhook's defaults: descent on the sign).

    Args:
        td_module (TensorDictModuleBase): computes the gradients.
        n_steps (int): number of steps. Default: 10.
        grad_key: where ``td_module`` writes the gradients. Default: ``"_grad"``.
        working_key: the sub-TensorDict the steps work in (``None``: ``td`` itself), which
            holds the result after. Default: ``"_working"``.
    """

    def __init__(
        self,
        td_module: TensorDictModuleBase,
        alpha: float = 0.1,
        n_steps: int = 10,
        min_value: float = -math.inf,
        max_value: float = math.inf,
        grad_key: Any = "_grad",
        working_key: Any = "_working",
        ascent: bool = False,
        use_sign: bool = True,
    ) -> None:
        super().__init__()
        self._td_module = td_module
        self.in_keys = td_module.in_keys
        self.out_keys = prefixed(list(td_module.out_keys), working_key)
        self._alpha, self._n_steps = alpha, n_steps
        self._min_value, self._max_value = min_value, max_value
        self._grad_key, self._working_key = grad_key, working_key
        self._ascent, self._use_sign = ascent, use_sign

    def forward(self, td: TensorDict) -> TensorDict:
        working: TensorDictBase = td if self._working_key is None else td.get(self._working_key)
        for _ in range(self._n_steps):
            working = self._td_module(working)
            grads: TensorDictBase = working.get(self._grad_key)
            for key in grads.keys(True, True):
                working.set(key, pgd_step(working.get(key), grads.get(key), self._alpha, min_value=self._min_value,
                                          max_value=self._max_value, ascent=self._ascent, use_sign=self._use_sign))
        if self._working_key is None:
            td.update(working)
        else:
            td.set(self._working_key, working)
        return td

    def __repr__(self) -> str:
        # (tdhook's layout, trailing comma included)
        return layout(self, f"td_module={self._td_module},\nin_keys={self.in_keys},\nout_keys={self.out_keys},\n")
