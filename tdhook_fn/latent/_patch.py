"""Activation patching: one patched run, or a sweep of many in one batched forward."""

# NOTE [patching sweeps]
# A sweep patches each site, one at a time, with its activation from the clean run and
# reads a metric. Hook libraries run one hooked forward per site in a Python loop. Here
# all runs of a chunk (``chunk_size`` runs, by default sized from their cost:
# NOTE [sweep chunks]) go through the model at once:
#
# - ``batching="vmap"`` (default): ``torch.func.vmap`` over one boolean mask per run and
#   module; the tap at a module takes the clean activation where the run's mask is set
#   (``torch.where``: the patched values are the clean ones exactly). Tensors are batched
#   over the runs only from the first patched module on, so everything before it (the
#   embeddings and the layers below, for a sweep ordered layer by layer) is computed once
#   for the whole chunk. The model must run under ``vmap``; torch's fused attention,
#   which has no batching rule, gets the runs folded into its batch
#   (NOTE [folded attention]).
# - ``batching="fold"``: the runs are folded into the batch (``chunk_size * N``
#   samples); at each module one tap copies the activation once and writes, into the rows
#   of each run patched there, that run's clean selection. Any model that takes a batch
#   takes it (every module runs for every run). The write into the copy is in place:
#   ``grad`` goes through it, ``vmap`` does not.
#
# Either way the result equals the loop of `patch` calls up to float rounding, and
# ``chunk_size`` bounds the memory to that of ``chunk_size`` forwards.

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from tensordict import TensorDict, TensorDictBase

from .._functional import Functional
from .._params import check_attribution_modes
from .._taps import Tap
from .._vjp import untransformed
from ._causal import CausalCut, causal_cut, check_agrees, share_before
from ._causal_chunks import causal_chunks
from ._chunks import FIXED_ROWS, RunSize, by_memory, chunked, run_size
from ._folded_attention import folded_attention
from ._kept_logits import kept_logits
from ._run import (
    Edits,
    Metric,
    Reads,
    Sources,
    check_alike,
    check_f,
    flat_sources,
    forward,
    metric_values,
    probe_shapes,
    resolve_runs,
)
from ._sites import Site, as_sites
from ._sweep_groups import Group, group, may_skip, selection, unchanged, whole_sites

Runner = Callable[[TensorDictBase, TensorDictBase, Sequence[Tap]], TensorDict]

__all__ = ["patch", "patching_sweep"]

Combine = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _replacer(caller: str, site: Site, sources: Sources, fn: Combine | None) -> Callable[[torch.Tensor], Any]:
    def replace(current: torch.Tensor) -> torch.Tensor:
        if fn is None:
            return sources.placed(caller, site, current)
        new = fn(current, sources[site.key])
        # a whole activation becomes the model's, which may write it in place: never the caller's tensor
        return new.clone() if not site.index else new

    return replace


