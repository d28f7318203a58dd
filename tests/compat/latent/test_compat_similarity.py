"""tdhook_fn.compat.latent.representation_similarity side by side with tdhook 0.1.3's estimators.

Same constructor arguments, keys, shapes, dtypes and repr; the same numbers on inputs
without ties or constant representations (where we deliberately differ: docs/compat.md).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import tdhook.latent.representation_similarity as theirs
import torch
from tensordict import TensorDict

import tdhook_fn.compat.latent.representation_similarity as ours
from tdhook_fn.latent.similarity import cka, information_imbalance

LIBS = {"tdhook": theirs, "ours": ours}


def pair(shape: tuple[int, ...], dy: int = 5, seed: int = 0, dtype: torch.dtype = torch.float32) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=dtype)
    y = torch.tanh(x[..., :3] @ torch.randn(3, dy, generator=g, dtype=dtype)) + torch.randn(
        *shape[:-1], dy, generator=g, dtype=dtype)
    return TensorDict(a=x, b=y, batch_size=shape[:-2])


def both(name: str, td: TensorDict, **kwargs: Any) -> tuple[TensorDict, TensorDict]:
    return tuple(getattr(lib, name)(in_key_a="a", in_key_b="b", **kwargs)(td.clone())  # type: ignore[return-value]
                 for lib in LIBS.values())


@pytest.mark.parametrize("shape", [(64, 8), (3, 40, 8), (2, 3, 30, 6)])
def test_cka_estimator_equals_tdhook(shape: tuple[int, ...]) -> None:
    expected, got = both("CkaEstimator", pair(shape), out_key="sim")
    assert set(got.keys()) == set(expected.keys()) == {"a", "b", "sim"}
    assert got["sim"].shape == expected["sim"].shape == shape[:-2]
    assert got["sim"].dtype == expected["sim"].dtype
    torch.testing.assert_close(got["sim"], expected["sim"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(64, 8), (3, 40, 8), (2, 3, 30, 6)])
@pytest.mark.parametrize("p", [1.0, 2.0, math.inf])
def test_information_imbalance_estimator_equals_tdhook(shape: tuple[int, ...], p: float) -> None:
    keys = {"out_key_a_to_b": "ab", "out_key_b_to_a": "ba"}
    expected, got = both("InformationImbalanceEstimator", pair(shape, seed=1), p=p, **keys)
    for key in ("ab", "ba"):
        assert got[key].shape == expected[key].shape == shape[:-2]
        assert got[key].dtype == expected[key].dtype
        torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=1e-7)


def test_compat_numbers_are_the_pure_functions() -> None:
    td = pair((3, 40, 8))
    torch.testing.assert_close(ours.CkaEstimator(in_key_a="a", in_key_b="b")(td.clone())["cka"],
                               cka(td["a"], td["b"]), rtol=0, atol=0)
    out = ours.InformationImbalanceEstimator(in_key_a="a", in_key_b="b")(td.clone())
    torch.testing.assert_close((out["information_imbalance_a_to_b"], out["information_imbalance_b_to_a"]),
                               information_imbalance(td["a"], td["b"]), rtol=0, atol=0)


def test_reprs_and_attributes_equal_tdhook() -> None:
    for name, kwargs in [("CkaEstimator", {"eps": 1e-9, "out_key": "c"}),
                         ("InformationImbalanceEstimator", {"p": 1.5, "out_key_b_to_a": "x"})]:
        a, b = (getattr(lib, name)(**kwargs) for lib in LIBS.values())
        assert repr(a) == repr(b)
        assert a.in_keys == b.in_keys and a.out_keys == b.out_keys


def test_integer_and_empty_inputs_as_tdhook() -> None:
    g = torch.Generator().manual_seed(0)  # wide random integers: no tied distances (tdhook orders ties by chance)
    ints = TensorDict(a=torch.randint(0, 10**4, (64, 4), generator=g), b=torch.randint(0, 10**4, (64, 3), generator=g))
    empty = TensorDict(a=torch.randn(2, 0, 10, 8), b=torch.randn(2, 0, 10, 6), batch_size=[2, 0])
    for name in ("CkaEstimator", "InformationImbalanceEstimator"):
        expected, got = both(name, ints)
        for key in expected.keys():
            assert got[key].dtype == expected[key].dtype
            torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=1e-7)
        expected, got = both(name, empty)
        for key in expected.keys():
            assert got[key].shape == expected[key].shape and got[key].dtype == expected[key].dtype


def test_deliberate_differences() -> None:
    """float64 stays float64 (tdhook: float32); a constant representation raises (tdhook: NaN)."""
    td = pair((40, 6), dtype=torch.float64)
    expected, got = both("CkaEstimator", td)
    assert expected["cka"].dtype == torch.float32 and got["cka"].dtype == torch.float64
    torch.testing.assert_close(got["cka"].float(), expected["cka"])
    constant = TensorDict(a=torch.ones(30, 4), b=torch.randn(30, 3))
    assert torch.isnan(theirs.CkaEstimator(in_key_a="a", in_key_b="b")(constant.clone())["cka"])
    with pytest.raises(ValueError, match="cka: x is constant"):
        ours.CkaEstimator(in_key_a="a", in_key_b="b")(constant)
    big = TensorDict(a=1e8 * td["a"].float(), b=td["b"].float())  # tdhook's product of norms overflows float32
    assert torch.isnan(theirs.CkaEstimator(in_key_a="a", in_key_b="b")(big.clone())["cka"])
    torch.testing.assert_close(ours.CkaEstimator(in_key_a="a", in_key_b="b")(big)["cka"], expected["cka"])
    with pytest.raises(NotImplementedError, match=r"Only 'linear'.*kernel='rbf'"):
        ours.CkaEstimator(kernel="rbf")


def test_bad_batch_shapes_raise_as_tdhook() -> None:
    td = TensorDict(a=torch.randn(2, 3, 16, 8), b=torch.randn(2, 4, 16, 6), batch_size=[2])
    for name in ("CkaEstimator", "InformationImbalanceEstimator"):
        for lib in LIBS.values():
            with pytest.raises(ValueError, match="matching batch shapes"):
                getattr(lib, name)(in_key_a="a", in_key_b="b")(td.clone())
