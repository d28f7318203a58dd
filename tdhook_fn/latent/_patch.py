"""Activation patching: one patched run, or a sweep of many in one batched forward.

# NOTE [patching sweeps]
A sweep patches each site, one at a time, with its activation from the clean run and
reads a metric. Hook libraries run one hooked forward per site in a Python loop. Here
the runs are folded into the batch: ``chunk_size`` runs (all of them by default) go
through the model as one batch of ``chunk_size * N`` samples; at each module one tap
copies the activation once and writes, into the rows of each run patched there, that
run's clean selection (the patched values are the clean ones exactly, the other rows
untouched). So any model that takes a batch takes the sweep (Hugging Face attention
masks included), the result equals the loop of :func:`patch` calls up to the rounding
of a larger batch, and ``chunk_size`` bounds the memory to ``chunk_size`` forwards. The
write into the copy is in place, so ``vmap`` over a sweep is not supported (``grad``
is).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from .._taps import Tap
from ._cache import cache
from ._run import Metric, check_f, flat_sources, forward, metric_values
from ._sites import Site, as_indices, as_sites

__all__ = ["patch", "patching_sweep"]

Combine = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _replacer(method: str, site: Site, source: torch.Tensor, fn: Combine | None) -> Callable[[torch.Tensor], Any]:
    def replace(current: torch.Tensor) -> torch.Tensor:
        if fn is not None:
            return fn(current, source)
        if source.dim() > current.dim() or any(
                a not in (1, b) for a, b in zip(reversed(source.shape), reversed(current.shape), strict=False)):
            raise ValueError(f"{method}: the source for site {site.key!r} has shape {tuple(source.shape)}, the "
                             f"activation there {tuple(current.shape)} (batch flattened)")
        return source.expand_as(current).to(current.dtype)

    return replace


def patch(
    f: Callable[[TensorDictBase, TensorDictBase], TensorDictBase],
    params: TensorDictBase,
    inputs: TensorDictBase,
    sites: Site | str | Sequence[Site | str],
    sources: TensorDictBase,
    *,
    fn: Combine | None = None,
) -> TensorDict:
    """The outputs of ``f(params, inputs)`` with the activations at ``sites`` replaced.

    Args:
        f (Functional): pure function of a model.
        params (TensorDict): its parameters.
        inputs (TensorDict): any batch size ``[*B]``.
        sites (Site | str | Sequence): where to patch.
        sources (TensorDict): the new activations by site key, ``[*B, *selection]`` (as
            :func:`cache` returns for the same sites, e.g. from a clean run), or without
            the batch dims to patch every sample alike.
        fn (Callable | None): ``fn(current, source) -> new`` instead of ``source``.

    Returns:
        TensorDict: ``f``'s outputs, batch ``[*B]``.

    >>> import torch, tdhook_fn
    >>> from tensordict import TensorDict
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
    >>> clean, corrupt = (TensorDict(input=torch.randn(5, 3), batch_size=[5]) for _ in range(2))
    >>> out = patch(f, p, corrupt, "[1]", cache(f, p, clean, "[1]"))
    >>> torch.allclose(out["output"], f(p, clean)["output"])
    True
    """
    f = check_f("patch", f, params, inputs)
    chosen = as_sites(sites, "patch")
    batch = inputs.batch_size
    flat = flat_sources("patch", sources, chosen, batch, "sources")
    taps = [site.editor(_replacer("patch", site, flat[site.key], fn)) for site in chosen]
    out = forward(f, params, inputs.reshape(-1), taps)
    return out.reshape(batch)


def patching_sweep(
    f: Callable[[TensorDictBase, TensorDictBase], TensorDictBase],
    params: TensorDictBase,
    clean: TensorDictBase,
    corrupted: TensorDictBase,
    sites: Site | str | Sequence[Site | str],
    metric: Metric,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``metric`` of the corrupted run with each site, in turn, patched from the clean run.

    All runs go through the model in batches of ``chunk_size`` runs (see NOTE [patching
    sweeps]), not in a loop of forwards.

    Args:
        f (Functional): pure function of a model.
        params (TensorDict): its parameters.
        clean (TensorDict): the inputs the patched activations come from, ``[*B]``.
        corrupted (TensorDict): the inputs that run, same batch size.
        sites (Site | str | Sequence): one patched run each, e.g. every layer x every
            token position: ``[Site(p, index=(t,)) for p in paths for t in range(L)]``.
        metric (Callable): ``outputs -> Tensor`` of one value per sample (the outputs'
            batch dims, whatever they are).
        chunk_size (int | None): runs per forward; bounds memory. Default: all.

    Returns:
        Tensor: ``[len(sites), *B]``, in the order of ``sites``.

    >>> import torch, tdhook_fn
    >>> from tensordict import TensorDict
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
    >>> clean, corrupt = (TensorDict(input=torch.randn(5, 3), batch_size=[5]) for _ in range(2))
    >>> logit = lambda out: out["output"][..., 0]
    >>> effects = patching_sweep(f, p, clean, corrupt, [Site("[1]", index=(i,)) for i in range(4)], logit)
    >>> effects.shape
    torch.Size([4, 5])
    """
    f = check_f("patching_sweep", f, params, corrupted)
    chosen = as_sites(sites, "patching_sweep")
    batch = corrupted.batch_size
    if clean.batch_size != batch:
        raise ValueError(f"patching_sweep: clean has batch {list(clean.batch_size)}, corrupted {list(batch)}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"patching_sweep: chunk_size should be None or an int > 0, got {chunk_size!r}")
    sources = flat_sources("patching_sweep", cache(f, params, clean, chosen, detach=False), chosen, batch, "sources")
    flat = corrupted.reshape(-1)
    n = flat.batch_size[0]
    size = chunk_size or len(chosen)
    values = []
    for start in range(0, len(chosen), size):
        runs = chosen[start : start + size]
        groups: dict[tuple[Any, ...], list[tuple[int, Site]]] = {}
        for k, site in enumerate(runs):  # one tap per module: all its runs in one write
            groups.setdefault((site.path, site.site, site.call, site.element), []).append((k, site))
        taps = [_runs_tap(members, sources, len(runs), n) for members in groups.values()]
        out = forward(f, params, flat.expand(len(runs), n).reshape(-1), taps)
        values.append(metric_values("patching_sweep", metric, out, (len(runs), *batch)))
    return torch.cat(values)


def _runs_tap(members: list[tuple[int, Site]], sources: dict[str, Any], runs: int, n: int) -> Tap:
    """Patch, in the rows of run ``k`` of ``runs`` folded runs of ``n`` samples, the selection of its site."""
    first = members[0][1]

    def replace(value: Any) -> Any:
        tensor = first.element_of(value)
        patched = tensor.clone()
        by_run = patched.view(runs, n, *tensor.shape[1:])
        for k, site in members:
            by_run[k][(slice(None), *as_indices(site.index))] = sources[site.key].to(tensor.dtype)
        return first.with_element(value, patched)

    return Tap(first.path, "intervene", replace, first.site, call=first.call)
