"""Applying fitted probes: decision values, predictions and scores, every site in one op per width."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey

from ._probe_inputs import check_tensor_acts, site_name

__all__ = ["decision_function", "predict_probes", "score_probes"]

Apply = Callable[[TensorDictBase, torch.Tensor, int], torch.Tensor]


def _decision(probe: TensorDictBase, x: torch.Tensor, batch_dims: int) -> torch.Tensor:
    """``(..., N, K)`` decision values, ``(..., N)`` for a single-output regression."""
    weight: torch.Tensor = probe.get("weight")
    bias: torch.Tensor = probe.get("bias")
    if weight.ndim - batch_dims == 1:
        return (x @ weight[..., :, None])[..., 0] + bias[..., None]
    return x @ weight.mT + bias[..., None, :]


def _predict(probe: TensorDictBase, x: torch.Tensor, batch_dims: int) -> torch.Tensor:
    scores = _decision(probe, x, batch_dims)
    if "classes" not in probe.keys():
        return scores
    classes: torch.Tensor = probe.get("classes")
    index = (scores[..., 0] > 0).long() if scores.shape[-1] == 1 else scores.argmax(-1)
    table = classes[..., None, :].expand(*index.shape, classes.shape[-1])
    return table.gather(-1, index[..., None])[..., 0]


def _apply(
    caller: str, probes: TensorDictBase, acts: TensorDictBase | torch.Tensor, apply: Apply
) -> TensorDict | torch.Tensor:
    """``apply`` on each site, sites of one shape stacked (NOTE [probe sites in one op])."""
    if not isinstance(probes, TensorDictBase):
        raise TypeError(f"{caller}: probes must be the TensorDict fit_probes returned, got {type(probes).__name__}")
    if isinstance(acts, torch.Tensor):
        if "weight" not in probes.keys():
            raise ValueError(f"{caller}: acts is a tensor but probes hold sites {list(probes.keys())}; give the "
                             "TensorDict of activations by site")
        check_tensor_acts(caller, acts)
        return apply(probes, acts, probes.batch_dims)
    if not isinstance(acts, TensorDictBase):
        raise TypeError(f"{caller}: acts must be a TensorDict of sites or a tensor, got {type(acts).__name__}")
    stacks: dict[tuple[object, ...], list[tuple[NestedKey, TensorDictBase, torch.Tensor]]] = {}
    for key in _sites(probes):
        name = site_name(key)
        if key not in acts.keys(include_nested=True):
            raise ValueError(f"{caller}: acts has no site {name!r}, which probes hold")
        probe, value = probes.get(key), acts.get(key)
        x = value.reshape(value.shape[0], -1) if value.ndim >= 2 else value
        width = probe.get("weight").shape[-1]
        if x.ndim != 2 or x.shape[-1] != width:
            raise ValueError(f"{caller}: acts[{name!r}] is {tuple(value.shape)}; its probe takes (N, {width})")
        shape = (x.shape, x.dtype, x.device, tuple(probe.shape), tuple(sorted((k, v.shape) for k, v in probe.items())))
        stacks.setdefault(shape, []).append((key, probe, x))
    out = TensorDict({}, batch_size=[])
    for items in stacks.values():
        probe_stack = cast(TensorDictBase, torch.stack([p for _, p, _ in items]))
        stacked = apply(probe_stack, torch.stack([x for _, _, x in items]), 1)
        for (key, _, _), value in zip(items, stacked.unbind(0), strict=True):
            out.set(key, value)
    return out


def _sites(probes: TensorDictBase) -> list[NestedKey]:
    """The keys of the sub-TensorDicts holding a ``weight``."""
    found: list[NestedKey] = []
    for key in probes.keys(include_nested=True, leaves_only=True):
        path = (key,) if isinstance(key, str) else tuple(key)
        if path[-1] == "weight":
            found.append(path[0] if len(path) == 2 else path[:-1])
    if not found:
        raise ValueError("probes hold no 'weight'; give the TensorDict fit_probes returned")
    return found


def decision_function(probes: TensorDictBase, acts: TensorDictBase | torch.Tensor) -> TensorDict | torch.Tensor:
    """The probes' decision values (scikit-learn's ``decision_function``; the prediction of a regression).

    Args:
        probes (TensorDict): what `fit_probes` returned.
        acts (TensorDict | Tensor): activations shaped as those fitted on, any number of samples.

    Returns:
        TensorDict | Tensor: by site, ``(M, K)`` (``(M,)`` for a single-output regression);
        for a tensor ``acts`` ``(..., M, K)``.

    Examples:
        >>> import torch
        >>> from tdhook_fn.latent.probing import fit_probes
        >>> x, y = torch.randn(20, 3), torch.randn(20)
        >>> decision_function(fit_probes(x, y), x).shape
        torch.Size([20])
    """
    return _apply("decision_function", probes, acts, _decision)


def predict_probes(probes: TensorDictBase, acts: TensorDictBase | torch.Tensor) -> TensorDict | torch.Tensor:
    """The probes' predictions: a class (argmax, or the sign of one column, as scikit-learn) or regression values.

    Args:
        probes (TensorDict): what `fit_probes` returned.
        acts (TensorDict | Tensor): activations shaped as those fitted on, any number of samples.

    Returns:
        TensorDict | Tensor: by site ``(M,)`` classes (``(M,)`` or ``(M, K)`` for a
        regression); for a tensor ``acts`` with the leading dims in front.

    Examples:
        >>> import torch
        >>> from tdhook_fn.latent.probing import fit_probes
        >>> x = torch.linspace(-3, 3, 30)[:, None] * torch.tensor([1.0, 0.5])
        >>> labels = torch.where(x[:, 0] > 0, 7, 3)
        >>> predict_probes(fit_probes(x, labels, alpha=0.01), x[[0, 1, -2, -1]])
        tensor([3, 3, 7, 7])
    """
    return _apply("predict_probes", probes, acts, _predict)


def score_probes(
    probes: TensorDictBase, acts: TensorDictBase | torch.Tensor, labels: torch.Tensor
) -> TensorDict | torch.Tensor:
    """Accuracy of classifier probes, R^2 of regression probes (averaged over outputs), as scikit-learn's ``score``.

    Args:
        probes (TensorDict): what `fit_probes` returned.
        acts (TensorDict | Tensor): activations of ``M`` samples.
        labels (Tensor): their ``(M,)`` classes or ``(M,)`` / ``(M, K)`` targets.

    Returns:
        TensorDict | Tensor: a scalar by site, or ``(...)`` for a tensor ``acts``.

    Examples:
        >>> import torch
        >>> from tdhook_fn.latent.probing import fit_probes
        >>> x = torch.randn(40, 3)
        >>> y = x @ torch.tensor([1.0, -2.0, 0.5])
        >>> round(score_probes(fit_probes(x, y, alpha=1e-6), x, y).item(), 4)
        1.0
    """

    def score(probe: TensorDictBase, x: torch.Tensor, batch_dims: int) -> torch.Tensor:
        if labels.shape[0] != x.shape[-2]:
            raise ValueError(f"score_probes: labels has {labels.shape[0]} samples, acts {x.shape[-2]}")
        predicted = _predict(probe, x, batch_dims)
        if "classes" in probe.keys():
            return (predicted == labels.to(predicted.dtype)).to(x.dtype).mean(-1)
        multi = probe.get("weight").ndim - batch_dims == 2
        return _r2(predicted, labels.to(predicted.dtype), multi)

    return _apply("score_probes", probes, acts, score)


def _r2(predicted: torch.Tensor, target: torch.Tensor, multi: bool) -> torch.Tensor:
    """scikit-learn's ``r2_score``: per output ``1 - SS_res / SS_tot`` (1 or 0 when ``SS_tot = 0``), averaged."""
    dim = -2 if multi else -1  # the samples
    ss_res = ((predicted - target) ** 2).sum(dim)
    ss_tot = ((target - target.mean(dim, keepdim=True)) ** 2).sum(dim).expand_as(ss_res)
    safe = torch.where(ss_tot > 0, ss_tot, torch.ones_like(ss_tot))
    constant = (ss_res <= 0).to(ss_res.dtype)  # a constant target: 1 if predicted exactly, else 0
    r2 = torch.where(ss_tot > 0, 1 - ss_res / safe, constant)
    return r2.mean(-1) if multi else r2
