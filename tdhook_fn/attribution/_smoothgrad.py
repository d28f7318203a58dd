"""SmoothGrad (Smilkov et al. 2017) and its kin: an attribution averaged over noisy copies of the inputs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from tensordict import TensorDict, TensorDictBase

from .._targets import Target
from .._types import NestedKey, PureFn
from ._baselines import Baselines, attributed_keys, path_starts
from ._engine import gradients
from ._flat_copies import flat_copies, flat_target
from ._inputs import accepts_tensors, check_call
from ._metric_samples import check_count, chunks, repeated, repeated_target
from ._noise import (
    Stdevs,
    check_noisable,
    check_nt_type,
    fold_copies,
    mean_maps,
    noise_draws,
    noised,
    stdevs_by_key,
)
from ._saliency import saliency

__all__ = ["smoothgrad"]



@accepts_tensors
def smoothgrad(
    f: PureFn,
    params: TensorDictBase,
    inputs: TensorDictBase,
    baselines: Baselines | None = None,
    *,
    target: Target,
    nt_type: Literal["smoothgrad", "smoothgrad_sq", "vargrad"] = "smoothgrad",
    nt_samples: int = 5,
    stdevs: Stdevs = 1.0,
    attribution: Callable[..., Any] = saliency,
    per_target: bool = False,
    chunk_size: int | None = None,
    input_keys: NestedKey | Sequence[NestedKey] | None = None,
    generator: torch.Generator | None = None,
    noise_dtype: torch.dtype | None = None,
) -> TensorDict:
    """An attribution method averaged over Gaussian-noised copies of the inputs (captum's ``NoiseTunnel``).

    ``nt_samples`` copies of every sample get noise ``N(0, stdev^2)`` on each attributed
    input; ``attribution`` (default: the plain gradient, `saliency`) runs on all copies of
    a chunk at once, as one batch (one forward and one VJP for a gradient method), and
    the maps are combined per sample: their mean (``"smoothgrad"``), the mean of their
    squares (``"smoothgrad_sq"``), or their variance ``E[a^2] - E[a]^2`` (``"vargrad"``).
    Noise is drawn as captum's ``NoiseTunnel`` draws it (per chunk, input after input,
    in the memory order of captum's repeated batch): seeded alike, with ``chunk_size``
    equal to captum's ``nt_samples_batch_size`` (``None`` for both by default) and
    float32 noise (``noise_dtype=torch.float32`` for float64 inputs), the result equals
    captum's. Without noise (every ``stdevs`` 0) nothing is drawn. Under ``vmap`` pass
    ``randomness="different"``.

    Args:
        f (Functional | Callable): pure ``f(params, td) -> td``.
        params (TensorDict): parameters for ``f`` (constants here).
        inputs (TensorDict | Tensor): inputs with any batch size ``[*B]``; or a tensor,
            batch first (the result is then a tensor; see `saliency`).
        baselines (TensorDict | Tensor | float | None): passed to an ``attribution`` that
            takes baselines (`integrated_gradients`), repeated for every copy, as in
            `integrated_gradients`; not noised. Default: ``None`` (no baselines argument).
        target (int | tuple[int, ...] | Tensor | Callable): see `tdhook_fn.as_target`;
            a tensor holds one class index per sample (repeated for its copies).
        nt_type (str): ``"smoothgrad"``, ``"smoothgrad_sq"`` or ``"vargrad"``. Default:
            ``"smoothgrad"``.
        nt_samples (int): noisy copies per sample. Default: 5, as captum.
        stdevs (float | Sequence[float] | Mapping): standard deviation of the noise: one
            for every attributed input, one per input in the order of the attributed keys,
            or a mapping key -> value. Default: 1.0, as captum.
        attribution (Callable): ``attribution(f, params, inputs, [baselines,] *, target,
            per_target, ...)`` returning a TensorDict, e.g. `saliency`,
            ``functools.partial(saliency, multiply_by_inputs=True)`` (input x gradient),
            ``functools.partial(saliency, abs=True)`` (captum's ``Saliency``) or
            `integrated_gradients` (with ``baselines``). Default: `saliency`.
        per_target (bool): one map per target along a new leading dim ``T`` (passed to
            ``attribution``). Default: ``False``.
        chunk_size (int | None): noisy copies of each sample per call of ``attribution``;
            bounds memory. Default: all ``nt_samples`` in one call.
        input_keys (Sequence | None): the inputs noised (and attributed; passed on to
            ``attribution`` when given). Default: ``f.in_keys``.
        generator (torch.Generator | None): the random generator the noise is drawn from.
            Default: torch's global one (as captum).
        noise_dtype (torch.dtype | None): the dtype the noise is drawn in. Default: the
            input's.

    Returns:
        TensorDict: keyed like ``attribution``'s maps, batch ``[*B]`` or ``[T, *B]``; a
        tensor for a tensor ``inputs``.

    Raises:
        ValueError: unknown ``nt_type``, a count that is not a positive int, a negative
            standard deviation, or an ``attribution`` returning a tuple (a convergence delta).

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
        >>> x = TensorDict(input=torch.randn(5, 3), batch_size=[5])
        >>> g = torch.Generator().manual_seed(0)
        >>> smoothgrad(f, p, x, target=1, nt_samples=10, stdevs=0.1, generator=g)["input"].shape
        torch.Size([5, 3])
        >>> exact = smoothgrad(f, p, x, target=1, stdevs=0.0)  # no noise: the gradient itself
        >>> torch.allclose(exact["input"], tdhook_fn.attribution.saliency(f, p, x, target=1)["input"])
        True
    """
    check_nt_type("smoothgrad", nt_type)
    check_count("smoothgrad", "nt_samples", nt_samples)
    check_count("smoothgrad", "chunk_size", chunk_size, optional=True)
    if not callable(attribution):
        raise TypeError(f"smoothgrad: attribution must be a method such as saliency, got {type(attribution).__name__}")
    check_call("smoothgrad", f, params, inputs, target=target)
    keys = attributed_keys("smoothgrad", f, inputs, input_keys)
    check_noisable("smoothgrad", inputs, keys)
    sigma = stdevs_by_key("smoothgrad", stdevs, keys)
    starts = None if baselines is None else path_starts(inputs, baselines, keys, "smoothgrad")
    options: dict[str, Any] = {"per_target": per_target}
    if input_keys is not None:
        options["input_keys"] = input_keys
    batch = inputs.batch_size
    flat = attribution is saliency and starts is None  # the plain gradient: the engine's, on flat copies
    total: dict[NestedKey, torch.Tensor] | None = None
    squares: dict[NestedKey, torch.Tensor] | None = None
    lead: list[int] = []
    for k in chunks(nt_samples, chunk_size):
        # (none drawn without noise: a call without noise runs under vmap as it is)
        noise = noise_draws(inputs, sigma, k, generator, noise_dtype) if any(sigma.values()) else {}
        noisy = noised(inputs, noise)
        if flat:  # NOTE [flat copies]
            maps = gradients(f, params, flat_copies(inputs, k, noisy), flat_target(target, batch, k), input_keys=keys,
                             per_target=per_target, caller="smoothgrad", checked=True).grads
        else:
            copies = repeated(inputs, k)  # a new TensorDict (of views): its entries may be replaced
            for key, value in noisy.items():
                copies.set(key, value)
            args = () if starts is None else (repeated(starts, k),)
            maps = attribution(f, params, copies, *args, target=repeated_target(target, batch, k), **options)
            if not isinstance(maps, TensorDictBase):
                raise ValueError(f"smoothgrad: attribution returned {type(maps).__name__}, not a TensorDict of maps; "
                                 "ask it for maps only (return_convergence_delta=False)")
        lead = list(maps.batch_size[:maps.batch_dims - (1 if flat else len(batch) + 1)])  # [T] with per_target
        total = fold_copies(total, maps, batch, k, flat=flat)
        if nt_type != "smoothgrad":
            squares = fold_copies(squares, maps, batch, k, flat=flat, square=True)
    assert total is not None
    return mean_maps(total, squares, nt_samples, nt_type, [*lead, *batch])
