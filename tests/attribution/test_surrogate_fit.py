"""The batched surrogate fits against scikit-learn's Lasso, Ridge and LinearRegression, model by model."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from sklearn.linear_model import Lasso, LinearRegression, Ridge

from tdhook_fn.attribution._surrogate_fit import lasso, least_squares, ridge


def problem(batch: int, n: int, n_features: int, targets: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Binary interpretable samples, outputs with a sparse signal plus noise, positive weights (float64)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.bernoulli(torch.full((batch, n, n_features), 0.5, dtype=torch.float64), generator=g)
    signal = x[..., :3] @ torch.tensor([0.5, -0.3, 0.2], dtype=torch.float64)
    y = signal.unsqueeze(-1) + 0.2 * torch.randn(batch, n, targets, dtype=torch.float64, generator=g)
    w = torch.rand(batch, n, dtype=torch.float64, generator=g) + 0.05
    return x, y, w


def sklearn_coefs(make, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = np.zeros((x.shape[0], y.shape[-1], x.shape[-1]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for b in range(x.shape[0]):
            for t in range(y.shape[-1]):
                out[b, t] = make().fit(x[b].numpy(), y[b, :, t].numpy(), sample_weight=w[b].numpy()).coef_
    return torch.from_numpy(out)


@pytest.mark.parametrize(("n", "n_features", "alpha"), [(40, 6, 0.01), (25, 64, 0.01), (100, 64, 0.01),
                                                          (300, 40, 0.05), (50, 16, 0.001), (30, 10, 1.0)])
def test_lasso_is_sklearns_optimum(n: int, n_features: int, alpha: float) -> None:
    x, y, w = problem(3, n, n_features, 2, seed=n + n_features)
    expected = sklearn_coefs(lambda: Lasso(alpha=alpha, tol=1e-15, max_iter=10**6), x, y, w)
    torch.testing.assert_close(lasso(x, y, w, alpha), expected, rtol=0, atol=1e-11)


@pytest.mark.parametrize(("n", "n_features"), [(40, 6), (10, 16)])
def test_least_squares_is_sklearns_linear_regression(n: int, n_features: int) -> None:
    """Also rank-deficient (fewer samples than features: the minimum-norm solution)."""
    x, y, w = problem(3, n, n_features, 2, seed=n)
    expected = sklearn_coefs(LinearRegression, x, y, w)
    torch.testing.assert_close(least_squares(x, y, w), expected, rtol=0, atol=1e-9)


def test_least_squares_of_six_systems_of_size_160() -> None:
    """Where torch's batched CPU linalg.solve goes wrong: the weighted normal equations hold for every system."""
    x, y, w = problem(6, 400, 160, 2, seed=5)
    coefs = least_squares(x, y, w)
    p = w / w.sum(-1, keepdim=True)
    xc = x - (p.unsqueeze(-2) @ x)
    yc = y - (p.unsqueeze(-2) @ y)
    gradient = (xc * p.unsqueeze(-1)).mT @ (yc - xc @ coefs.mT)  # zero at the least-squares solution
    assert float(gradient.abs().max()) < 1e-12


@pytest.mark.parametrize("alpha", [0.1, 1.0, 10.0])
def test_ridge_is_sklearns(alpha: float) -> None:
    x, y, w = problem(3, 30, 8, 2, seed=1)
    expected = sklearn_coefs(lambda: Ridge(alpha=alpha), x, y, w)
    torch.testing.assert_close(ridge(x, y, w, alpha), expected, rtol=0, atol=1e-11)


def test_kernel_shap_end_weights_in_float32() -> None:
    """Weights 1e6 on two rows: float32 least squares stays near the float64 solution (no normal equations)."""
    x, y, _ = problem(4, 30, 6, 1, seed=2)
    w = torch.ones(4, 30, dtype=torch.float64)
    x[:, 0], x[:, 1], w[:, :2] = 1, 0, 1e6
    expected = least_squares(x, y, w)
    torch.testing.assert_close(least_squares(x.float(), y.float(), w.float()).double(), expected, rtol=0, atol=2e-4)


@pytest.mark.parametrize("fit", ["lasso", "least_squares"])
def test_identical_calls_give_identical_bits(fit: str) -> None:
    x, y, w = problem(3, 25, 5, 1, seed=3)
    x, y, w = x.float(), y.float(), w.float()
    run = (lambda: lasso(x, y, w, 0.01)) if fit == "lasso" else (lambda: least_squares(x, y, w))
    first = run()
    for _ in range(20):
        assert torch.equal(run(), first)


def test_lasso_under_vmap_equals_the_batched_fit() -> None:
    x, y, w = problem(3, 40, 6, 2, seed=4)
    batched = lasso(x, y, w, 0.01)
    per_sample = torch.vmap(lambda a, b, c: lasso(a, b, c, 0.01))(x, y, w)
    torch.testing.assert_close(per_sample, batched, rtol=0, atol=1e-12)