def patch(
    f: Callable[[TensorDictBase, TensorDictBase], TensorDictBase],
    params: TensorDictBase,
    inputs: TensorDictBase,
    sites: Site | str | Sequence[Site | str],
    sources: TensorDictBase,
    *,
    fn: Combine | None = None,
    taps: Sequence[Tap] = (),
) -> TensorDict:
    """The outputs of ``f(params, inputs)`` with the activations at ``sites`` replaced.

    Args:
        f (Functional): pure function of a model.
        params (TensorDict): its parameters.
        inputs (TensorDict): any batch size ``[*B]``.
        sites (Site | str | Sequence): where to patch.
        sources (TensorDict): the new activations by site key, ``[*B, *selection]`` (as
            `cache` returns for the same sites, e.g. from a clean run), or without
            the batch dims to patch every sample alike.
        fn (Callable | None): ``fn(current, source) -> new`` instead of ``source``.
        taps (Sequence[Tap]): any further taps for the forward, attached after the method's own
            (which thus read and write the activations before them). Default: none.

    Returns:
        TensorDict: ``f``'s outputs, batch ``[*B]``.

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
        >>> clean, corrupt = (TensorDict(input=torch.randn(5, 3), batch_size=[5]) for _ in range(2))
        >>> from tdhook_fn.latent import cache
        >>> out = patch(f, p, corrupt, "[1]", cache(f, p, clean, "[1]"))
        >>> torch.allclose(out["output"], f(p, clean)["output"])
        True
    """
    f = check_f("patch", f, params, inputs)
    chosen = as_sites(sites, "patch")
    batch = inputs.batch_size
    given = flat_sources("patch", sources, chosen, batch, "sources")
    flat = inputs.reshape(-1)
    chosen = resolve_runs("patch", f, params, flat, chosen)
    edits = Edits("patch")
    editors = [edits.editor(site, _replacer("patch", site, given, fn)) for site in chosen]
    out = forward(f, params, flat, [*editors, *taps])
    edits.check(chosen)
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
    batching: Literal["vmap", "fold"] = "vmap",
    skip_unchanged: bool = True,
    causal: bool = False,
) -> torch.Tensor:
    """``metric`` of the corrupted run with each site, in turn, patched from the clean run.

    All runs of a chunk go through the model at once, not in a loop of forwards.

    Args:
        f (Functional): pure function of a model.
        params (TensorDict): its parameters.
        clean (TensorDict): the inputs the patched activations come from, ``[*B]``.
        corrupted (TensorDict): the inputs that run, same batch size. With
            ``batching="vmap"`` the same shape of activation at each site's module (prompts
            of one length: the runs patch through masks over the whole activation); with
            ``"fold"`` the same shape of each site's selection (the last position of prompts
            of other lengths, ``index=(-1,)``, is patched as ``patch`` does).
        sites (Site | str | Sequence): one patched run each, e.g. every layer x every
            token position: ``[Site(p, index=(t,)) for p in paths for t in range(L)]``.
        metric (Callable): ``outputs -> Tensor`` of one value per sample (the outputs'
            batch dims, whatever they are).
        chunk_size (int | None): runs per forward; bounds memory. Default: from the runs'
            cost and memory: enough runs to share the work before their
            first patch and each forward's fixed cost, within 1 GiB.
        batching (str): ``"vmap"`` maps the runs with ``torch.func.vmap`` over their
            patch masks: everything before a chunk's first patched module runs once,
            and each run equals its `patch` call up to float rounding (the
            model must run under ``vmap``; Hugging Face models do). ``"fold"`` folds the runs into the
            batch: any model that takes a batch, every module runs for every run.
            Default: ``"vmap"``.
        skip_unchanged (bool): give the runs whose clean selection equals the
            corrupted one (bit for bit, every sample) the corrupted run's metric, from
            one forward of the corrupted inputs, instead of running them; only outside transforms and without gradients.
            Default: ``True``.
        causal (bool): the model is a causal decoder (a Hugging Face one, with a key/value
            cache): a run patching position ``p`` first runs the positions ``[p:]`` only,
            the ones before from the corrupted run's cache (about
            half the work over a grid of every position). The claim is tested on one run
            (``RuntimeError`` if the model is not causal). Where the forward takes
            ``logits_to_keep``, the runs also compute the logits of the last positions
            ``metric`` reads only (found from its gradient, then tested: the metric must not
            change when the positions before change). Eager, ``batching="vmap"`` only.
            Default: ``False``.

    Returns:
        Tensor: ``[len(sites), *B]``, in the order of ``sites``.

    Examples:
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
    if batching not in ("vmap", "fold"):
        raise ValueError(f"patching_sweep: batching must be 'vmap' or 'fold', got {batching!r}")
    if not isinstance(skip_unchanged, bool):
        raise TypeError(f"patching_sweep: skip_unchanged must be a bool, got {type(skip_unchanged).__name__}")
    if not isinstance(causal, bool):
        raise TypeError(f"patching_sweep: causal must be a bool, got {type(causal).__name__}")
    if causal and batching != "vmap":
        raise ValueError("patching_sweep: causal=True runs its chunks under vmap; use batching='vmap'")
    if causal and not untransformed():
        raise NotImplementedError("patching_sweep: causal=True tests its claim on the data (an eager comparison), "
                                  "so it does not run under a functorch transform; pass causal=False there")
    # runs share one batch (fold) or one vmap: a batch norm on batch statistics would mix them
    check_attribution_modes(f.model, "patching_sweep", dropout="raise" if batching == "vmap" else "warn",
                            why=" (under vmap the runs cannot draw their own masks; batching='fold' can)")
    flat = corrupted.reshape(-1)
    chosen = resolve_runs("patching_sweep", f, params, flat, chosen)
    modules = whole_sites(chosen)
    wholes = list(modules.values())
    reads = Reads("patching_sweep", wholes)  # the clean run's activations, errors named as the sweep's
    forward(f, params, clean.reshape(-1), reads.taps())
    full = {whole.key: reads.get(whole) for whole in wholes}
    corrupted_shapes, out_bytes = probe_shapes("patching_sweep", f, params, flat, wholes)
    for site in chosen:
        whole = modules[group(site)]
        site.check_index(full[whole.key])
        clean_shape, corrupted_shape = full[whole.key].shape, corrupted_shapes[whole.key][0]
        if batching == "fold":  # each run patches the site's selection only: those must agree
            clean_shape = full[whole.key][selection(site)].shape
            corrupted_shape = torch.empty(corrupted_shape, device="meta")[selection(site)].shape
        check_alike("patching_sweep", site, clean_shape, corrupted_shape,  # vmap's masks span the whole activation
                    "" if batching == "fold" else "; or batching='fold', which patches only each site's selection")
    todo, values, corrupted_out = list(range(len(chosen))), None, None
    if skip_unchanged and may_skip(params, clean, corrupted):  # NOTE [unchanged sites]
        todo, values, corrupted_out = unchanged(f, params, corrupted, chosen, modules, full, metric, batch)
    runs = [chosen[k] for k in todo]
    size = run_size(corrupted_shapes.values(), out_bytes)
    if causal and runs:
        done = _causal_runs(f, params, flat, runs, modules, full, metric, batch, size, chunk_size)
    else:
        chunks = chunked(f.model, runs, size, chunk_size, share=batching == "vmap")  # NOTE [sweep chunks]
        if batching == "fold":
            sources = {site.key: full[modules[group(site)].key][selection(site)] for site in runs}
            parts = [_folded(f, params, flat, [runs[k] for k in chunk], sources, metric, batch) for chunk in chunks]
        else:
            runner = (kept_logits(f, params, flat, _reader(metric, batch), corrupted_out)
                      if runs and may_skip(params, clean, corrupted) else None)
            parts = [_mapped(f, params, flat, [runs[k] for k in chunk], modules, full, _reader(metric, batch),
                             runner=runner)
                     for chunk in chunks]
        done = _in_order(parts, [k for chunk in chunks for k in chunk])
    if values is None:
        return done
    if runs:
        values[todo] = done.to(values.dtype)
    return values


def _in_order(parts: Sequence[torch.Tensor], order: Sequence[int]) -> torch.Tensor:
    """The chunks' values, which hold the runs ``order``, in the runs' order."""
    if not parts:
        return torch.empty(0)
    values = torch.cat(list(parts))
    if list(order) == sorted(order):
        return values
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return values[inverse.to(values.device)]


def _mapped(f: Functional, params: TensorDictBase, flat: TensorDictBase, runs: Sequence[Site],
            modules: dict[Group, Site], full: dict[str, Any], read: Callable[[TensorDictBase], Any],
            cut: CausalCut | None = None, start: int = 0, runner: Runner | None = None) -> Any:
    """One chunk under ``vmap`` over per-run masks: run ``k`` takes the clean values where its mask is set.

    ``read`` makes a run's result of its outputs. With ``start`` the runs cover the
    positions ``[start:]`` only, by ``cut`` (NOTE [causal sweeps]); ``runner`` runs the
    forward otherwise (NOTE [positions the metric reads]).
    """
    run_forward: Runner = runner or (lambda p, td, taps: forward(f, p, td, taps))
    if cut is not None:
        flat, run_forward = cut.inputs(flat, start), cut.run(start)
        full = {m.key: full[m.key][:, start:] for m in modules.values()}
        runs = [cut.shifted(site, start) for site in runs]
    masks: dict[str, torch.Tensor] = {}
    for k, site in enumerate(runs):
        whole = modules[group(site)]
        clean = full[whole.key]
        if whole.key not in masks:
            depth = max(len(s.index) for s in runs if group(s) == group(site))
            shape = [clean.shape[d + 1] if d < depth else 1 for d in range(clean.dim() - 1)]
            masks[whole.key] = torch.zeros(len(runs), 1, *shape, dtype=torch.bool, device=clean.device)
        masks[whole.key][k][selection(site)] = True
    chunk_modules = [m for m in modules.values() if m.key in masks]

    def one_run(mask: dict[str, torch.Tensor]) -> Any:
        taps = [m.editor(_where(mask[m.key], full[m.key])) for m in chunk_modules]
        return read(run_forward(params, flat, taps))

    with folded_attention():  # NOTE [folded attention]
        return torch.func.vmap(one_run)(masks)


def _causal_runs(f: Functional, params: TensorDictBase, flat: TensorDictBase, runs: Sequence[Site],
                 modules: dict[Group, Site], full: dict[str, Any], metric: Metric, batch: torch.Size,
                 size: RunSize, cap: int | None) -> torch.Tensor:
    """Each run's metric (in order), a run cut to the positions from its first patch on (NOTE [causal sweeps])."""
    cut = causal_cut(f, params, flat)
    starts = [cut.start(site, full[modules[group(site)].key]) for site in runs]
    last = max(range(len(runs)), key=starts.__getitem__)
    if starts[last]:  # the claim that the model is causal, tested on the run that leans on it most
        whole = _mapped(f, params, flat, [runs[last]], modules, full, _outputs)
        check_agrees(_mapped(f, params, flat, [runs[last]], modules, full, _outputs, cut, starts[last]), whole,
                     runs[last])
    cut.read_by(_reader(metric, batch))  # after the check, which compares every position
    values: list[torch.Tensor] = [torch.empty(0)] * len(runs)
    by_module: dict[Group, list[int]] = {}
    for k, site in enumerate(runs):
        by_module.setdefault(group(site), []).append(k)
    shares = {key: share_before(f.model, runs[members[0]]) for key, members in by_module.items()}
    order = sorted(by_module, key=shares.__getitem__)  # the modules in the order of the forward
    most = min(by_memory(size), cap or len(runs))
    plan = causal_chunks([by_module[key] for key in order], [shares[key] for key in order], starts, cut.length,
                         FIXED_ROWS / flat.batch_size[0], most)
    for chunk in plan:
        part = _mapped(f, params, flat, [runs[k] for k in chunk], modules, full, _reader(metric, batch), cut,
                       starts[chunk[0]])
        for k, value in zip(chunk, part, strict=True):
            values[k] = value
    return torch.stack(values)


