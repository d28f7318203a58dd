"""Activation maximisation (Erhan et al. 2009; Mahendran & Vedaldi 2015): gradient ascent on the inputs."""

# NOTE [ascent step]
# One step is ``x <- clamp(x + alpha * g, min_value, max_value)``, ``g`` the gradient of the
# target at ``x`` (one `gradients` call: a forward
# and a VJP). It is tdhook 0.1.3's ``PGDModule`` step with ``ascent=True`` and
# ``use_sign=False``, which writes ``x - alpha * (-g)``: the same number to the last bit.
# The starting point is not clamped, the raw gradient (not its sign) is used and the step
# size stays ``alpha``, as there.
#
# NOTE [one ascent per objective]
# With several targets the default ascends their sum (tdhook's behaviour). With
# ``per_target=True`` each target gets its own trajectory: after the first step the
# inputs of different objectives differ, so one map per target from one forward (as
# saliency does) is not enough. The objectives are told apart by a one-hot weight on the
# cotangents, and the whole ascent is ``vmap``-ed over the T one-hots: T trajectories in
# one batched forward and VJP per step. Several starting points need nothing special:
# they are a batch dim of ``inputs`` (each sample's gradient is its own), or a ``vmap``
# over this function.

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from .._probe import on_meta
from .._taps import Tap
from .._targets import Target, as_target
from .._types import GradFn, NestedKey
from ._engine import Cotangents, grad_taps, gradients, input_keys_of, per_key
from ._inputs import accepts_tensors, check_call, check_layers
from ._replaced_derivatives import values_where_replaced
from ._target_values import target_values

__all__ = ["activation_maximisation", "pgd_step"]


def pgd_step(x: torch.Tensor, grad: torch.Tensor, alpha: float, *, min_value: float = -math.inf,
             max_value: float = math.inf, ascent: bool = True, use_sign: bool = False) -> torch.Tensor:
    """One projected gradient step: ``clamp(x ± alpha * g, min_value, max_value)``.

    ``g`` is ``grad``, or its sign with ``use_sign``; ``+`` with ``ascent`` (maximise),
    ``-`` without (minimise). The same numbers as tdhook 0.1.3's ``PGDModule`` step.

    Args:
        x (Tensor): the current point.
        grad (Tensor): the gradient at ``x``.
        alpha (float): the step size.
        min_value (float): lower bound of the result. Default: ``-inf``.
        max_value (float): upper bound of the result. Default: ``inf``.
        ascent (bool): step up the gradient (maximise). Default: ``True``.
        use_sign (bool): step along the gradient's sign. Default: ``False``.

    Examples:
        >>> pgd_step(torch.tensor([0.0, 1.0]), torch.tensor([2.0, -3.0]), 0.5, max_value=1.0)
        tensor([ 1.0000, -0.5000])
        >>> pgd_step(torch.tensor([0.0, 1.0]), torch.tensor([2.0, -3.0]), 0.5, ascent=False, use_sign=True)
        tensor([-0.5000,  1.5000])
    """
    g = torch.sign(grad) if use_sign else grad
    step = x + alpha * g if ascent else x - alpha * g  # NOTE [ascent step]
    return torch.clamp(step, min=min_value, max=max_value)

_CALLER = "activation_maximisation"


