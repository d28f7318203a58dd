"""What the metrics share: repeated samples, chunks of them, perturbation functions, checks."""

# NOTE [metric samples]
# A metric evaluates ``n_perturb_samples`` perturbations of every input. The inputs
# (batch ``[*B]``) are repeated along a new *last* batch dim, ``[*B, k]``, so that their
# memory order is captum's ``repeat_interleave`` layout ``[N * k]`` (every sample's ``k``
# copies next to each other): a perturbation function drawing random numbers in memory
# order, or reading a table in that order, gives the same perturbation to the same
# (sample, copy) here as in captum. The ``k`` copies of a chunk run through one call of the
# model (or of the explanation function), never a loop; ``chunk_size`` bounds ``k``
# (captum's ``max_examples_per_batch`` is ``chunk_size * N``). The perturbation function
# is called once per chunk, so with the same chunks it consumes the random generator as
# captum's does.
#
# Randomness stays where it is written: the perturbation function is user code and draws
# from the generator it names (``generator=``), else from torch's global one. Under
# ``vmap`` a random draw needs ``vmap(..., randomness="different")`` (or ``"same"``).

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from .._types import NestedKey

__all__ = [
    "check_count",
    "checked_perturbed",
    "chunks",
    "input_leaves",
    "normal_perturbation",
    "perturbed_feed",
    "repeated",
    "repeated_target",
    "uniform_perturbation",
    "with_inputs_first",
]


