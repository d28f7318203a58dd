"""Linear probes trained by gradient descent, as tdhook's ``LinearEstimator``: a bilinear probe against a constant."""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase

from ._probe_bilinear import fit_bilinear_probes
from ._probe_inputs import Task

__all__ = ["train_linear_probes"]


def train_linear_probes(
    acts: TensorDictBase | torch.Tensor,
    labels: torch.Tensor,
    *,
    fit_intercept: bool = True,
    task: Task = "auto",
    classes: torch.Tensor | None = None,
    epochs: int = 100,
    lr: float = 1e-3,
    batch_size: int = 128,
    seed: int = 0,
) -> TensorDict:
    """Linear probes ``W x + b`` trained by Adam on cross-entropy (classes) or squared error, every site at once.

    tdhook's ``LinearEstimator``: ``nn.Linear``'s initial ranges, Adam with torch's defaults,
    ``epochs`` passes over shuffled mini-batches, one output per class (or per regression
    target). It is `fit_bilinear_probes` against a constant second input (``x^T A 1`` is
    ``(A 1) . x``), so its draws, seeding and stacking are those. For the probes that
    minimise the objective exactly, use `fit_probes` (``kind="logistic"`` or ``"ridge"``).

    Args:
        acts (TensorDict | Tensor): as for `fit_probes`.
        labels (Tensor): ``(N,)`` classes or ``(N,)`` / ``(N, K)`` regression targets.
        fit_intercept (bool): an output bias. Default: ``True``.
        task (str): as for `fit_probes`. Default: ``"auto"``.
        classes (Tensor | None): as for `fit_probes`. Default: read from ``labels``.
        epochs (int): passes over the data. Default: ``100``.
        lr (float): Adam's learning rate. Default: ``1e-3``.
        batch_size (int): samples per step. Default: ``128``.
        seed (int): seeds the initial weights and the shuffling. Default: ``0``.

    Returns:
        TensorDict: as `fit_probes`'s, with ``weight (K, D)`` and ``bias (K,)``, ``K`` the
        number of classes (two for two classes) or of targets; `predict_probes` applies it.

    Examples:
        >>> import torch
        >>> from tdhook_fn.latent.probing import predict_probes
        >>> x = torch.linspace(-2, 2, 40)[:, None].repeat(1, 3)
        >>> labels = (x[:, 0] > 0).long()
        >>> probes = train_linear_probes(x, labels, epochs=50, lr=0.1, batch_size=10)
        >>> probes["weight"].shape, predict_probes(probes, x[[0, -1]]).tolist()
        (torch.Size([2, 3]), [0, 1])
    """
    if isinstance(acts, torch.Tensor):
        constant: TensorDictBase | torch.Tensor = torch.ones(*acts.shape[:-1], 1, dtype=acts.dtype, device=acts.device)
    elif isinstance(acts, TensorDictBase):
        constant = TensorDict({k: _ones(acts.get(k)) for k in acts.keys(include_nested=True, leaves_only=True)})
    else:
        raise TypeError(f"train_linear_probes: acts must be a TensorDict of sites or a tensor, got "
                        f"{type(acts).__name__}")
    probes = fit_bilinear_probes(acts, constant, labels, fit_intercept=fit_intercept, task=task, classes=classes,
                                 epochs=epochs, lr=lr, batch_size=batch_size, seed=seed)
    for key in list(probes.keys(include_nested=True, leaves_only=True)):
        path = (key,) if isinstance(key, str) else tuple(key)
        if path[-1] == "weight":
            probes.set(key, probes.get(key)[..., 0])
    return probes


def _ones(value: torch.Tensor) -> torch.Tensor:
    return torch.ones(value.shape[0], 1, dtype=value.dtype, device=value.device)