@accepts_tensors
def activation_maximisation(
    f: Callable[[TensorDictBase, TensorDictBase], TensorDictBase],
    params: TensorDictBase,
    inputs: TensorDictBase,
    *,
    target: Target,
    alpha: float = 0.1,
    n_steps: int = 10,
    min_value: float = -math.inf,
    max_value: float = math.inf,
    per_target: bool = False,
    target_layers: Sequence[str] = (),
    input_keys: Sequence[NestedKey] | None = None,
    grad_fns: Mapping[str, GradFn] | None = None,
    taps: Sequence[Tap] = (),
    cotangents: Cotangents | None = None,
) -> TensorDict:
    """Inputs that increase the target, by ``n_steps`` of projected gradient ascent from ``inputs``.

    Each step is ``x <- clamp(x + alpha * dtarget/dx, min_value, max_value)``. Only the
    optimised inputs are differentiated; ``params`` are constants, and nothing passed in
    is written: the model, ``params`` and ``inputs`` are left as they were. Other entries
    of ``inputs`` (labels, masks) stay fixed and are offered to the target.

    Args:
        f (Functional | Callable): pure ``f(params, td) -> td``, e.g. `tdhook_fn.functional`.
        params (TensorDict): parameters for ``f``.
        inputs (TensorDict): starting points, any batch size ``[*B]``; several seeds are
            a batch dim (or ``vmap`` over this function).
        target (int | tuple[int, ...] | Callable): what to maximise, see
            `tdhook_fn.as_target`; with ``target_layers`` a callable reads their
            activations under their path.
        alpha (float): step size; a negative one descends. Default: ``0.1``.
        n_steps (int): number of steps (``0`` returns a copy of the inputs). Default: ``10``.
        min_value (float): lower bound of the inputs after each step. Default: ``-inf``.
        max_value (float): upper bound of the inputs after each step. Default: ``inf``.
        per_target (bool): one ascent per target, on a new leading dim ``T``, all under one
            ``vmap``. Default: ``False`` (ascend their sum).
        target_layers (Sequence[str]): paths whose activations the target sees (tdhook's
            ``modules_to_maximise``).
        input_keys (Sequence | None): the inputs to optimise. Default: ``f.in_keys``.
        grad_fns (Mapping[str, Callable] | None): path -> function applied to the gradient
            at that module's output, at every step.
        taps (Sequence[Tap]): any further taps for each forward.
        cotangents (Callable | None): ``target_values -> TensorDict`` weighting the targets
            (tdhook's ``init_attr_grads``). Default: ones.

    Returns:
        TensorDict: the optimised inputs, keyed like ``input_keys``, batch ``[*B]``, or
        ``[T, *B]`` with ``per_target``.

    Raises:
        TypeError: ``f``, ``params`` or ``inputs`` is of the wrong kind, an option is not a
            number (or ``n_steps`` not an int), an optimised input is not floating point.
        ValueError: ``n_steps < 0``, ``alpha`` or a bound is NaN, ``min_value > max_value``,
            there is no input to optimise, targets differ in number across keys.
        KeyError: an ``input_keys`` entry is not in ``inputs``.

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
        >>> x = TensorDict(input=torch.zeros(5, 3), batch_size=[5])
        >>> best = activation_maximisation(f, p, x, target=1, n_steps=20, min_value=-1.0, max_value=1.0)
        >>> bool((net(best["input"])[:, 1] > net(x["input"])[:, 1]).all())
        True
        >>> activation_maximisation(f, p, x, target=(0, 1), per_target=True)["input"].shape
        torch.Size([2, 5, 3])
        >>> seeds = TensorDict(input=torch.randn(4, 5, 3), batch_size=[4, 5])
        >>> torch.func.vmap(lambda td: activation_maximisation(f, p, td, target=1))(seeds)["input"].shape
        torch.Size([4, 5, 3])
    """
    _check_options(alpha, n_steps, min_value, max_value, per_target)
    check_layers(_CALLER, target_layers, "target_layers")
    if isinstance(input_keys, str):
        raise TypeError(f"{_CALLER}: input_keys must be a list of keys, got {input_keys!r}; write [{input_keys!r}]")
    keys = tuple(input_keys if input_keys is not None else
                 input_keys_of(f, inputs) if isinstance(inputs, TensorDictBase) else ())
    check_call(_CALLER, f, params, inputs, keys)
    if not keys:
        raise ValueError(f"{_CALLER}: there is no floating-point input to optimise; name it with input_keys=[...]")
    as_target(target)  # fail early on a malformed target
    all_taps = grad_taps(grad_fns, taps)
    inputs = values_where_replaced(_CALLER, params, inputs, all_taps)  # (once: each step's call is `checked`)

    def ascend(weights: torch.Tensor | None) -> TensorDict:
        weighted = cotangents if weights is None else _weighted(cotangents, weights)
        current = inputs.select(*keys).clone()
        for _ in range(n_steps):
            point = inputs.copy().update(current)
            grads = gradients(f, params, point, target, input_keys=keys, target_layers=target_layers, taps=all_taps,
                              cotangents=weighted, caller=_CALLER, checked=True).grads
            current = per_key(lambda x, g: pgd_step(x, g, alpha, min_value=min_value, max_value=max_value),
                              current, grads)
        return current

    if not per_target:
        return ascend(None)
    count = _count_targets(f, params, inputs, target, target_layers, all_taps)
    like = inputs.get(keys[0])
    one_hots = torch.eye(count, dtype=like.dtype, device=like.device)
    result: TensorDict = torch.func.vmap(ascend)(one_hots)
    return result


def _check_options(alpha: Any, n_steps: Any, min_value: Any, max_value: Any, per_target: Any) -> None:
    for name, value in (("alpha", alpha), ("min_value", min_value), ("max_value", max_value)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{_CALLER}: {name} must be a number (int or float), got {type(value).__name__}")
        if math.isnan(value):
            raise ValueError(f"{_CALLER}: {name} is NaN; give a number (bounds may be -math.inf or math.inf)")
    if isinstance(n_steps, bool) or not isinstance(n_steps, int):
        raise TypeError(f"{_CALLER}: n_steps must be an int, got {type(n_steps).__name__}")
    if n_steps < 0:
        raise ValueError(f"{_CALLER}: n_steps must be >= 0, got {n_steps}")
    if min_value > max_value:
        raise ValueError(f"{_CALLER}: min_value ({min_value}) is above max_value ({max_value}); swap them")
    if not isinstance(per_target, bool):
        raise TypeError(f"{_CALLER}: per_target must be a bool, got {type(per_target).__name__}")


def _count_targets(f: Callable[..., Any], params: TensorDictBase, inputs: TensorDictBase, target: Target,
                   target_layers: Sequence[str], taps: Sequence[Tap]) -> int:
    """T, the size of the targets' last dim (``1`` for one value per sample), from a meta forward."""
    values = on_meta(lambda p, td: target_values(f, p, td, target, target_layers=target_layers, taps=taps),
                     params, inputs)
    batch = len(inputs.batch_size)
    sizes = {v.shape[batch] if v.dim() > batch else 1 for v in values.values(True, True)}
    if len(sizes) != 1:
        raise ValueError(f"{_CALLER}: per_target needs the same number of targets in every target key, got {sizes}")
    return sizes.pop()


def _weighted(cotangents: Cotangents | None, weights: torch.Tensor) -> Cotangents:
    """Cotangents (ones by default) times ``weights`` on the targets' last dim: one objective."""

    def weigh(values: TensorDictBase) -> TensorDictBase:
        base = values.apply(torch.ones_like) if cotangents is None else cotangents(values)
        if not isinstance(base, TensorDictBase):
            raise TypeError(f"cotangents must return a TensorDict, got {type(base).__name__}")
        batch = len(values.batch_size)

        def times(g: torch.Tensor) -> torch.Tensor:
            if g.dim() == batch:  # one target per sample: T = 1
                return g * weights[0].to(g.dtype)
            return g * weights.to(g.dtype).reshape(weights.shape[0], *[1] * (g.dim() - batch - 1))

        return cast(TensorDictBase, base.apply(times))

    return weigh
