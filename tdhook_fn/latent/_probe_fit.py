"""Fitting linear probes on every site at once: ridge, logistic, mean difference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from tensordict import TensorDict, TensorDictBase

from ._probe_inputs import (
    Labels,
    Task,
    as_labels,
    check_alpha,
    check_finite,
    check_tensor_acts,
    groups,
    site_name,
    transformed,
)
from ._probe_logistic import logistic
from ._probe_mean_difference import mean_difference
from ._probe_ridge import dual_solve, solve, statistics

__all__ = ["Params", "fit_probes", "fit_sites"]

Kind = Literal["ridge", "logistic", "mean_difference"]
Params = dict[str, torch.Tensor]
Fit = Callable[[torch.Tensor, Labels, list[str]], Params]


def fit_probes(
    acts: TensorDictBase | torch.Tensor,
    labels: torch.Tensor,
    *,
    kind: Kind = "ridge",
    alpha: float | torch.Tensor = 1.0,
    C: float = 1.0,
    fit_intercept: bool = True,
    task: Task = "auto",
    classes: torch.Tensor | None = None,
    normalize: bool = True,
    max_iter: int = 100,
    tol: float = 1e-8,
) -> TensorDict:
    """One linear probe per site, all sites fitted together.

    ``kind="ridge"`` is scikit-learn's ``Ridge`` on regression targets and ``RidgeClassifier``
    on classes (targets +-1 one-vs-all, one column for two classes); ``"logistic"`` is
    ``LogisticRegression`` (L2 penalty ``1 / C``, multinomial for more than two classes);
    ``"mean_difference"`` is tdhook's ``MeanDifferenceClassifier`` (two classes). Intercepts
    are not penalised. Sites of one width are stacked and solved in one batched Cholesky,
    on the ``D x D`` normal equations or, with fewer samples than features, the ``N x N`` ones.

    Args:
        acts (TensorDict | Tensor): a TensorDict with one ``(N, ...)`` tensor per site
            (flattened to ``(N, D)``; widths may differ), or a tensor ``(..., N, D)`` whose
            leading dims are batch dims (one probe each).
        labels (Tensor): ``(N,)`` classes (any sortable values), or ``(N,)`` / ``(N, K)``
            regression targets, shared by every site.
        kind (str): ``"ridge"``, ``"logistic"`` or ``"mean_difference"``. Default: ``"ridge"``.
        alpha (float | Tensor): ridge penalty, a float or a tensor over the leading dims of a
            tensor ``acts`` (with a TensorDict of sites, one value). Default: ``1.0``.
        C (float): inverse penalty of ``"logistic"``, as scikit-learn's. Default: ``1.0``.
        fit_intercept (bool): fit an unpenalised bias (``mean_difference`` always has one).
            Default: ``True``.
        task (str): ``"classification"``, ``"regression"`` or ``"auto"``: integer or bool
            labels are classes, floating ones regression targets. Default: ``"auto"``.
        classes (Tensor | None): the sorted classes; needed under ``vmap``, or when a label is
            missing from this data. Default: read from ``labels``.
        normalize (bool): ``mean_difference`` divides by the norm of its weight. Default: ``True``.
        max_iter (int): ``logistic``'s most Newton steps. Default: ``100``.
        tol (float): ``logistic`` stops when no coefficient moves more. Default: ``1e-8``.

    Returns:
        TensorDict: by site key, ``weight (K, D)`` and ``bias (K,)`` (``(D,)`` and ``()`` for a
        regression on ``(N,)`` labels) and, for a classifier, ``classes (C,)``; for a tensor
        ``acts`` one such TensorDict whose batch size is its leading dims.

    Raises:
        ValueError: ``kind`` unknown, labels and acts of different N, fewer than two classes,
            NaN or infinity (naming the site), a singular system with ``alpha=0``.
        TypeError: integer activations, labels not a tensor.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tdhook_fn.latent.probing import predict_probes
        >>> g = torch.Generator().manual_seed(0)
        >>> acts = TensorDict(a=torch.randn(50, 4, generator=g), b=torch.randn(50, 6, generator=g))
        >>> labels = (acts["a"][:, 0] > 0).long()
        >>> probes = fit_probes(acts, labels, alpha=0.1)
        >>> probes["a", "weight"].shape, probes["b", "weight"].shape
        (torch.Size([1, 4]), torch.Size([1, 6]))
        >>> bool((predict_probes(probes, acts)["a"] == labels).float().mean() > 0.9)
        True
        >>> stacked = torch.stack([acts["a"], acts["a"] * 2])  # (2, N, D): two probes
        >>> fit_probes(stacked, labels)["weight"].shape
        torch.Size([2, 1, 4])
    """
    caller = "fit_probes"
    if kind == "ridge":
        check_alpha(caller, alpha, isinstance(acts, TensorDictBase))
    fit = _fitter(caller, kind, alpha=alpha, C=C, fit_intercept=fit_intercept, normalize=normalize,
                  max_iter=max_iter, tol=tol)
    min_classes = 2
    if kind in ("logistic", "mean_difference") and task == "regression":
        raise ValueError(f"{caller}: kind={kind!r} is a classifier; give class labels with task='classification'")
    task = "classification" if kind in ("logistic", "mean_difference") else task
    return fit_sites(caller, acts, labels, fit, task=task, classes=classes, min_classes=min_classes,
                     exact_classes=2 if kind == "mean_difference" else None)


def _fitter(caller: str, kind: str, *, alpha: float | torch.Tensor, C: float, fit_intercept: bool,
            normalize: bool, max_iter: int, tol: float) -> Fit:
    """The maths of ``kind`` on one stack of sites, its options checked."""
    if kind == "ridge":
        def ridge(x: torch.Tensor, labels: Labels, keys: list[str]) -> Params:
            y = labels.targets(x.dtype)
            if x.shape[-2] < x.shape[-1]:
                weight, bias = dual_solve(caller, x, y, alpha, fit_intercept, keys)
            else:
                weight, bias = solve(caller, statistics(x, y), alpha, fit_intercept, keys)
            if labels.single_output:
                return {"weight": weight[..., 0, :], "bias": bias[..., 0]}
            return {"weight": weight, "bias": bias}

        return ridge
    if kind == "logistic":
        if not C > 0 or C == float("inf"):
            raise ValueError(f"{caller}: C must be a positive finite float, got {C}")
        if max_iter < 1:
            raise ValueError(f"{caller}: max_iter must be >= 1, got {max_iter}")

        def fit_logistic(x: torch.Tensor, labels: Labels, keys: list[str]) -> Params:
            assert labels.classes is not None and labels.index is not None
            weight, bias = logistic(caller, x, labels.index, labels.classes.shape[0], C=C,
                                    fit_intercept=fit_intercept, max_iter=max_iter, tol=tol, keys=keys)
            return {"weight": weight, "bias": bias}

        return fit_logistic
    if kind == "mean_difference":

        def fit_mean_difference(x: torch.Tensor, labels: Labels, keys: list[str]) -> Params:
            assert labels.index is not None and labels.classes is not None
            if not transformed():  # (a class without samples has no mean: the probe would be nan)
                counts = torch.bincount(labels.index, minlength=2)
                if not bool(counts.all()):
                    raise ValueError(
                        f"{caller}: kind='mean_difference' needs samples of both classes, but class "
                        f"{labels.classes[int(counts.argmin())].item()!r} has none in these labels; fit it on data "
                        "holding both")
            weight, bias = mean_difference(x, labels.index, normalize)
            return {"weight": weight, "bias": bias}

        return fit_mean_difference
    raise ValueError(f"{caller}: kind must be 'ridge', 'logistic' or 'mean_difference', got {kind!r}")


def fit_sites(
    caller: str,
    acts: TensorDictBase | torch.Tensor,
    labels: torch.Tensor,
    fit: Fit,
    *,
    task: Task,
    classes: torch.Tensor | None,
    min_classes: int = 2,
    exact_classes: int | None = None,
) -> TensorDict:
    """Run ``fit`` on each stack of sites of ``acts`` (or on a tensor) and gather the probes by site."""
    if isinstance(acts, torch.Tensor):
        check_tensor_acts(caller, acts)
        read = _labels(caller, labels, acts.shape[-2], task, classes, min_classes, exact_classes)
        check_finite(caller, acts, [])
        return _as_td(fit(acts, read, []), read, acts.shape[:-2])
    if not isinstance(acts, TensorDictBase):
        raise TypeError(f"{caller}: acts must be a TensorDict of sites or a tensor, got {type(acts).__name__}")
    stacks = groups(caller, acts)
    read = _labels(caller, labels, stacks[0].stacked.shape[-2], task, classes, min_classes, exact_classes)
    out = TensorDict({}, batch_size=[])
    for stack in stacks:
        names = [site_name(k) for k in stack.keys]
        check_finite(caller, stack.stacked, names)
        fitted = fit(stack.stacked, read, names)
        for i, key in enumerate(stack.keys):
            out.set(key, _as_td({k: v[i] for k, v in fitted.items()}, read, torch.Size([])))
    return out


def _labels(caller: str, labels: torch.Tensor, n: int, task: Task, classes: torch.Tensor | None,
            min_classes: int, exact_classes: int | None) -> Labels:
    read = as_labels(caller, labels, n, task=task, classes=classes, min_classes=min_classes)
    if exact_classes is not None and read.classes is not None and read.classes.shape[0] != exact_classes:
        raise ValueError(f"{caller}: this probe takes exactly {exact_classes} classes, labels hold "
                         f"{read.classes.shape[0]}")
    return read


def _as_td(params: Params, labels: Labels, batch: torch.Size) -> TensorDict:
    out = TensorDict(params, batch_size=batch)
    if labels.classes is not None:
        out.set("classes", labels.classes.expand(*batch, -1))
    return out
