"""Steering: adding vectors to activations, and the vectors from contrasting examples."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from .._params import check_attribution_modes
from .._taps import Tap
from ._cache import cache
from ._run import Edits, Sources, check_f, check_float, flat_sources, forward, resolve_runs
from ._sites import Site, as_sites

__all__ = ["activation_addition", "steer"]


def steer(
    f: Callable[[TensorDictBase, TensorDictBase], TensorDictBase],
    params: TensorDictBase,
    inputs: TensorDictBase,
    sites: Site | str | Sequence[Site | str],
    vectors: TensorDictBase,
    *,
    alpha: float | torch.Tensor = 1.0,
) -> TensorDict:
    """The outputs of ``f`` with ``alpha * vectors[site]`` added at each site.

    Args:
        f (Functional): pure function of a model.
        params (TensorDict): its parameters.
        inputs (TensorDict): any batch size ``[*B]``.
        sites (Site | str | Sequence): where to add.
        vectors (TensorDict): by site key, shaped like one sample's selection (added to
            every sample, e.g. from `activation_addition`) or ``[*B, *selection]``.
        alpha (float | Tensor): the scale; a 1-d tensor of ``A`` scales gives ``A`` steered
            runs in one batched forward. Default: 1.0.

    Returns:
        TensorDict: ``f``'s outputs, batch ``[*B]``, or ``[A, *B]`` for ``A`` alphas.

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
        >>> x = TensorDict(input=torch.randn(5, 3), batch_size=[5])
        >>> v = TensorDict({"0": torch.ones(4)})
        >>> steer(f, p, x, "[0]", v, alpha=torch.tensor([0.0, 1.0, 2.0]))["output"].shape
        torch.Size([3, 5, 2])
    """
    f = check_f("steer", f, params, inputs)
    chosen = as_sites(sites, "steer")
    batch = inputs.batch_size
    vecs = flat_sources("steer", vectors, chosen, batch, "vectors")
    scales = torch.as_tensor(alpha)
    if scales.dim() > 1 or (scales.dim() == 1 and len(scales) == 0):
        raise ValueError(f"steer: alpha must be a number or a 1-d tensor of scales, got shape {tuple(scales.shape)}")
    flat = inputs.reshape(-1)
    chosen = resolve_runs("steer", f, params, flat, chosen)
    n = flat.batch_size[0]
    edits = Edits("steer")
    if scales.dim() == 0:
        out = forward(f, params, flat, [edits.editor(site, _plus(alpha, vecs, site)) for site in chosen])
        edits.check(chosen)
        return out.reshape(batch)
    runs = len(scales)
    check_attribution_modes(f.model, "steer with several alphas")  # the runs share one batch

    def scaled(site: Site) -> Callable[[torch.Tensor], torch.Tensor]:
        def add(act: torch.Tensor) -> torch.Tensor:
            check_float("steer", site, act.dtype, _ADDS)
            per_row = scales.to(act.dtype).repeat_interleave(n).reshape(-1, *[1] * (act.dim() - 1))
            v = vecs.aligned(site, act[:n]).to(act.dtype)
            tiled = v.repeat(runs, *[1] * (v.dim() - 1)) if site.key in vecs.per_sample else v
            return act + per_row * tiled
        return add

    out = forward(f, params, flat.expand(runs, n).reshape(-1), [edits.editor(site, scaled(site)) for site in chosen])
    edits.check(chosen)
    return out.reshape(runs, *batch)


_ADDS = "steering adds a vector to it"


def _plus(alpha: float | torch.Tensor, vecs: Sources, site: Site) -> Callable[[torch.Tensor], torch.Tensor]:
    def add(act: torch.Tensor) -> torch.Tensor:
        check_float("steer", site, act.dtype, _ADDS)
        return act + alpha * vecs.aligned(site, act).to(act.dtype)

    return add


def activation_addition(
    f: Callable[[TensorDictBase, TensorDictBase], TensorDictBase],
    params: TensorDictBase,
    positive: TensorDictBase,
    negative: TensorDictBase,
    sites: Site | str | Sequence[Site | str],
    *,
    taps: Sequence[Tap] = (),
) -> TensorDict:
    """Steering vectors: the mean over samples of ``act(positive) - act(negative)`` at each site.

    As tdhook's ``ActivationAddition``. ``positive`` and ``negative`` need the same batch
    size (pairs of examples).

    Args:
        f (Functional | Callable): pure ``f(params, td) -> td``.
        params (TensorDict): parameters for ``f``.
        positive (TensorDict): the examples towards which to steer, batch ``[N]``.
        negative (TensorDict): the examples they are contrasted with, batch ``[N]``.
        sites (Site | str | Sequence): where the activations are read.
        taps (Sequence[Tap]): any further taps for the forward, attached after the method's own
            (which thus read and write the activations before them). Default: none.

    Returns:
        TensorDict: by site key, shaped like one sample's selection (batch ``[]``).

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
        >>> pos, neg = (TensorDict(input=torch.randn(5, 3), batch_size=[5]) for _ in range(2))
        >>> activation_addition(f, p, pos, neg, "[1]")["1"].shape
        torch.Size([4])
    """
    chosen = as_sites(sites, "activation_addition")
    if positive.batch_size != negative.batch_size:
        raise ValueError(f"activation_addition: positive has batch {list(positive.batch_size)}, negative "
                         f"{list(negative.batch_size)}; give pairs of examples")
    pos, neg = cache(f, params, positive, chosen, taps=taps), cache(f, params, negative, chosen, taps=taps)
    for site in chosen:
        check_float("activation_addition", site, pos.get(site.key).dtype, "a steering vector is added to it")
    dims = tuple(range(len(positive.batch_size)))

    def mean(diff: torch.Tensor) -> torch.Tensor:
        return diff.mean(dim=dims) if dims else diff  # (mean over dim=() would average everything)

    return TensorDict({s.key: mean(pos.get(s.key) - neg.get(s.key)) for s in chosen}, batch_size=[])
