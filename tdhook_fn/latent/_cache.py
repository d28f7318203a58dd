"""Caching activations at sites."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from .._taps import Tap
from ._run import Reads, check_f, forward, unflatten
from ._sites import Site, as_sites

__all__ = ["cache"]


def cache(
    f: Callable[[TensorDictBase, TensorDictBase], TensorDictBase],
    params: TensorDictBase,
    inputs: TensorDictBase,
    sites: Site | str | Sequence[Site | str],
    *,
    detach: bool = False,
    dtype: torch.dtype | None = None,
    outputs: bool = False,
    taps: Sequence[Tap] = (),
) -> TensorDict:
    """The activations of ``f(params, inputs)`` at ``sites``, by site key.

    Only the requested selections are kept (a site's ``index`` bounds the memory). The
    activations stay differentiable unless ``detach``.

    Args:
        f (Functional): pure function of a model (`tdhook_fn.functional`).
        params (TensorDict): its parameters.
        inputs (TensorDict): any batch size ``[*B]``.
        sites (Site | str | Sequence): where to read (see `Site`, `sites`).
        detach (bool): detach the cached values. Default: ``False``.
        dtype (torch.dtype | None): cast them. Default: keep.
        outputs (bool): also return ``f``'s outputs, under their keys. Default: ``False``.
        taps (Sequence[Tap]): any further taps for the forward, attached after the method's own
            (which thus read and write the activations before them). Default: none.

    Returns:
        TensorDict: batch ``[*B]``; ``result[site.key]`` is ``[*B, *selection]``.

    Raises:
        ValueError: a site never ran, or ran twice without ``call``; keys clash (also
            with ``f``'s out_keys, with ``outputs``).

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
        >>> x = TensorDict(input=torch.randn(5, 3), batch_size=[5])
        >>> acts = cache(f, p, x, ["[0]", Site("[1]", index=(2,))])
        >>> acts["0"].shape, acts["1[2]"].shape
        (torch.Size([5, 4]), torch.Size([5]))
    """
    f = check_f("cache", f, params, inputs)
    chosen = as_sites(sites, "cache")
    batch = inputs.batch_size
    reads = Reads("cache", chosen)
    out = forward(f, params, inputs.reshape(-1), [*reads.taps(), *taps])
    result = TensorDict({}, batch_size=batch)
    for site in chosen:
        value: Any = unflatten(reads.get(site), batch)
        value = value.detach() if detach else value
        result.set(site.key, value if dtype is None else value.to(dtype))
    if outputs:
        clash = sorted(str(k) for k in f.out_keys if k in result.keys())
        if clash:
            raise ValueError(f"cache: out_keys {clash} are also site keys; give the sites other keys (Site(..., key=))")
        for key in f.out_keys:
            result.set(key, out.get(key).reshape((*batch, *out.get(key).shape[1:])))
    return result
