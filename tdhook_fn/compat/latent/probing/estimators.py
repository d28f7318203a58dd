"""Estimators of ``tdhook.latent.probing.estimators`` (tdhook 0.1.3).

`MeanDifferenceClassifier` (numpy in, numpy out) fits with
`tdhook_fn.latent.probing.fit_probes` (``kind="mean_difference"``) and scores with its
``decision_function``. The torch estimators are modules holding the
same parameters as tdhook's (``linear``, ``bilinear``, ``linear1``/``linear2``/``bias``,
initialised the same way); their scores and their training are the pure functions of
`tdhook_fn.latent._probe_training`: ``fit`` runs tdhook's minibatch Adam (same
batches, same shuffling drawn from torch's global generator as tdhook's ``DataLoader``
draws it, same update) without the loader, so with the same seed it gives tdhook's
parameters, faster.

Differences from tdhook 0.1.3: `MeanDifferenceClassifier.fit` refuses labels other than
0 and 1 (tdhook weights the samples by the label values and returns a meaningless
direction), and an ``X`` whose rows do not match ``y``; a fitted ``intercept_`` may be
``-0.0`` where tdhook's is ``0.0``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torch import nn

from tdhook_fn.latent._probe_proba import two_class_proba
from tdhook_fn.latent._probe_training import adam_epoch, adam_init, probe_loss, probe_scores
from tdhook_fn.latent.probing import decision_function, fit_probes

__all__ = [
    "BilinearEstimator",
    "LinearEstimator",
    "LowRankBilinearEstimator",
    "MeanDifferenceClassifier",
    "TorchEstimator",
]


class MeanDifferenceClassifier:
    """A linear classifier along the difference of the two class means.

    Args:
        normalize (bool): scale the direction to unit norm (unless it is zero), so the
            decision value is a signed distance. Default: ``True``.

    Examples:
        >>> import numpy as np
        >>> clf = MeanDifferenceClassifier()
        >>> clf.fit(np.array([[1.0, 0.0], [2.0, 0.0], [-1.0, 0.0], [-2.0, 0.0]]), np.array([1, 1, 0, 0]))
        >>> clf.coef_, clf.predict(np.array([[0.5, 3.0]]))
        (array([[1., 0.]]), array([ True]))
    """

    def __init__(self, normalize: bool = True) -> None:
        self._normalize = normalize
        self._coef: np.ndarray | torch.Tensor | None = None
        self._intercept: np.ndarray | None = None

    @property
    def coef_(self) -> np.ndarray | torch.Tensor:
        """``(1, D)``: a tensor where ``fit`` was given one (as tdhook's arithmetic leaves it), else an array."""
        if self._coef is None:
            raise ValueError("Model not fitted: call fit(X, y) first")
        return self._coef

    @property
    def intercept_(self) -> np.ndarray:
        if self._intercept is None:
            raise ValueError("Model not fitted: call fit(X, y) first")
        return self._intercept

    def fit(self, X: Any, y: Any) -> None:
        """Fit on samples ``X`` ``(N, D)`` and labels ``y`` ``(N,)`` in {0, 1}."""
        labels = torch.as_tensor(np.asarray(y))
        if labels.dim() > 1:
            raise ValueError("Multiclass classification not supported: y must be (N,) labels in {0, 1}")
        present = set(torch.unique(labels).tolist())
        if not present <= {0, 1}:
            raise ValueError(f"MeanDifferenceClassifier: y must hold 0/1 labels, got {sorted(present)}; map the "
                             "positive class to 1 and the other to 0")
        if len(present) < 2:
            raise ValueError("Both classes must be present in y: it needs samples labelled 0 and samples labelled 1")
        samples = np.asarray(X)
        # tdhook weighs the samples by the labels as numpy does: float32 samples and integer labels in float64
        dtype = torch.as_tensor(np.empty(0, np.result_type(samples.dtype, np.asarray(y).dtype))).dtype
        # 0/1 labels: classes [0, 1], so fit_probes' positive class is tdhook's
        probe = fit_probes(torch.as_tensor(samples).to(dtype), labels.long(), kind="mean_difference",
                           classes=torch.tensor([0, 1]), normalize=self._normalize)
        self._coef = probe["weight"] if isinstance(X, torch.Tensor) else probe["weight"].numpy()
        self._intercept = probe["bias"].numpy()

    def _decision_function(self, X: Any) -> torch.Tensor:
        weight, x = torch.as_tensor(self.coef_), torch.as_tensor(np.asarray(X))
        dtype = torch.promote_types(weight.dtype, x.dtype)  # (tdhook's product: float32 samples, float64 direction)
        probe = TensorDict(weight=weight.to(dtype), bias=torch.as_tensor(self.intercept_).to(dtype))
        scores = decision_function(probe, x.to(dtype))
        assert isinstance(scores, torch.Tensor)
        return scores[..., 0]

    def predict(self, X: Any) -> np.ndarray | torch.Tensor:
        """``True`` for the samples on the positive side: a bool tensor for a tensor ``X`` (as tdhook's), else an
        array."""
        positive = self._decision_function(X) > 0
        if isinstance(X, torch.Tensor):
            return positive
        result: np.ndarray = positive.numpy()
        return result

    def predict_proba(self, X: Any) -> np.ndarray:
        """``(N, 2)``: the sigmoid of the decision value, for the negative then the positive class."""
        result: np.ndarray = two_class_proba(self._decision_function(X)).numpy()
        return result


def _global_order(n: int) -> torch.Tensor:
    # NOTE [loader shuffling]: tdhook's DataLoader(shuffle=True) draws, per epoch, the
    # iterator's base seed then the sampler's seed from torch's global generator, and
    # shuffles with a generator seeded by the second. Drawing the same keeps a seeded
    # run's batches (and so its fit) tdhook's.
    torch.empty((), dtype=torch.int64).random_()
    seed = int(torch.empty((), dtype=torch.int64).random_().item())
    generator = torch.Generator()
    generator.manual_seed(seed)
    return torch.randperm(n, generator=generator)


class TorchEstimator(nn.Module):
    """Base of the torch estimators: ``fit`` by minibatch Adam, ``predict``.

    Args:
        num_classes (int | None): ``None`` for regression (mean squared error), else the
            number of classes (cross-entropy; ``predict`` gives the argmax). Default: ``None``.
        epochs (int): passes over the data. Default: 100.
        lr (float): Adam's learning rate. Default: 1e-3.
        batch_size (int): the minibatch size. Default: 128.
        device (torch.device | None): where the parameters live.
        verbose (bool): print the epoch every 10 epochs. Default: ``False``.
    """

    def __init__(
        self,
        *,
        num_classes: int | None = None,
        epochs: int = 100,
        lr: float = 1e-3,
        batch_size: int = 128,
        device: torch.device | None = None,
        verbose: bool = False,
    ) -> None:
        super().__init__()
        self._num_classes = num_classes
        self._epochs = epochs
        self._lr = lr
        self._batch_size = batch_size
        self._device = device
        self._verbose = verbose

    def fit(self, *Xs: torch.Tensor, y: torch.Tensor) -> TorchEstimator:
        """Train on inputs ``Xs`` (``(N, D)`` each) and targets ``y``; returns self."""
        if any(x.shape[0] != y.shape[0] for x in Xs):
            raise ValueError(
                f"fit: every input needs one row per target, got inputs of {[x.shape[0] for x in Xs]} rows for "
                f"{y.shape[0]} targets"
            )
        model, params = self._trained()
        own_loss = type(self)._loss_fn is TorchEstimator._loss_fn
        state = adam_init(params)
        self.train()
        for epoch in range(self._epochs):
            params, state = adam_epoch(
                model, params, state, Xs, y, _global_order(y.shape[0]), num_classes=self._num_classes,
                loss=None if own_loss else self._loss_fn, lr=self._lr, batch_size=self._batch_size)
            if self._verbose and (epoch + 1) % 10 == 0:
                print(f"Epoch {epoch + 1}/{self._epochs}")
        with torch.no_grad():
            for name, value in self.named_parameters():
                if name in params:  # trained; a frozen one is left as it is
                    value.copy_(params[name])
        return self

    def _trained(self) -> tuple[str | Callable[..., torch.Tensor], dict[str, torch.Tensor]]:
        """What ``fit`` trains: the probe kind of our own forwards, else this module's forward, and its tensors.

        A subclass with a forward of its own, or with frozen parameters, trains through
        ``torch.func.functional_call`` of itself, as tdhook trains it through ``self(...)``.
        """
        trainable = {name: value.detach() for name, value in self.named_parameters() if value.requires_grad}
        kind = _KINDS.get(type(self).forward)
        if kind is not None and len(trainable) == len(list(self.parameters())):
            return kind, trainable
        return functools.partial(_call_module, self), trainable

    def predict(self, *Xs: torch.Tensor) -> torch.Tensor:
        """The scores (regression) or the predicted classes."""
        self.eval()
        with torch.no_grad():
            scores: torch.Tensor = self(*Xs)
            return scores.argmax(dim=-1) if self._num_classes is not None else scores

    def _loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return probe_loss(output, target, num_classes=self._num_classes)


class LinearEstimator(TorchEstimator):
    """A linear probe, ``W h + b``.

    Args:
        d_latent (int): the input width.
        bias (bool): with ``b``. Default: ``True``.
        **kwargs (Any): see `TorchEstimator`.

    Examples:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> est = LinearEstimator(d_latent=3, num_classes=2, epochs=5)
        >>> est.fit(torch.randn(20, 3), y=torch.randint(0, 2, (20,))).predict(torch.randn(4, 3)).shape
        torch.Size([4])
    """

    def __init__(self, d_latent: int, bias: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.linear = nn.Linear(d_latent, self._num_classes or 1, bias=bias, device=self._device)

    def forward(self, *Xs: torch.Tensor) -> torch.Tensor:
        if len(Xs) != 1:
            raise ValueError(f"Linear estimator expects 1 input tensor, got {len(Xs)}")
        return probe_scores("linear", dict(self.named_parameters()), *Xs)


class BilinearEstimator(TorchEstimator):
    """A bilinear probe, ``h1^T A h2 + b``.

    Args:
        d_latent1 (int): the width of ``h1``.
        d_latent2 (int): the width of ``h2``.
        bias (bool): with ``b``. Default: ``True``.
        **kwargs (Any): see `TorchEstimator`.
    """

    def __init__(self, d_latent1: int, d_latent2: int, bias: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bilinear = nn.Bilinear(d_latent1, d_latent2, self._num_classes or 1, bias=bias, device=self._device)

    def forward(self, h1: torch.Tensor, h2: torch.Tensor) -> torch.Tensor:
        return probe_scores("bilinear", dict(self.named_parameters()), h1, h2)


class LowRankBilinearEstimator(TorchEstimator):
    """A rank-one-per-output bilinear probe, ``(U h1) * (V h2) + b``.

    Args:
        d_latent1 (int): the width of ``h1``.
        d_latent2 (int): the width of ``h2``.
        bias (bool): with ``b``. Default: ``True``.
        **kwargs (Any): see `TorchEstimator`.
    """

    def __init__(self, d_latent1: int, d_latent2: int, bias: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        out_features = self._num_classes or 1
        self.linear1 = nn.Linear(d_latent1, out_features, device=self._device)
        self.linear2 = nn.Linear(d_latent2, out_features, device=self._device)
        self.bias: nn.Parameter | None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=self._device))
        else:
            self.register_parameter("bias", None)

    def forward(self, h1: torch.Tensor, h2: torch.Tensor) -> torch.Tensor:
        return probe_scores("low_rank_bilinear", dict(self.named_parameters()), h1, h2)


def _call_module(module: nn.Module, params: dict[str, torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    """``module(*xs)`` with ``params`` in place of its (trainable) parameters."""
    out: torch.Tensor = torch.func.functional_call(module, params, xs, strict=False)
    return out


# the probe kind `probe_scores` computes for each of our forwards (a subclass overriding it trains its own)
_KINDS: dict[Callable[..., torch.Tensor], str] = {
    LinearEstimator.forward: "linear",
    BilinearEstimator.forward: "bilinear",
    LowRankBilinearEstimator.forward: "low_rank_bilinear",
}
