"""Ridge probes from sufficient statistics: accumulate them a batch at a time, merge, solve once."""

from __future__ import annotations

from typing import cast

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey

from ._probe_fit import Params, fit_sites
from ._probe_inputs import Labels, Task, check_alpha, site_name, transformed
from ._probe_ridge import merge, solve, statistics

__all__ = ["merge_ridge_statistics", "ridge_statistics", "solve_ridge"]

_FIELDS = ("count", "mean_x", "mean_y", "cxx", "cxy")


def ridge_statistics(
    acts: TensorDictBase | torch.Tensor,
    labels: torch.Tensor,
    *,
    task: Task = "auto",
    classes: torch.Tensor | None = None,
) -> TensorDict:
    """The sufficient statistics of a ridge probe per site, for data seen a batch at a time.

    `merge_ridge_statistics` combines two batches' statistics exactly and `solve_ridge`
    turns them into the probes `fit_probes` gives on all the samples at once. Classes must
    be the same in every batch: give ``classes`` when a batch may miss one.

    Args:
        acts (TensorDict | Tensor): as for `fit_probes`.
        labels (Tensor): as for `fit_probes`.
        task (str): as for `fit_probes`. Default: ``"auto"``.
        classes (Tensor | None): the sorted classes of the whole dataset. Default: read
            from ``labels``.

    Returns:
        TensorDict: by site ``count ()``, ``mean_x (D,)``, ``mean_y (K,)``, centred
        cross-products ``cxx (D, D)`` and ``cxy (D, K)`` (``mean_y ()``, ``cxy (D,)`` for
        a regression on ``(N,)`` labels), and ``classes`` for a classifier.

    Examples:
        >>> import torch
        >>> from tdhook_fn.latent.probing import fit_probes
        >>> x, y = torch.randn(100, 5, dtype=torch.float64), torch.randint(0, 3, (100,))
        >>> stats = merge_ridge_statistics(ridge_statistics(x[:60], y[:60], classes=torch.arange(3)),
        ...                                ridge_statistics(x[60:], y[60:], classes=torch.arange(3)))
        >>> torch.allclose(solve_ridge(stats)["weight"], fit_probes(x, y)["weight"])
        True
    """
    return fit_sites("ridge_statistics", acts, labels, _statistics, task=task, classes=classes)


def _statistics(x: torch.Tensor, labels: Labels, keys: list[str]) -> Params:
    return _squeezed(statistics(x, labels.targets(x.dtype)), labels.single_output)


def merge_ridge_statistics(a: TensorDictBase, b: TensorDictBase) -> TensorDict:
    """The statistics of the samples of ``a`` and ``b`` together (exact: a pairwise update of the centred sums).

    Args:
        a (TensorDict): statistics from `ridge_statistics` (or an earlier merge).
        b (TensorDict): statistics of other samples at the same sites.

    Returns:
        TensorDict: shaped as ``a``.

    Examples:
        >>> import torch
        >>> x, y = torch.randn(10, 2), torch.randn(10)
        >>> merged = merge_ridge_statistics(ridge_statistics(x[:4], y[:4]), ridge_statistics(x[4:], y[4:]))
        >>> merged["count"].item()
        10.0
    """
    caller = "merge_ridge_statistics"
    out = TensorDict({}, batch_size=a.batch_size)
    b_sites = set(_sites(caller, b, "b"))
    for key in _sites(caller, a, "a"):
        if key not in b_sites:
            raise ValueError(f"{caller}: site {site_name(key)!r} is in a but not in b")
        left, right = _site(a, key), _site(b, key)
        for field in _FIELDS:
            if left.get(field).shape != right.get(field).shape:
                raise ValueError(f"{caller}: site {site_name(key)!r}: {field} is {tuple(left.get(field).shape)} in a, "
                                 f"{tuple(right.get(field).shape)} in b; merge statistics of the same sites and labels")
        has_classes = "classes" in left.keys()
        if has_classes != ("classes" in right.keys()) or (
            has_classes and not transformed() and not torch.equal(left.get("classes"), right.get("classes"))
        ):
            raise ValueError(f"{caller}: site {site_name(key)!r}: a and b have different classes; give "
                             "ridge_statistics the dataset's classes= for every batch")
        (a_fields, single), (b_fields, _) = _fields(left), _fields(right)
        merged = _squeezed(merge(a_fields, b_fields), single)
        if has_classes:
            merged["classes"] = left.get("classes")
        site = TensorDict(merged, batch_size=left.batch_size)
        if key == ():
            return site
        out.set(key, site)
    return out


