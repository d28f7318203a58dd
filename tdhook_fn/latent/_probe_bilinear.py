"""Bilinear probes on pairs of activations, trained by gradient descent on every pair at once."""

# NOTE [bilinear probes]
# A full probe scores ``x1^T A_k x2 + b_k`` (``A`` is ``(K, D1, D2)``, as ``nn.Bilinear``); a
# low-rank one ``sum_r (u_kr . x1 + c_kr) (v_kr . x2 + e_kr) + b_k``, which at ``rank=1`` is
# tdhook's ``LowRankBilinearEstimator`` (two affine maps multiplied, plus a bias). Neither
# objective is convex, so they are trained as tdhook trains them: Adam (torch's defaults) on
# the mean cross-entropy (classes) or squared error (regression targets), ``epochs`` passes
# over shuffled mini-batches. Pairs of one shape are stacked on a leading dim and one
# ``torch.func.grad`` of the summed losses gives each its own gradient (a ``vmap`` of the
# per-pair gradient is the same numbers, slower), all pairs seeing the same batches. The
# initial weights (``nn.Bilinear``/``nn.Linear``'s uniform ranges, drawn in the order of
# ``_init``) and then each epoch's shuffling come from one generator seeded by ``seed``;
# every pair starts from the same draw, so a pair's probe is the same fitted alone or with
# others, and a fit is reproducible.

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey

from ._probe_inputs import Labels, Task, as_labels, check_finite, check_tensor_acts, site_name

__all__ = ["fit_bilinear_probes", "predict_bilinear_probes"]

Params = dict[str, torch.Tensor]
_BETAS, _EPS = (0.9, 0.999), 1e-8


