"""Attribution patching: every patching effect at once, to first order."""

# NOTE [attribution patching]
# Patching site ``s`` changes its activation from ``a_corrupted`` to ``a_clean``; to first
# order the metric changes by ``(a_clean - a_corrupted) . d metric / d a`` at the
# corrupted run (Nanda 2023; Kramar et al. 2024, "AtP"). All sites need one forward on the
# clean inputs (their activations) and one forward and one backward on the corrupted
# ones: the gradient with respect to an additive zero perturbation of each site's
# selection (NOTE [layer gradients]), all in one ``torch.func.vjp``. The estimate is
# exact where the metric is linear in the patched activation. Compare it with
# ``patching_sweep(...) - metric(corrupted)``.

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from tensordict import TensorDictBase

from .._targets import autograd_off_note
from .._vjp import vjp
from ._cache import cache
from ._run import (
    Metric,
    Reads,
    activation_shapes,
    check_alike,
    check_f,
    check_float,
    flat_sources,
    forward,
    metric_values,
    resolve_runs,
)
from ._sites import Site, as_sites

__all__ = ["attribution_patching"]


def attribution_patching(
    f: Callable[[TensorDictBase, TensorDictBase], TensorDictBase],
    params: TensorDictBase,
    clean: TensorDictBase,
    corrupted: TensorDictBase,
    sites: Site | str | Sequence[Site | str],
    metric: Metric,
) -> torch.Tensor:
    """First-order estimates of the patching effects at ``sites`` (attribution patching).

    Each site's estimate sums ``(a_clean - a_corrupted) * d metric / d a`` over its
    selection: for ``Site(path, index=(t,))`` on a ``[N, L, D]`` residual stream, over the
    ``D`` features of token ``t``.

    Args:
        f (Functional): pure function of a model.
        params (TensorDict): its parameters (constants here).
        clean (TensorDict): inputs the patched activations come from, ``[*B]``.
        corrupted (TensorDict): the inputs that run, same batch size and the same shape of each
            site's selection (prompts of one length: a clean run would otherwise broadcast).
        sites (Site | str | Sequence): the sites, as for `patching_sweep`.
        metric (Callable): ``outputs -> Tensor`` of one value per sample.

    Returns:
        Tensor: ``[len(sites), *B]``: the estimated change of the metric.

    Raises:
        TypeError: a site's activation is not float (token ids: take the embedding's output).
        ValueError: the clean and corrupted selections differ in shape; the metric has no
            gradient (an argmax, a comparison, ``.detach()``, or any metric under
            ``torch.inference_mode()``), which would make every estimate 0.

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> from tdhook_fn.latent import patching_sweep
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
        >>> clean, corrupt = (TensorDict(input=torch.randn(5, 3), batch_size=[5]) for _ in range(2))
        >>> logit = lambda out: out["output"][..., 0]
        >>> sites = [Site("[1]", index=(i,)) for i in range(4)]  # the head is linear in [1]: exact
        >>> est = attribution_patching(f, p, clean, corrupt, sites, logit)
        >>> exact = patching_sweep(f, p, clean, corrupt, sites, logit) - logit(f(p, corrupt))
        >>> torch.allclose(est, exact, atol=1e-6)
        True
    """
    f = check_f("attribution_patching", f, params, corrupted)
    chosen = as_sites(sites, "attribution_patching")
    batch = corrupted.batch_size
    if clean.batch_size != batch:
        raise ValueError(f"attribution_patching: clean has batch {list(clean.batch_size)}, corrupted {list(batch)}")
    targets = flat_sources("attribution_patching", cache(f, params, clean, chosen, detach=True), chosen, batch,
                           "clean activations")
    flat = corrupted.reshape(-1)
    chosen = resolve_runs("attribution_patching", f, params, flat, chosen)
    shapes = activation_shapes("attribution_patching", f, params, flat, chosen)
    for site in chosen:
        shape, dtype = shapes[site.key]
        check_float("attribution_patching", site, dtype, "attribution patching takes the gradient with respect to it")
        check_alike("attribution_patching", site, targets[site.key].shape, shape)
    zeros = {key: torch.zeros(shape, dtype=dtype, device=targets[key].device) for key, (shape, dtype) in shapes.items()}

    def run(deltas: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        reads = Reads("attribution_patching", chosen)
        taps = [site.editor(_add(deltas[site.key])) for site in chosen]
        out = forward(f, params, flat, [*taps, *reads.taps()])
        seen = {site.key: reads.get(site) for site in chosen}  # read after the (zero) edit
        values = metric_values("attribution_patching", metric, out, batch)
        _check_differentiable(values)
        return values.reshape(-1), seen

    values, pullback, seen = cast(Any, vjp(run, zeros, constants=(params, flat)))
    (grads,) = pullback(torch.ones_like(values))
    estimates = []
    for site in chosen:
        term = (targets[site.key] - seen[site.key].detach()) * grads[site.key]
        estimates.append(term.reshape(term.shape[0], -1).sum(1))
    return torch.stack(estimates).reshape(len(chosen), *batch)


def _check_differentiable(values: torch.Tensor) -> None:
    """The metric must have a gradient: without one every estimate is 0, silently (as a target in saliency)."""
    if values.is_floating_point() and values.requires_grad:
        return
    raise ValueError(f"attribution_patching: the metric does not depend differentiably on the sites' activations "
                     f"(it returned {values.dtype} values without a gradient: an argmax, a comparison or .detach() "
                     "has none), so every estimate would be 0; give a differentiable metric, such as a logit or a "
                     f"logit difference{autograd_off_note()}")


def _add(delta: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda act: act + delta