def solve_ridge(
    stats: TensorDictBase, *, alpha: float | torch.Tensor = 1.0, fit_intercept: bool = True
) -> TensorDict:
    """Ridge probes from statistics, every site of one width in one batched Cholesky solve.

    Args:
        stats (TensorDict): from `ridge_statistics` / `merge_ridge_statistics`.
        alpha (float | Tensor): the penalty, as for `fit_probes`. Default: ``1.0``.
        fit_intercept (bool): fit an unpenalised bias. Default: ``True``.

    Returns:
        TensorDict: the probes, as `fit_probes` returns them.

    Examples:
        >>> import torch
        >>> x, y = torch.randn(10, 2), torch.randn(10)
        >>> solve_ridge(ridge_statistics(x, y), alpha=0.5)["weight"].shape
        torch.Size([2])
    """
    caller = "solve_ridge"
    keys = _sites(caller, stats, "stats")
    check_alpha(caller, alpha, keys != [()])
    if keys == [()]:
        return _solve(caller, stats, alpha, fit_intercept, [], stats.batch_dims)
    stacks: dict[tuple[object, ...], list[NestedKey]] = {}
    for key in keys:
        site = _site(stats, key)
        shape = tuple((k, v.shape, v.dtype, v.device) for k, v in sorted(site.items()))
        stacks.setdefault(shape, []).append(key)
    out = TensorDict({}, batch_size=[])
    for group in stacks.values():
        stacked = cast(TensorDictBase, torch.stack([_site(stats, k) for k in group]))
        solved = _solve(caller, stacked, alpha, fit_intercept, [site_name(k) for k in group], 1)
        for key, site in zip(group, solved.unbind(0), strict=True):
            out.set(key, site)
    return out


def _solve(caller: str, stats: TensorDictBase, alpha: float | torch.Tensor, fit_intercept: bool, keys: list[str],
           batch_dims: int) -> TensorDict:
    fields, single = _fields(stats)
    weight, bias = solve(caller, fields, alpha, fit_intercept, keys)
    out = TensorDict({"weight": weight[..., 0, :] if single else weight, "bias": bias[..., 0] if single else bias},
                     batch_size=stats.batch_size)
    if "classes" in stats.keys():
        out.set("classes", stats.get("classes"))
    return out


def _fields(site: TensorDictBase) -> tuple[Params, bool]:
    """A site's statistics with ``K`` dims, and whether it had none (a regression on ``(N,)`` labels)."""
    fields: Params = {f: site.get(f) for f in _FIELDS}
    single = fields["mean_y"].ndim == site.batch_dims
    if single:
        fields["mean_y"], fields["cxy"] = fields["mean_y"][..., None], fields["cxy"][..., None]
    return fields, single


def _squeezed(fields: Params, single: bool) -> Params:
    if single:
        fields["mean_y"], fields["cxy"] = fields["mean_y"][..., 0], fields["cxy"][..., 0]
    return fields


def _sites(caller: str, stats: TensorDictBase, name: str) -> list[NestedKey]:
    """The keys of the sites in ``stats`` (``[()]`` for the statistics of a tensor)."""
    if not isinstance(stats, TensorDictBase):
        raise TypeError(f"{caller}: {name} must be what ridge_statistics returned, got {type(stats).__name__}")
    if "cxx" in stats.keys():
        return [()]
    found: list[NestedKey] = []
    for key in stats.keys(include_nested=True, leaves_only=True):
        path = (key,) if isinstance(key, str) else tuple(key)
        if path[-1] == "cxx":
            found.append(path[0] if len(path) == 2 else path[:-1])
    if not found:
        raise ValueError(f"{caller}: {name} holds no statistics (no 'cxx'); give what ridge_statistics returned")
    return found


def _site(stats: TensorDictBase, key: NestedKey) -> TensorDictBase:
    return stats if key == () else cast(TensorDictBase, stats.get(key))
