"""GradientSHAP (Lundberg and Lee 2017): gradients at random points between random baselines and noisy inputs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from .._functional import fresh_tensordict
from .._targets import Target
from .._types import NestedKey, PureFn
from .._vjp import untransformed
from ._baselines import attributed_keys, both_ends
from ._convergence import delta_of
from ._engine import gradients, scaled
from ._flat_copies import flat_copies, flat_target
from ._inputs import accepts_tensors, check_call
from ._metric_samples import check_count, chunks, repeated, repeated_target
from ._noise import Stdevs, check_noisable, entry, fold_copies, mean_maps, noise_draws, stdevs_by_key
from ._target_values import target_values

__all__ = ["gradient_shap"]



@accepts_tensors
def gradient_shap(
    f: PureFn,
    params: TensorDictBase,
    inputs: TensorDictBase,
    baselines: TensorDictBase | torch.Tensor,
    *,
    target: Target,
    n_samples: int = 5,
    stdevs: Stdevs = 0.0,
    multiply_by_inputs: bool = True,
    per_target: bool = False,
    chunk_size: int | None = None,
    input_keys: NestedKey | Sequence[NestedKey] | None = None,
    generator: torch.Generator | None = None,
    draws: TensorDictBase | None = None,
    return_convergence_delta: bool = False,
) -> TensorDict | tuple[TensorDict, torch.Tensor]:
    """Expected gradients x (input - baseline) over random baselines and random points of the path.

    For each of ``n_samples`` draws per sample: a baseline ``b`` picked uniformly from the
    reference samples ``baselines``, Gaussian noise ``e`` (``stdevs``), and ``a ~ U(0, 1)``;
    the gradient at ``a * (x + e) + (1 - a) * b`` is multiplied by ``x + e - b`` and
    the products are averaged (captum's ``GradientShap``). All draws of a chunk go through
    one forward and one VJP. On average the maps of a sample sum to
    ``F(x) - E_b F(b)`` (exactly per draw for a linear model).

    The draws: by default everything is drawn from ``generator`` (torch's global one if
    ``None``), chunk by chunk: the baseline indices, then the noise of each key (as
    `smoothgrad` draws it; skipped where ``stdevs`` is 0), then the path points. captum
    draws the indices and path points from numpy's global generator and the noise from
    torch's; its runs are replayed by passing those numbers as ``draws``: a TensorDict of
    batch ``[*B, n_samples]`` holding ``"index"`` (the baseline of each draw, a long
    tensor; or a TensorDict of one per key, since captum picks each input's baselines
    independently), ``"alpha"`` (the path point ``a``) and optionally ``"noise"`` (the
    noise, keyed like the inputs; absent means none).

    Args:
        f (Functional | Callable): pure ``f(params, td) -> td``.
        params (TensorDict): parameters for ``f`` (constants here).
        inputs (TensorDict | Tensor): inputs with any batch size ``[*B]``; or a tensor,
            batch first (the result is then a tensor; see `saliency`).
        baselines (TensorDict | Tensor): the reference samples, batch ``[R]`` (one dim),
            holding every attributed key with one sample's shape after it; a tensor
            ``[R, ...]`` for the one attributed input.
        target (int | tuple[int, ...] | Tensor | Callable): see `tdhook_fn.as_target`.
        n_samples (int): draws per sample. Default: 5, as captum.
        stdevs (float | Sequence[float] | Mapping): standard deviation of the noise on the
            inputs, one for all, per key in order, or a mapping. Default: 0.0, as captum.
        multiply_by_inputs (bool): multiply by ``x + e - b``; ``False`` gives the averaged
            gradients. Default: ``True``.
        per_target (bool): one map per target along a new leading dim ``T``. Default: ``False``.
        chunk_size (int | None): draws of each sample per forward; bounds memory. Default:
            all ``n_samples`` in one.
        input_keys (Sequence | None): the attributed inputs. Default: ``f.in_keys``.
        generator (torch.Generator | None): the random generator drawn from. Default: torch's
            global one.
        draws (TensorDict | None): the draws themselves, batch ``[*B, n_samples]`` (see above).
            Default: ``None``, drawn from ``generator``.
        return_convergence_delta (bool): also return, for every draw, the sum of its map
            minus the change of the target from its baseline to its (noisy) input, shaped
            ``[*B, n_samples]`` (``[T, *B, n_samples]`` with ``per_target``); captum's delta,
            flattened there to ``[N * n_samples]``. One more forward (no backward) of both
            ends. Default: ``False``.

    Returns:
        TensorDict | tuple[TensorDict, Tensor]: keyed like the attributed inputs, batch
        ``[*B]`` or ``[T, *B]`` (a tensor for a tensor ``inputs``); with the deltas.

    Raises:
        KeyError: the baselines or the draws miss an attributed key.
        ValueError: baselines without a batch dim of reference samples or with another
            sample shape; draws of another batch size; a count that is not a positive int.

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
        >>> x = TensorDict(input=torch.randn(5, 3), batch_size=[5])
        >>> refs = TensorDict(input=torch.randn(20, 3), batch_size=[20])
        >>> g = torch.Generator().manual_seed(0)
        >>> gradient_shap(f, p, x, refs, target=1, n_samples=50, generator=g)["input"].shape
        torch.Size([5, 3])
    """
    check_count("gradient_shap", "n_samples", n_samples)
    check_count("gradient_shap", "chunk_size", chunk_size, optional=True)
    check_call("gradient_shap", f, params, inputs, target=target)
    keys = attributed_keys("gradient_shap", f, inputs, input_keys)
    check_noisable("gradient_shap", inputs, keys)
    refs = _references(inputs, baselines, keys)
    sigma = {k: s for k, s in stdevs_by_key("gradient_shap", stdevs, keys).items() if s > 0}
    if draws is not None:
        _check_draws(inputs, draws, keys, refs.batch_size[0], n_samples)
    batch = inputs.batch_size
    total: dict[NestedKey, torch.Tensor] | None = None
    lead: list[int] = []
    deltas = []
    start = 0
    for k in chunks(n_samples, chunk_size):
        drawn = (_draw(inputs, keys, refs.batch_size[0], sigma, k, generator) if draws is None
                 else draws[(..., slice(start, start + k))])
        start += k
        ends, starts, changes, points = _path(inputs, refs, keys, drawn, k, return_convergence_delta)
        # the maps are [*T, N * k] (NOTE [flat copies])
        grads = gradients(f, params, flat_copies(inputs, k, points), flat_target(target, batch, k), input_keys=keys,
                          per_target=per_target, caller="gradient_shap", checked=True).grads
        lead = list(grads.batch_size[:-1])  # [T] with per_target
        if not return_convergence_delta:  # multiplied by x + e - b (the copies' own difference) as they are summed
            total = fold_copies(total, grads, batch, k, flat=True, factors=changes if multiply_by_inputs else None)
            continue
        if multiply_by_inputs:  # by x + e - b, the copies' own difference
            grads = scaled(grads, {key: _flat(changes[key], len(batch)) for key in keys})
        total = fold_copies(total, grads, batch, k, flat=True)
        if return_convergence_delta:
            copies = repeated(inputs, k)
            for key in keys:
                copies.set(key, ends[key].expand(starts[key].shape))
            values = target_values(f, params, both_ends(copies, TensorDict(starts, batch_size=copies.batch_size)),
                                   repeated_target(target, batch, k))
            per_draw = TensorDict({key: value.reshape(*lead, *batch, k, *value.shape[grads.batch_dims:])
                                   for key, value in grads.items(True, True)}, batch_size=[*lead, *batch, k])
            deltas.append(delta_of(values, copies.batch_size, per_draw, per_target, None))
    assert total is not None
    attrs = mean_maps(total, None, n_samples, "smoothgrad", [*lead, *batch])
    return (attrs, torch.cat(deltas, -1)) if return_convergence_delta else attrs


_Paths = dict[NestedKey, torch.Tensor]


def _path(inputs: TensorDictBase, refs: TensorDictBase, keys: Sequence[NestedKey], drawn: Any, k: int,
          keep_starts: bool) -> tuple[_Paths, _Paths, _Paths, _Paths]:
    """By key: the chunk's (noisy) inputs ``[*B, k or 1, ...]``, drawn baselines, the changes from these to those
    (``[*B, k, ...]``) and the points between them.

    ``drawn``: the chunk's draws, a TensorDict (given) or a dict (`_draw`) with the same keys.
    Unless ``keep_starts``, the points are made in the baselines' memory (the starts are
    then not returned: an empty dict).
    """
    batch = inputs.batch_size
    index, alpha, noise = drawn.get("index"), drawn.get("alpha"), drawn.get("noise", None)
    noised = () if noise is None else noise.keys(True, True)
    ends, starts, changes, points = {}, {}, {}, {}
    for key in keys:
        pool = entry(refs, key)
        x = entry(inputs, key).unsqueeze(len(batch))  # every copy the sample: broadcast, not repeated
        # (each `.to` only where it changes something: a call that returns its tensor still costs one, on every call)
        picks = index.get(key) if isinstance(index, TensorDictBase) else index
        b = pool[picks if picks.device == pool.device else picks.to(pool.device)]
        if b.dtype != x.dtype:
            b = b.to(x.dtype)
        if key in noised:
            x = x + noise.get(key).to(x.device)
        a = alpha if alpha.dtype == x.dtype and alpha.device == x.device else alpha.to(x)  # (draws given on the CPU)
        a = a.reshape(*batch, k, *[1] * (x.dim() - len(batch) - 1))
        ends[key], changes[key] = x, x - b
        # captum's rand * input + (1 - rand) * baseline; in the baselines' memory where they are read no more
        # (a new tensor of the pool's rows: indexing copies), the same numbers in the other order (eagerly: under
        # vmap the draws may be unbatched where the inputs are batched)
        if keep_starts or b.shape != changes[key].shape or not untransformed():
            starts[key] = b
            points[key] = a * x + (1.0 - a) * b
        else:
            # (b (1 - a) + a x, each product rounded as captum's: addcmul's vector kernels fuse the multiply-add
            # and round once, which moves points by an ulp; torch.rsub is what ``1.0 - a`` runs, without the
            # Python wrapper of Tensor.__rsub__)
            points[key] = b.mul_(torch.rsub(a, 1.0)).add_(a * x)
    return ends, starts, changes, points


def _flat(t: torch.Tensor, dims: int) -> torch.Tensor:
    """``[*B, k, ...]`` as ``[N * k, ...]``."""
    return t.reshape(-1, *t.shape[dims + 1:])


def _references(inputs: TensorDictBase, baselines: Any, keys: Sequence[NestedKey]) -> TensorDictBase:
    """The reference samples as a TensorDict ``[R]`` holding every attributed key."""
    if isinstance(baselines, torch.Tensor):
        if len(keys) != 1:
            raise TypeError(f"gradient_shap: a tensor of baselines fits one attributed input, but {len(keys)} are "
                            f"attributed {list(keys)}; pass a TensorDict of batch [R] with those keys")
        if baselines.dim() == 0:
            raise ValueError("gradient_shap: baselines are reference samples [R, ...], got a 0-d tensor")
        baselines = fresh_tensordict({keys[0]: baselines}, baselines.shape[:1])  # (the samples' batch: first dim)
    if not isinstance(baselines, TensorDictBase):
        raise TypeError(f"gradient_shap: baselines must be reference samples, a TensorDict of batch [R] or a tensor "
                        f"[R, ...], got {type(baselines).__name__}")
    if baselines.batch_dims != 1 or baselines.batch_size[0] < 1:
        raise ValueError(f"gradient_shap: baselines need one batch dim of reference samples, [R] with R >= 1, got "
                         f"batch_size={list(baselines.batch_size)}")
    dims = inputs.batch_dims
    for key in keys:
        b, x = baselines.get(key, None), inputs.get(key)
        if b is None:
            raise KeyError(f"gradient_shap: no baselines for input {key!r}; give reference samples for every "
                           "attributed input")
        if b.shape[1:] != x.shape[dims:]:
            raise ValueError(f"gradient_shap: baselines {key!r} hold samples of shape {list(b.shape[1:])}, the "
                             f"input's samples have shape {list(x.shape[dims:])}")
    return baselines


def _draw(inputs: TensorDictBase, keys: Sequence[NestedKey], n_refs: int, sigma: dict[NestedKey, float], k: int,
          generator: torch.Generator | None) -> dict[str, Any]:
    """One chunk's draws, in the order the docstring of `gradient_shap` gives, keyed as ``draws`` (a plain dict: `_path`
    reads it as it reads them, and it is built on every call)."""
    batch = inputs.batch_size
    first = entry(inputs, keys[0])
    device = first.device
    drawn: dict[str, Any] = {"index": torch.randint(n_refs, (*batch, k), generator=generator, device=device)}
    if sigma:
        noise = TensorDict({}, batch_size=[*batch, k])
        for key, value in noise_draws(inputs, sigma, k, generator, None).items():
            noise.set(key, value)
        drawn["noise"] = noise
    drawn["alpha"] = torch.rand((*batch, k), generator=generator, device=device, dtype=first.dtype)
    return drawn


def _check_draws(inputs: TensorDictBase, draws: Any, keys: Sequence[NestedKey], n_refs: int, n: int) -> None:
    if not isinstance(draws, TensorDictBase):
        raise TypeError(f"gradient_shap: draws must be a TensorDict, got {type(draws).__name__}")
    want = [*inputs.batch_size, n]
    if list(draws.batch_size) != want:
        raise ValueError(f"gradient_shap: draws must have batch_size {want} ([*B, n_samples]), got "
                         f"{list(draws.batch_size)}")
    present = draws.keys(True, True)
    needed = ["alpha"] + (["index"] if isinstance(draws.get("index", None), torch.Tensor)
                          else [("index", key) for key in keys])
    for name in needed:
        if name not in present:
            raise KeyError(f"gradient_shap: draws hold no {name!r} (they need 'alpha' and 'index' of batch "
                           "[*B, n_samples]; see gradient_shap's docstring)")
        value = draws.get(name)
        if name == "alpha":
            continue
        out_of_range = untransformed() and bool(((value < 0) | (value >= n_refs)).any())  # (values unread under vmap)
        if value.is_floating_point() or out_of_range:
            raise ValueError(f"gradient_shap: draws {name!r} must be integer indices into the {n_refs} baselines")
    noise = draws.get("noise", None)
    if noise is not None and not isinstance(noise, TensorDictBase):
        raise TypeError(f"gradient_shap: draws 'noise' must be a TensorDict keyed like the attributed inputs "
                        f"{list(keys)} (a draws TensorDict holding ('noise', key) entries), got a "
                        f"{type(noise).__name__}")