def _scores(p: Params, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """``(..., N, K)`` scores of probes with leading dims ``...`` (NOTE [bilinear probes])."""
    out: torch.Tensor
    if "weight" in p:
        k, d1, d2 = p["weight"].shape[-3:]
        flat = p["weight"].transpose(-3, -2).reshape(*p["weight"].shape[:-3], d1, k * d2)
        mapped = (x1 @ flat).reshape(*x1.shape[:-1], k, d2)
        out = (mapped * x2[..., None, :]).sum(-1)
    else:
        k, r = p["u"].shape[-3:-1]
        left = (x1 @ p["u"].flatten(-3, -2).mT).reshape(*x1.shape[:-1], k, r) + p["u_bias"][..., None, :, :]
        right = (x2 @ p["v"].flatten(-3, -2).mT).reshape(*x2.shape[:-1], k, r) + p["v_bias"][..., None, :, :]
        out = (left * right).sum(-1)
    return out + p["bias"][..., None, :] if "bias" in p else out


def _init(shape: tuple[int, ...], k: int, d1: int, d2: int, rank: int | None, fit_intercept: bool,
          like: torch.Tensor, generator: torch.Generator) -> Params:
    def uniform(bound: float, *size: int) -> torch.Tensor:  # one draw shared by the stack: a pair's own fit
        drawn = torch.rand(size, generator=generator, dtype=like.dtype).to(like.device)
        return ((2 * drawn - 1) * bound).expand(*shape, *size).clone()

    if rank is None:
        params = {"weight": uniform(1 / math.sqrt(d1), k, d1, d2)}
        if fit_intercept:
            params["bias"] = uniform(1 / math.sqrt(d1), k)
        return params
    params = {"u": uniform(1 / math.sqrt(d1), k, rank, d1), "u_bias": uniform(1 / math.sqrt(d1), k, rank),
              "v": uniform(1 / math.sqrt(d2), k, rank, d2), "v_bias": uniform(1 / math.sqrt(d2), k, rank)}
    if fit_intercept:
        params["bias"] = torch.zeros((*shape, k), dtype=like.dtype, device=like.device)
    return params


def _train(params: Params, x1: torch.Tensor, x2: torch.Tensor, labels: Labels, *, epochs: int, lr: float,
           batch_size: int, generator: torch.Generator) -> Params:
    """Adam on a stack ``(S, ...)`` of probes, one gradient per mini-batch (NOTE [bilinear probes])."""
    classify = labels.index is not None
    target = labels.index if labels.index is not None else labels.targets(x1.dtype)

    def loss(p: Params, a: torch.Tensor, b: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The sum over the stack of each probe's mean loss: its gradient is each probe's own."""
        out = _scores(p, a, b)
        if classify:
            picked = out.gather(-1, t[:, None].expand(*out.shape[:-1], 1))[..., 0]
            return (torch.logsumexp(out, -1) - picked).mean(-1).sum()
        return ((out - t) ** 2).mean((-2, -1)).sum()

    gradient = cast(Callable[..., Params], torch.func.grad(loss))
    first = {k: torch.zeros_like(v) for k, v in params.items()}
    second = {k: torch.zeros_like(v) for k, v in params.items()}
    n, step = x1.shape[-2], 0
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator).to(x1.device)
        for start in range(0, n, batch_size):
            rows = order[start:start + batch_size]
            grads = gradient(params, x1[:, rows], x2[:, rows], target[rows])
            step += 1
            for key, g in grads.items():
                first[key] = _BETAS[0] * first[key] + (1 - _BETAS[0]) * g
                second[key] = _BETAS[1] * second[key] + (1 - _BETAS[1]) * g * g
                unbiased = second[key] / (1 - _BETAS[1] ** step)
                params[key] = params[key] - lr * (first[key] / (1 - _BETAS[0] ** step)) / (unbiased.sqrt() + _EPS)
    return params


def fit_bilinear_probes(
    acts1: TensorDictBase | torch.Tensor,
    acts2: TensorDictBase | torch.Tensor,
    labels: torch.Tensor,
    *,
    rank: int | None = None,
    fit_intercept: bool = True,
    task: Task = "auto",
    classes: torch.Tensor | None = None,
    epochs: int = 100,
    lr: float = 1e-3,
    batch_size: int = 128,
    seed: int = 0,
) -> TensorDict:
    """Bilinear probes ``x1^T A x2 + b`` (or of rank ``rank``) on pairs of activations, every pair trained at once.

    Args:
        acts1 (TensorDict | Tensor): first activations: a TensorDict with one ``(N, ...)``
            tensor per pair, or a tensor ``(..., N, D1)`` whose leading dims are batch dims.
        acts2 (TensorDict | Tensor): second activations, the same keys (or leading dims).
        labels (Tensor): ``(N,)`` classes or ``(N,)`` / ``(N, K)`` regression targets.
        rank (int | None): ``None`` for a full ``(K, D1, D2)`` map; ``r`` for a sum of ``r``
            products of affine maps per output (``1`` is tdhook's ``LowRankBilinearEstimator``).
            Default: ``None``.
        fit_intercept (bool): an output bias. Default: ``True``.
        task (str): as for `fit_probes`. Default: ``"auto"``.
        classes (Tensor | None): as for `fit_probes`. Default: read from ``labels``.
        epochs (int): passes over the data. Default: ``100``.
        lr (float): Adam's learning rate. Default: ``1e-3``.
        batch_size (int): samples per step. Default: ``128``.
        seed (int): seeds the initial weights and the shuffling. Default: ``0``.

    Returns:
        TensorDict: by pair key (or with the leading dims as batch size), ``weight (K, D1, D2)``
        or ``u (K, r, D1)``, ``u_bias (K, r)``, ``v (K, r, D2)``, ``v_bias (K, r)``; ``bias (K,)``;
        ``classes`` for a classifier (``K`` is the number of classes, scored by cross-entropy).

    Raises:
        ValueError: pairs or samples that do not match, too few classes, NaN, bad options.

    Examples:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> x1, x2 = torch.randn(200, 3, generator=g), torch.randn(200, 3, generator=g)
        >>> same_sign = ((x1[:, 0] * x2[:, 0]) > 0).long()
        >>> probes = fit_bilinear_probes(x1, x2, same_sign, rank=1, epochs=100, lr=0.05, batch_size=50)
        >>> bool((predict_bilinear_probes(probes, x1, x2) == same_sign).float().mean() > 0.9)
        True
    """
    caller = "fit_bilinear_probes"
    if rank is not None and (not isinstance(rank, int) or rank < 1):
        raise ValueError(f"{caller}: rank must be None (full) or a positive int, got {rank!r}")
    if epochs < 1 or batch_size < 1 or not lr > 0:
        raise ValueError(f"{caller}: epochs, batch_size and lr must be positive, got {epochs}, {batch_size}, {lr}")
    pairs = _pairs(caller, acts1, acts2)
    n = pairs[0][1].shape[-2]
    read = as_labels(caller, labels, n, task=task, classes=classes)
    out = TensorDict({}, batch_size=[])
    for keys, x1, x2, lead in _stacks(caller, pairs):
        names = [site_name(k) for k in keys] if keys != [()] else []
        check_finite(caller, x1, names, "acts1")
        check_finite(caller, x2, names, "acts2")
        k = read.classes.shape[0] if read.classes is not None else read.targets(x1.dtype).shape[-1]
        generator = torch.Generator().manual_seed(seed)  # per stack: a pair's probe is the one it gets alone
        params = _init((x1.shape[0],), k, x1.shape[-1], x2.shape[-1], rank, fit_intercept, x1, generator)
        params = _train(params, x1, x2, read, epochs=epochs, lr=lr, batch_size=batch_size, generator=generator)
        if keys == [()]:
            return _probe(params, read, lead, flat=True)
        for i, key in enumerate(keys):
            out.set(key, _probe({name: v[i] for name, v in params.items()}, read, torch.Size([]), flat=False))
    return out


def _probe(params: Params, labels: Labels, lead: torch.Size, flat: bool) -> TensorDict:
    if flat:
        params = {k: v.reshape(*lead, *v.shape[1:]) for k, v in params.items()}
    probe = TensorDict(params, batch_size=lead)
    if labels.classes is not None:
        probe.set("classes", labels.classes.expand(*lead, -1))
    return probe


Pair = tuple[NestedKey, torch.Tensor, torch.Tensor]


def _pairs(caller: str, acts1: TensorDictBase | torch.Tensor, acts2: TensorDictBase | torch.Tensor) -> list[Pair]:
    if isinstance(acts1, torch.Tensor) and isinstance(acts2, torch.Tensor):
        check_tensor_acts(caller, acts1, "acts1")
        check_tensor_acts(caller, acts2, "acts2")
        if acts1.shape[:-1] != acts2.shape[:-1]:
            raise ValueError(f"{caller}: acts1 is {tuple(acts1.shape)} and acts2 {tuple(acts2.shape)}; they need the "
                             "same leading dims and samples (..., N, D1) and (..., N, D2)")
        return [((), acts1, acts2)]
    if not (isinstance(acts1, TensorDictBase) and isinstance(acts2, TensorDictBase)):
        raise TypeError(f"{caller}: acts1 and acts2 must both be tensors or both TensorDicts of pairs, got "
                        f"{type(acts1).__name__} and {type(acts2).__name__}")
    keys1 = list(acts1.keys(include_nested=True, leaves_only=True))
    if not keys1 or sorted(map(str, keys1)) != sorted(map(str, acts2.keys(include_nested=True, leaves_only=True))):
        raise ValueError(f"{caller}: acts1 and acts2 must hold the same pair keys, one (N, ...) tensor each")
    pairs: list[Pair] = []
    for key in keys1:
        a, b = acts1.get(key), acts2.get(key)
        for name, value in (("acts1", a), ("acts2", b)):
            check_tensor_acts(caller, value, f"{name}[{site_name(key)!r}]")
        a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
        first = pairs[0][1].shape[0] if pairs else a.shape[0]
        if a.shape[0] != b.shape[0] or a.shape[0] != first:
            raise ValueError(f"{caller}: pair {site_name(key)!r} has N={a.shape[0]} and {b.shape[0]} samples; every "
                             "pair needs the same samples")
        pairs.append((key, a, b))
    return pairs


def _stacks(caller: str, pairs: list[Pair]) -> list[tuple[list[NestedKey], torch.Tensor, torch.Tensor, torch.Size]]:
    """Pairs of one shape stacked on a new first dim; a tensor's leading dims flattened into it."""
    if pairs[0][0] == ():
        _, a, b = pairs[0]
        lead = a.shape[:-2]
        return [([()], a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), lead)]
    by_shape: dict[tuple[object, ...], list[Pair]] = {}
    for pair in pairs:
        by_shape.setdefault((pair[1].shape, pair[2].shape, pair[1].dtype, pair[2].dtype), []).append(pair)
    return [([k for k, _, _ in group], torch.stack([a for _, a, _ in group]), torch.stack([b for _, _, b in group]),
             torch.Size([])) for group in by_shape.values()]


def predict_bilinear_probes(
    probes: TensorDictBase, acts1: TensorDictBase | torch.Tensor, acts2: TensorDictBase | torch.Tensor
) -> TensorDict | torch.Tensor:
    """The bilinear probes' predictions: the class of the largest score, or the regression outputs.

    Args:
        probes (TensorDict): what `fit_bilinear_probes` returned.
        acts1 (TensorDict | Tensor): first activations, as fitted on (any number of samples).
        acts2 (TensorDict | Tensor): second activations.

    Returns:
        TensorDict | Tensor: by pair ``(M,)`` classes or ``(M, K)`` regression outputs
        (``K = 1`` for ``(N,)`` labels); for tensors with the leading dims in front.

    Examples:
        >>> import torch
        >>> x1, x2, y = torch.randn(30, 2), torch.randn(30, 4), torch.randint(0, 3, (30,))
        >>> predict_bilinear_probes(fit_bilinear_probes(x1, x2, y, epochs=2), x1, x2).shape
        torch.Size([30])
    """
    caller = "predict_bilinear_probes"
    pairs = _pairs(caller, acts1, acts2)
    if pairs[0][0] == ():
        return _predict(probes, pairs[0][1], pairs[0][2], probes.batch_dims)
    out = TensorDict({}, batch_size=[])
    for key, a, b in pairs:
        if key not in probes.keys(include_nested=True):
            raise ValueError(f"{caller}: probes hold no pair {site_name(key)!r}")
        out.set(key, _predict(cast(TensorDictBase, probes.get(key)), a, b, 0))
    return out


def _predict(probe: TensorDictBase, x1: torch.Tensor, x2: torch.Tensor, batch_dims: int) -> torch.Tensor:
    params = {k: cast(torch.Tensor, v) for k, v in probe.items() if k != "classes"}
    lead = probe.batch_size
    flat = {k: v.reshape(-1, *v.shape[batch_dims:]) for k, v in params.items()}
    a, b = x1.expand(*lead, *x1.shape[-2:]), x2.expand(*lead, *x2.shape[-2:])
    scores = _scores(flat, a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
    scores = scores.reshape(*lead, *scores.shape[1:])
    if "classes" not in probe.keys():
        return scores
    classes = cast(torch.Tensor, probe.get("classes"))
    index = scores.argmax(-1)
    return classes[..., None, :].expand(*index.shape, classes.shape[-1]).gather(-1, index[..., None])[..., 0]