def check_count(caller: str, name: str, value: Any, *, optional: bool = False) -> None:
    """``value`` must be a positive int (or ``None`` where ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{caller}: {name} must be a positive int{' or None' if optional else ''}, got {value!r}")


def chunks(n: int, chunk_size: int | None) -> list[int]:
    """Sizes of the chunks of ``n`` samples, ``chunk_size`` each and the rest last (captum's slicing)."""
    size = n if chunk_size is None else min(chunk_size, n)
    return [size] * (n // size) + ([n % size] if n % size else [])


def repeated(td: TensorDictBase, k: int) -> TensorDictBase:
    """``td`` with each sample repeated ``k`` times on a new last batch dim, ``[*B, k]`` (views, no copy)."""
    dims = td.batch_dims
    return _leafwise(td, [*td.batch_size, k],
                     lambda v: v.unsqueeze(dims).expand(*td.batch_size, k, *v.shape[dims:]))


def with_inputs_first(td: TensorDictBase, feed: TensorDictBase) -> TensorDictBase:
    """The inputs ``[*B]`` as copy 0 in front of the copies ``feed`` ``[*B, k]``: ``[*B, k + 1]``."""
    dims = td.batch_dims
    return _leafwise(feed, [*td.batch_size, feed.batch_size[-1] + 1],
                     lambda v, key: torch.cat([td.get(key).unsqueeze(dims), v], dims), with_key=True)


def _leafwise(td: TensorDictBase, batch: list[int], fn: Any, with_key: bool = False) -> TensorDictBase:
    """``fn`` of every leaf, in a new TensorDict of ``batch`` (a loop over leaves: TensorDict's own
    ``unsqueeze``, ``expand`` and ``torch.cat`` cost ten times as much on a few keys)."""
    out = TensorDict({}, batch_size=batch)
    for key, value in td.items(True, True):
        out.set(key, fn(value, key) if with_key else fn(value))
    return out


def repeated_target(target: Any, batch: torch.Size, k: int) -> Any:
    """A tensor of class indices (one per sample, ``[*B]``) for the repeated samples ``[*B, k]``."""
    if isinstance(target, torch.Tensor) and target.dim():
        return target.unsqueeze(-1).expand(*batch, k)
    return target


def perturbed_feed(caller: str, copies: TensorDictBase, perturbed: Any) -> TensorDictBase:
    """The repeated inputs with the entries the perturbation function returned in their place."""
    feed = copies.clone(False)
    for key, value in checked_perturbed(caller, copies, perturbed):
        feed.set(key, value)
    return feed


def checked_perturbed(caller: str, copies: TensorDictBase, perturbed: Any) -> list[tuple[NestedKey, torch.Tensor]]:
    """The entries a perturbation function returned, each an input of the copies and shaped like it."""
    if not isinstance(perturbed, TensorDictBase):
        raise TypeError(f"{caller}: perturb_func must return TensorDicts of perturbed inputs, got "
                        f"{type(perturbed).__name__}")
    out = []
    for key, value, old in input_leaves(caller, "perturb_func returned", perturbed, copies):
        if value.shape != old.shape:
            raise ValueError(f"{caller}: perturb_func returned {key!r} of shape {list(value.shape)}; the inputs it "
                             f"was given have shape {list(old.shape)} (batch [*B, k]: k copies of each sample)")
        out.append((key, value))
    return out


def input_leaves(caller: str, what: str, td: TensorDictBase,
                 inputs: TensorDictBase) -> Iterator[tuple[NestedKey, torch.Tensor, torch.Tensor]]:
    """``(key, leaf of td, input at key)`` for every leaf of ``td``; a key no input has raises ``KeyError``."""
    for key, value in td.items(True, True):
        old = inputs.get(key, None)
        if old is None:
            raise KeyError(f"{caller}: {what} {key!r}, which is not one of the inputs {list(inputs.keys(True, True))}")
        yield key, cast(torch.Tensor, value), old


def _floating_keys(inputs: TensorDictBase, keys: Sequence[NestedKey] | None) -> list[NestedKey]:
    if keys is not None:
        return list(keys)
    return [k for k, v in inputs.items(True, True) if isinstance(v, torch.Tensor) and v.is_floating_point()]


def uniform_perturbation(inputs: TensorDictBase | torch.Tensor, radius: float = 0.02, *,
                         keys: Sequence[NestedKey] | None = None, generator: torch.Generator | None = None,
                         dtype: torch.dtype | None = None) -> TensorDict | torch.Tensor:
    """Inputs plus noise drawn uniformly from the L-infinity ball of ``radius``.

    The default perturbation of `sensitivity_max`, captum's ``default_perturb_func``:
    the noise of each key is drawn in memory order, in the order of ``keys``, so with
    the same random state and float32 inputs it draws the same numbers as captum's.

    Args:
        inputs (TensorDict | Tensor): the inputs to perturb (any batch size), or one tensor.
        radius (float): half-width of the uniform noise. Default: ``0.02``.
        keys (Sequence | None): the entries perturbed. Default: every floating-point entry.
        generator (torch.Generator | None): the random generator drawn from. Default: torch's
            global one.
        dtype (torch.dtype | None): the dtype the noise is drawn in (``torch.float32``
            reproduces captum's and tdhook's draws for float64 inputs). Default: the input's.

    Returns:
        TensorDict | Tensor: the perturbed entries, batch as ``inputs`` (a tensor for a tensor).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> x = TensorDict(input=torch.zeros(2, 3), batch_size=[2])
        >>> g = torch.Generator().manual_seed(0)
        >>> noisy = uniform_perturbation(x, 0.1, generator=g)["input"]
        >>> bool(noisy.abs().max() <= 0.1)
        True
    """
    if isinstance(inputs, torch.Tensor):
        return _plus_uniform(inputs, radius, generator, dtype)
    out = TensorDict({}, batch_size=inputs.batch_size)
    for key in _floating_keys(inputs, keys):
        out.set(key, _plus_uniform(inputs.get(key), radius, generator, dtype))
    return out


def _plus_uniform(value: torch.Tensor, radius: float, generator: torch.Generator | None,
                  dtype: torch.dtype | None) -> torch.Tensor:
    noise = torch.empty(value.shape, dtype=dtype or value.dtype, device=value.device)
    return value + noise.uniform_(-radius, radius, generator=generator)


def normal_perturbation(inputs: TensorDictBase, std: float = 0.01, *, keys: Sequence[NestedKey] | None = None,
                        generator: torch.Generator | None = None) -> tuple[TensorDict, TensorDict]:
    """Gaussian noise for `infidelity`: ``(perturbations, perturbed_inputs)`` with ``I = x - x'``.

    ``x' = x + std * eps`` with standard normal ``eps`` in the input's dtype. The
    inputs' last batch dim is the copies of each sample (``[*B, k]``); the noise is drawn
    copy by copy (all of copy ``j``, key after key, then
    copy ``j + 1``), so a seeded run draws the numbers a loop drawing one perturbation of
    the batch per step draws (tdhook's ``InfidelityMetric``).

    Args:
        inputs (TensorDict): the repeated inputs, batch ``[*B, k]``.
        std (float): standard deviation of the noise. Default: ``0.01``.
        keys (Sequence | None): the entries perturbed. Default: every floating-point entry.
        generator (torch.Generator | None): the random generator drawn from. Default: torch's
            global one.

    Returns:
        tuple[TensorDict, TensorDict]: the perturbations ``x - x'`` and the perturbed
        entries ``x'``, batch ``[*B, k]``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> x = TensorDict(input=torch.ones(2, 4, 3), batch_size=[2, 4])
        >>> dx, moved = normal_perturbation(x, 0.1, generator=torch.Generator().manual_seed(0))
        >>> torch.allclose(moved["input"] + dx["input"], x["input"])
        True
    """
    if inputs.batch_dims < 1:
        raise ValueError("normal_perturbation: inputs need a last batch dim of copies ([*B, k]), got batch_size=[]")
    chosen = _floating_keys(inputs, keys)
    dim = inputs.batch_dims - 1
    draws: dict[NestedKey, list[torch.Tensor]] = {key: [] for key in chosen}
    for _ in range(inputs.batch_size[-1]):
        for key in chosen:
            value = inputs.get(key)
            one = value.select(dim, 0)
            draws[key].append(torch.randn(one.shape, dtype=one.dtype, device=one.device, generator=generator))
    perturbations = TensorDict({}, batch_size=inputs.batch_size)
    moved = TensorDict({}, batch_size=inputs.batch_size)
    for key in chosen:
        value = inputs.get(key)
        shifted = value + std * torch.stack(draws[key], dim)
        moved.set(key, shifted)
        perturbations.set(key, value - shifted)
    return perturbations, moved
