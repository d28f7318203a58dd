"""One forward of ``f`` with site taps, on a batch flattened to one dim (as the attribution engine)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from .._functional import Functional, with_copied_inputs
from .._params import check_attribution_modes
from .._probe import on_meta
from .._taps import Tap
from ._sites import Site

__all__ = [
    "Edits",
    "Metric",
    "Reads",
    "Sources",
    "activation_shapes",
    "check_alike",
    "check_f",
    "check_float",
    "flat_sources",
    "forward",
    "metric_values",
    "probe_shapes",
    "resolve_runs",
    "unflatten",
]

Metric = Callable[[TensorDictBase], torch.Tensor]


def check_f(caller: str, f: Any, params: Any, inputs: Any) -> Functional:
    """``f`` must be a `tdhook_fn.Functional` (sites are taps) and the data TensorDicts."""
    if isinstance(f, nn.Module):
        raise TypeError(f"{caller}: f is the module {type(f).__name__}; pass tdhook_fn.functional(model)")
    if not isinstance(f, Functional):
        raise TypeError(f"{caller}: f must be a tdhook_fn.Functional (its sites are taps), got {type(f).__name__}")
    if not isinstance(params, TensorDictBase):
        raise TypeError(f"{caller}: params must be a TensorDict (tdhook_fn.params(model)), got {type(params).__name__}")
    if not isinstance(inputs, TensorDictBase):
        raise TypeError(f"{caller}: inputs must be a TensorDict, got {type(inputs).__name__}; wrap a batch x as "
                        "TensorDict(input=x, batch_size=[len(x)])")
    check_attribution_modes(f.model, caller, batch_norms=False)  # the user's batch runs: only dropout warns
    return f


class Reads:
    """The activations read at sites during one forward, by site key, with their run counts."""

    def __init__(self, caller: str, sites: Sequence[Site]):
        self.caller = caller
        self.sites = list(sites)
        self.values: dict[str, list[torch.Tensor]] = {s.key: [] for s in sites}

    def taps(self) -> list[Tap]:
        return [s.reader(self.values[s.key].append) for s in self.sites]

    def get(self, site: Site) -> torch.Tensor:
        """The one value read at ``site``; an error when it ran never or, without ``call``, twice."""
        runs = self.values[site.key]
        if runs and site.call is not None and site.call < 0:
            if -site.call > len(runs):
                raise ValueError(f"{self.caller}: site {site.key!r} has call={site.call} but ran {len(runs)} times")
            return runs[site.call]
        _refuse_runs(self.caller, site, len(runs))
        return runs[0]

    def clear(self) -> None:
        for runs in self.values.values():
            runs.clear()

    def counts(self) -> dict[str, int]:
        return {key: len(runs) for key, runs in self.values.items()}


def resolve_runs(caller: str, f: Functional, params: TensorDictBase, flat: TensorDictBase,
                 sites: Sequence[Site]) -> list[Site]:
    """``sites`` with a negative ``call`` counted from the first run, from a probe forward (meta tensors)."""
    negative = [s for s in sites if s.call is not None and s.call < 0]
    if not negative:
        return list(sites)
    reads = Reads(caller, [Site(s.path, element=s.element, site=s.site, key=s.key) for s in negative])
    on_meta(lambda p, td: forward(f, p, td, reads.taps()), params, flat, reset=reads.clear)
    counts = reads.counts()
    out = []
    for site in sites:
        if site.call is not None and site.call < 0:
            runs = counts[site.key]
            if not -runs <= site.call:
                raise ValueError(f"{caller}: site {site.key!r} has call={site.call} but ran {runs} times")
            site = dataclasses.replace(site, call=runs + site.call)
        out.append(site)
    return out


def activation_shapes(caller: str, f: Functional, params: TensorDictBase, flat: TensorDictBase,
                      sites: Sequence[Site]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Shape and dtype of each site's selection on the inputs ``flat``, from a forward on meta tensors (no compute)."""
    return probe_shapes(caller, f, params, flat, sites)[0]


def probe_shapes(caller: str, f: Functional, params: TensorDictBase, flat: TensorDictBase,
                 sites: Sequence[Site]) -> tuple[dict[str, tuple[torch.Size, torch.dtype]], int]:
    """`activation_shapes`, and the bytes of ``f``'s outputs on ``flat``, from the same meta forward."""
    reads = Reads(caller, sites)
    out = on_meta(lambda p, td: forward(f, p, td, reads.taps()), params, flat, reset=reads.clear)
    out_bytes = sum(t.numel() * t.element_size() for t in out.values(True, True) if isinstance(t, torch.Tensor))
    return {s.key: (reads.get(s).shape, reads.get(s).dtype) for s in sites}, out_bytes


def check_alike(caller: str, site: Site, clean: torch.Size, corrupted: torch.Size, also: str = "") -> None:
    """Raise unless the clean and the corrupted inputs give activations of one shape at ``site``.

    Else a patch would broadcast: a clean run of one position would go to every corrupted one.
    """
    if clean != corrupted:
        raise ValueError(f"{caller}: at site {site.key!r} the clean inputs give an activation of shape "
                         f"{tuple(clean)}, the corrupted inputs {tuple(corrupted)} (batch flattened); patching "
                         "needs them of one shape: give clean and corrupted inputs of one length (pad the shorter "
                         f"prompts, with an attention mask){also}")