def _reader(metric: Metric, batch: torch.Size) -> Callable[[TensorDictBase], torch.Tensor]:
    """A run's metric values of its outputs."""
    return lambda out: metric_values("patching_sweep", metric, out, batch)


def _outputs(out: TensorDictBase) -> TensorDictBase:
    """A run's outputs as they are (to compare two ways of running it)."""
    return out


def _where(mask: torch.Tensor, clean: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda current: torch.where(mask, clean.to(current.dtype), current)


def _folded(f: Functional, params: TensorDictBase, flat: TensorDictBase, runs: Sequence[Site],
            sources: dict[str, Any], metric: Metric, batch: torch.Size) -> torch.Tensor:
    """One chunk with its runs folded into the batch (``runs * N`` samples)."""
    n = flat.batch_size[0]
    groups: dict[Group, list[tuple[int, Site]]] = {}
    for k, site in enumerate(runs):  # one tap per module: all its runs in one write
        groups.setdefault(group(site), []).append((k, site))
    taps = [_runs_tap(members, sources, len(runs), n) for members in groups.values()]
    out = forward(f, params, flat.expand(len(runs), n).reshape(-1), taps)
    return metric_values("patching_sweep", metric, out, (len(runs), *batch))


def _runs_tap(members: list[tuple[int, Site]], sources: dict[str, Any], runs: int, n: int) -> Tap:
    """Patch, in the rows of run ``k`` of ``runs`` folded runs of ``n`` samples, the selection of its site."""
    first = members[0][1]

    def replace(value: Any) -> Any:
        tensor = first.element_of(value)
        patched = tensor.clone()
        by_run = patched.view(runs, n, *tensor.shape[1:])
        for k, site in members:
            by_run[k][selection(site)] = sources[site.key].to(tensor.dtype)
        return first.with_element(value, patched)

    return Tap(first.path, "intervene", replace, first.site, call=first.call)