def check_float(caller: str, site: Site, dtype: torch.dtype, needs: str) -> None:
    """Raise ``TypeError`` naming ``site`` unless its activation is float (not token ids): ``caller`` ``needs`` it."""
    if dtype.is_floating_point or dtype.is_complex:
        return
    kind = "boolean" if dtype == torch.bool else "integer"
    instead = (f"the output of the module it feeds, e.g. Site({site.path!r}) (an embedding's output)"
               if site.site == "input" else "the output of a later module, where the activation is float")
    raise TypeError(f"{caller}: site {site.key!r} holds an {kind} activation ({dtype}, e.g. token ids); {needs}, "
                    f"so it needs a float activation: use {instead}")


def forward(f: Functional, params: TensorDictBase, flat: TensorDictBase, taps: Sequence[Tap]) -> TensorDict:
    """``f`` with ``taps`` on inputs whose batch is one dim (copies: the model may write them in place)."""
    return f.with_taps(*taps)(params, with_copied_inputs(flat))


def unflatten(t: torch.Tensor, batch: torch.Size, lead: int = 0) -> torch.Tensor:
    """Restore batch dims flattened to one (after ``lead`` leading dims)."""
    return t.reshape((*t.shape[:lead], *batch, *t.shape[lead + 1 :]))  # a tuple: the shape may be ()


class Sources(dict[str, Any]):
    """Per-site tensors by site key; ``per_sample`` holds the keys whose first dim is the flattened batch."""

    def __init__(self) -> None:
        super().__init__()
        self.per_sample: set[str] = set()

    def aligned(self, site: Site, current: torch.Tensor) -> torch.Tensor:
        """The source of ``site`` with, if per-sample, ones inserted after its batch dim up to ``current``'s rank."""
        source: torch.Tensor = self[site.key]
        if site.key in self.per_sample and source.dim() < current.dim():
            source = source.reshape(source.shape[0], *[1] * (current.dim() - source.dim()), *source.shape[1:])
        return source

    def placed(self, caller: str, site: Site, current: torch.Tensor) -> torch.Tensor:
        """The source of ``site`` broadcast to the activation ``current`` (``[N, *selection]``), a new tensor.

        A per-sample source ``[N, *s]`` meets ``current`` batch dim first, then ``s``
        right-aligned to the selection (``[N, D]`` at every position of ``[N, L, D]``); a
        shared one is right-aligned as a whole. Never a view of the caller's tensor: the
        model may write the activation in place.
        """
        source = self.aligned(site, current)
        if source.dim() > current.dim() or any(
                a not in (1, b) for a, b in zip(reversed(source.shape), reversed(current.shape), strict=False)):
            raise ValueError(f"{caller}: the source for site {site.key!r} has shape {tuple(self[site.key].shape)}, "
                             f"the activation there {tuple(current.shape)} (batch flattened)")
        return source.to(current.dtype).expand_as(current).clone()


def flat_sources(caller: str, sources: Any, sites: Sequence[Site], batch: torch.Size, what: str) -> Sources:
    """Per-site tensors from a TensorDict keyed by site key, with the batch flattened to one dim.

    A tensor with exactly the batch dims ``[*B, ...]`` (in a TensorDict of that batch
    size) is flattened to ``[N, ...]``; one without them (a steering vector for every
    sample) is kept and broadcasts.
    """
    if not isinstance(sources, TensorDictBase):
        raise TypeError(f"{caller}: {what} must be a TensorDict keyed by site key (as cache returns), got "
                        f"{type(sources).__name__}")
    out = Sources()
    for site in sites:
        value = sources.get(site.key, None)
        if value is None:
            raise KeyError(f"{caller}: {what} have no entry for site {site.key!r} (keys: {list(sources.keys())})")
        if isinstance(value, torch.Tensor) and value.shape[: len(batch)] == batch and sources.batch_size == batch:
            value = value.reshape(-1, *value.shape[len(batch):]) if batch else value.unsqueeze(0)
            out.per_sample.add(site.key)
        out[site.key] = value
    return out


class Edits:
    """Edits at sites that count their runs: each must run exactly once per forward (as `Reads`)."""

    def __init__(self, caller: str):
        self.caller = caller
        self.runs: dict[str, int] = {}

    def editor(self, site: Site, new: Callable[[torch.Tensor], torch.Tensor]) -> Tap:
        self.runs[site.key] = 0

        def counted(current: torch.Tensor) -> torch.Tensor:
            self.runs[site.key] += 1
            return new(current)

        return site.editor(counted)

    def check(self, sites: Sequence[Site]) -> None:
        """Raise for a site whose edit never ran (or not at its ``call``), or ran more than once."""
        for site in sites:
            _refuse_runs(self.caller, site, self.runs[site.key])


def _refuse_runs(caller: str, site: Site, runs: int) -> None:
    """Raise unless a site's tap fired once in the forward: never (or not at its ``call``), or more often."""
    if runs == 0:
        at = "" if site.call is None else f" (call={site.call}: the module ran fewer times)"
        raise ValueError(f"{caller}: site {site.key!r} never ran in the forward{at}")
    if runs > 1:
        raise ValueError(f"{caller}: site {site.key!r} ran {runs} times in one forward; pick one run with "
                         "Site(..., call=k) (-1 for the last)")


def metric_values(caller: str, metric: Metric, out: TensorDictBase, shape: Sequence[int]) -> torch.Tensor:
    """``metric`` of the outputs reshaped to ``shape`` (runs and samples): one value for each."""
    shape = torch.Size(shape)
    value = metric(out.reshape(shape))
    if not isinstance(value, torch.Tensor) or value.shape != shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{caller}: metric must return one value per sample (a tensor shaped like the outputs' "
                         f"batch, {tuple(shape)}), got {got}")
    return value
