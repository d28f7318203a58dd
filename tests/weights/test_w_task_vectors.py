"""Task vectors, alpha sweeps and tdhook's choice of alpha."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _tolerance import assert_close_ulps
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from tensordict import TensorDict
from torch import nn
from w_models import small_mlp, tds_close, tds_equal

import tdhook_fn
from tdhook_fn.weights import apply_vectors, best_alpha, forget_vector, sweep_alphas, task_vector

FAST = settings(max_examples=40, deadline=None)
TOL = {"rtol": 1e-5, "atol": 1e-4}

# ---------------------------------------------------------------- properties on random parameter sets

shape_lists = st.lists(hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=4), min_size=1, max_size=4)
floats = st.floats(-100, 100, allow_nan=False, allow_infinity=False, width=32)


def _td(draw, shape_list) -> TensorDict:
    td = TensorDict({}, batch_size=[])
    for i, shape in enumerate(shape_list):
        value = torch.from_numpy(draw(hnp.arrays(np.float32, shape, elements=floats)).copy())
        td.set(("sub", f"p{i}") if i % 2 else f"p{i}", value)
    return td


@FAST
@given(st.data(), shape_lists)
def test_apply_task_vector_gives_finetuned(data, shape_list) -> None:
    base, ft = _td(data.draw, shape_list), _td(data.draw, shape_list)
    vector = task_vector(base, ft)
    assert tds_close(apply_vectors(base, vector), ft, **TOL)
    assert tds_equal(forget_vector(base, ft), -vector)
    assert tds_close(apply_vectors(ft, forget_vector(base, ft)), base, **TOL)


@FAST
@given(st.data(), shape_lists, st.floats(-3, 3), st.floats(-3, 3))
def test_apply_vectors_is_linear_in_alpha(data, shape_list, a: float, b: float) -> None:
    base, v1, v2 = (_td(data.draw, shape_list) for _ in range(3))
    scaled = apply_vectors(base, v1, alpha=a)
    assert tds_close(scaled - base, v1 * a, rtol=1e-4, atol=1e-3)
    assert tds_close(apply_vectors(scaled, v1, alpha=b), apply_vectors(base, v1, alpha=a + b), rtol=1e-4, atol=1e-2)
    both = apply_vectors(base, v1, v2, alpha=a)
    assert tds_close(both, base + (v1 + v2) * a, rtol=1e-4, atol=1e-3)
    assert tds_close(both, apply_vectors(apply_vectors(base, v1, alpha=a), v2, alpha=a), rtol=1e-4, atol=1e-2)
    assert tds_equal(apply_vectors(base, v1, alpha=0.0), base)
    assert tds_equal(apply_vectors(base), base)


def _bn_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def test_integer_buffers_keep_base_values() -> None:
    base_model, ft_model = _bn_net(0), _bn_net(1)
    ft_model.train()
    ft_model(torch.randn(8, 3))  # moves running stats and num_batches_tracked
    base, ft = tdhook_fn.params(base_model), tdhook_fn.params(ft_model)
    assert base["1", "num_batches_tracked"] != ft["1", "num_batches_tracked"]
    vector = task_vector(base, ft)
    for alpha in (1.0, 0.5, -2.0):
        out = apply_vectors(base, vector, alpha=alpha)
        count = out["1", "num_batches_tracked"]
        assert count.dtype == torch.int64 and torch.equal(count, base["1", "num_batches_tracked"])
        assert torch.allclose(out["1", "running_mean"], base["1", "running_mean"] + alpha * vector["1", "running_mean"])
    assert tds_close(
        apply_vectors(base, vector).exclude(("1", "num_batches_tracked")),
        ft.exclude(("1", "num_batches_tracked")),
        **TOL,
    )


# ---------------------------------------------------------------- bad input


def test_vectors_between_different_structures_are_refused() -> None:
    a = TensorDict({"w": torch.zeros(2, 3), "sub": {"b": torch.zeros(3)}}, batch_size=[])
    other_key = TensorDict({"w": torch.zeros(2, 3), "sub": {"c": torch.zeros(3)}}, batch_size=[])
    other_shape = TensorDict({"w": torch.zeros(3, 2), "sub": {"b": torch.zeros(3)}}, batch_size=[])
    for fn in (task_vector, forget_vector, apply_vectors):
        with pytest.raises(ValueError, match=r"differ in keys.*'b'.*'c'"):
            fn(a, other_key)
        with pytest.raises(ValueError, match=r"w: \(2, 3\) vs \(3, 2\)"):
            fn(a, other_shape)
    with pytest.raises(ValueError, match="differ in keys"):
        apply_vectors(a, a, other_key)
    with pytest.raises(ValueError, match="differ"):
        sweep_alphas(lambda p: p["w"].sum(), a, other_shape, [1.0])


def test_sweep_bad_arguments() -> None:
    base = TensorDict(w=torch.ones(2), batch_size=[])
    with pytest.raises(ValueError, match="empty"):
        sweep_alphas(lambda p: p["w"].sum(), base, base, [])
    for chunk in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="chunk_size"):
            sweep_alphas(lambda p: p["w"].sum(), base, base, [1.0], chunk_size=chunk)


# ---------------------------------------------------------------- sweep_alphas


def _setup():
    model = small_mlp(0)
    tuned = small_mlp(1)
    base = tdhook_fn.params(model)
    vector = task_vector(base, tdhook_fn.params(tuned))
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(3))
    return model, base, vector, x, y


def _fns(model, x, y):
    return {
        "mean_logit": lambda p: tdhook_fn.call(model, p, x).mean(),
        "per_class": lambda p: tdhook_fn.call(model, p, x).mean(0),
        "accuracy_item": lambda p: torch.tensor((tdhook_fn.call(model, p, x).argmax(-1) == y).float().mean().item()),
        "float_item": lambda p: tdhook_fn.call(model, p, x).square().mean().item(),
    }


VMAPPABLE = {"mean_logit", "per_class"}
ALPHAS = {
    "one": [0.7],
    "two": [0.0, 1.0],
    "six": torch.linspace(-1, 1, 6),
    "many": [i / 10 for i in range(-20, 21)],
}


SWEEP_CASES = [
    pytest.param(fn_name, alphas, chunk, id=f"{fn_name}-{alphas}-chunk{chunk}")
    for fn_name in ("mean_logit", "per_class", "accuracy_item", "float_item")
    for alphas in ALPHAS
    for chunk in (None, 1, 3, 16)
    if fn_name in VMAPPABLE or chunk in (None, 1)  # a forced vmap needs a vmappable fn
]


@pytest.mark.parametrize(("fn_name", "alphas", "chunk_size"), SWEEP_CASES)
def test_sweep_equals_plain_loop(fn_name: str, alphas: str, chunk_size: int | None) -> None:
    model, base, vector, x, y = _setup()
    fn = _fns(model, x, y)[fn_name]
    values = ALPHAS[alphas]
    expected = torch.stack([torch.as_tensor(fn(apply_vectors(base, vector, alpha=float(a)))) for a in values])
    got = sweep_alphas(fn, base, vector, values, chunk_size=chunk_size)
    # vmapped chunks run the model on stacked params (batched matmuls): a few ulps
    assert_close_ulps(got, expected.to(got.dtype))


def test_sweep_with_integer_buffers_and_vmap_chunks() -> None:
    """Integer buffers are broadcast, not scaled, in the vmapped chunks too."""
    model = _bn_net(0).eval()
    base = tdhook_fn.params(model)
    tuned = _bn_net(1).train()
    tuned(torch.randn(8, 3))
    vector = task_vector(base, tdhook_fn.params(tuned))
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    fn = lambda p: tdhook_fn.call(model, p, x).sum(0) + p["1", "num_batches_tracked"]
    alphas = torch.linspace(-1, 2, 7)
    expected = torch.stack([fn(apply_vectors(base, vector, alpha=float(a))) for a in alphas])
    for chunk in (None, 1, 2, 7):
        assert_close_ulps(sweep_alphas(fn, base, vector, alphas, chunk_size=chunk), expected, msg=f"chunk {chunk}")


# ---------------------------------------------------------------- best_alpha vs tdhook


def _tdhook_choice(alphas: list[float], scores: list[float], adequate: list[bool]) -> float | None:
    """tdhook's TaskVectorsContext.compute_alpha on a 1-weight model whose weight is alpha."""
    from tdhook.weights.task_vectors import TaskVectors

    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    index = lambda module: alphas.index(float(module.module.weight.item()))
    factory = TaskVectors(alphas, lambda m: scores[index(m)], lambda m: adequate[index(m)])
    with factory.prepare(model) as hooked:
        vector = TensorDict(weight=torch.ones(1, 1), batch_size=[])
        try:
            return hooked.hooking_context.compute_alpha(vector)
        except RuntimeError:
            return None


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.booleans()), min_size=1, max_size=6))
def test_best_alpha_picks_as_tdhook(entries) -> None:
    alphas = [float(i) for i in range(len(entries))]
    scores = [float(s) for s, _ in entries]
    adequate = [ok for _, ok in entries]
    expected = _tdhook_choice(alphas, scores, adequate)
    if expected is None:
        with pytest.raises(RuntimeError, match="adequacy"):
            best_alpha(alphas, scores, adequate)
    else:
        assert best_alpha(alphas, scores, adequate) == expected
        assert best_alpha(alphas, torch.tensor(scores), torch.tensor(adequate)) == expected


def test_best_alpha_on_a_sweep_matches_tdhook_context() -> None:
    from tdhook.weights.task_vectors import TaskVectors

    model, base, vector, x, y = _setup()
    alphas = [0.0, 0.25, 0.5, 0.75, 1.0, 1.5]
    td = TensorDict(input=x, batch_size=[16])
    score_of = lambda logits: logits[:, 0].mean().item()
    adequate_of = lambda logits: (logits.abs().max() < 1.2).item()
    scores = sweep_alphas(lambda p: tdhook_fn.call(model, p, x)[:, 0].mean(), base, vector, alphas)
    adequate = sweep_alphas(lambda p: tdhook_fn.call(model, p, x).abs().max() < 1.2, base, vector, alphas)
    ours = best_alpha(alphas, scores, adequate)
    assert 0 < int(adequate.sum()) < len(alphas)  # the criterion matters here

    factory = TaskVectors(alphas, lambda m: score_of(m(td)["output"]), lambda m: adequate_of(m(td)["output"]))
    tuned = small_mlp(1)
    with factory.prepare(model) as hooked:
        theirs = hooked.hooking_context.compute_alpha(hooked.get_task_vector(tuned))
    assert ours == theirs


def test_best_alpha_none_adequate() -> None:
    with pytest.raises(RuntimeError, match="No value satisfies the control adequacy criterion"):
        best_alpha([0.5, 1.0], [1.0, 2.0], [False, False])
    assert best_alpha([0.5, 1.0, 2.0], [3.0, 3.0, 1.0], [True, True, True]) == 0.5
    assert best_alpha([0.5, 1.0, 2.0], [3.0, 3.0, 9.0], [False, True, False]) == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_one_alpha_gives_the_same_weights_on_every_path(dtype: torch.dtype) -> None:
    """A Python-number alpha multiplies half-precision weights in float32; the vmapped sweep and a tensor alpha too."""
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 4).to(dtype)
    base = tdhook_fn.params(net)
    vector = task_vector(base, base.apply(lambda t: t + torch.randn_like(t)))
    alphas = [0.1, 0.3, 0.7, 1.3]
    weights = lambda p: p["weight"] + 0
    looped = sweep_alphas(weights, base, vector, alphas, chunk_size=1)
    mapped = sweep_alphas(weights, base, vector, alphas, chunk_size=4)
    assert torch.equal(looped, mapped)  # bitwise by construction: one elementwise mul and add per entry
    for a, w in zip(alphas, looped, strict=True):
        assert torch.equal(apply_vectors(base, vector, alpha=a)["weight"], w)
        assert torch.equal(apply_vectors(base, vector, alpha=torch.tensor(a))["weight"], w)


def test_a_model_with_a_bool_buffer_has_task_vectors() -> None:
    net = torch.nn.Linear(3, 2)
    net.register_buffer("active", torch.tensor([True, False]))
    base = tdhook_fn.params(net)
    tuned = base.apply(lambda t: t if t.dtype == torch.bool else t + 1)
    for vector in (task_vector(base, tuned), forget_vector(tuned, base)):
        applied = apply_vectors(base, vector)
        assert torch.equal(applied["weight"], tuned["weight"]) and torch.equal(applied["active"], base["active"])


def test_complex_weights_move_with_the_vector() -> None:
    """Spectral layers hold complex weights: applied, swept and forgotten like real ones."""
    base = TensorDict(w=torch.tensor([1 + 1j, 2 + 0j]), steps=torch.tensor([3]))
    tuned = TensorDict(w=torch.tensor([3 + 1j, 2 + 5j]), steps=torch.tensor([4]))
    vector = task_vector(base, tuned)
    applied = apply_vectors(base, vector)
    assert torch.equal(applied["w"], tuned["w"]) and torch.equal(applied["steps"], base["steps"])
    assert torch.equal(apply_vectors(tuned, forget_vector(base, tuned))["w"], base["w"])
    swept = sweep_alphas(lambda p: p["w"] + 0, base, vector, [0.0, 0.5, 1.0])
    for alpha, w in zip([0.0, 0.5, 1.0], swept, strict=True):
        torch.testing.assert_close(w, apply_vectors(base, vector, alpha=alpha)["w"], rtol=0, atol=0)
    torch.testing.assert_close(swept[1], base["w"] + 0.5 * (tuned["w"] - base["w"]))


# ---------------------------------------------------------------- sweep_alphas: vmap or loop, by size


class _Counted:
    """``fn`` that counts its calls: a loop calls it once per alpha, vmap once per chunk."""

    __hash__ = None  # type: ignore[assignment]  # unhashable: sweep_alphas cannot record its size

    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, p):
        self.calls += 1
        return self.fn(p)


@pytest.mark.parametrize("strategy", ["vmap", "loop"])
def test_both_strategies_give_the_reference_values(strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the budget forced either way, the sweep equals a loop of apply_vectors, and a second sweep too."""
    from tdhook_fn.weights import _sweep

    monkeypatch.setattr(_sweep, "_CACHE_BYTES", 1 << 40 if strategy == "vmap" else 0)
    model, base, vector, x, y = _setup()
    alphas = [i / 4 for i in range(-8, 8)]
    for name in VMAPPABLE:
        fn = _fns(model, x, y)[name]
        expected = torch.stack([fn(apply_vectors(base, vector, alpha=a)) for a in alphas])
        calls = []
        counted = lambda p, fn=fn: calls.append(1) or fn(p)
        for sweep in ("first", "second"):  # the second with the size recorded
            calls.clear()
            assert_close_ulps(sweep_alphas(counted, base, vector, alphas), expected, msg=f"{name}, {sweep} sweep")
            vmapped = 2 if sweep == "first" else 1  # the first alpha alone, measured; then one chunk
            assert len(calls) == (vmapped if strategy == "vmap" else len(alphas)), (name, sweep, len(calls))


def test_the_size_of_an_evaluation_decides_and_no_clock() -> None:
    """Small evaluations run in vmap chunks, one making a 4 MiB tensor in a loop: the same way on every sweep."""
    base = TensorDict(w=torch.arange(3.0), batch_size=[])
    vector = base.apply(torch.ones_like)
    alphas = [i / 8 for i in range(16)]
    small = _Counted(lambda p: p["w"].sum())
    large = _Counted(lambda p: p["w"].sum() + torch.zeros(1 << 20).sum())
    for _ in range(3):  # unhashable fns: measured again each time, deciding alike
        small.calls = large.calls = 0
        expected = torch.tensor([3.0 + 3 * a for a in alphas])
        assert_close_ulps(sweep_alphas(small, base, vector, alphas), expected)
        assert_close_ulps(sweep_alphas(large, base, vector, alphas), expected)
        assert small.calls == 2 and large.calls == len(alphas)


def test_vmap_chunks_are_even_and_bounded_by_the_budget() -> None:
    from tdhook_fn.weights._sweep import _CACHE_BYTES, _chunk_for

    assert _chunk_for(_CACHE_BYTES // 12, 15) == 8  # 12 fit: 8 + 7, not 12 + 3
    assert _chunk_for(_CACHE_BYTES // 12, 5) == 5
    assert _chunk_for(1, 40) == 40
    assert _chunk_for(_CACHE_BYTES // 3, 16) == 1  # 3 would fit: vmap does not pay back, loop
    assert _chunk_for(2 * _CACHE_BYTES, 16) == 1


def test_sweep_of_a_tensordict_with_nested_batch_dims() -> None:
    """A base whose nested TensorDict has its own batch dims is built by apply: same values both ways."""
    base = TensorDict(w=torch.arange(3.0), sub=TensorDict(u=torch.ones(2, 2), batch_size=[2]), batch_size=[])
    vector = base.apply(lambda t: t + 1)
    fn = lambda p: p["w"].sum() + p["sub", "u"].square().sum()
    alphas = [0.0, 0.5, 1.0, -1.0, 2.0]
    expected = torch.stack([fn(apply_vectors(base, vector, alpha=a)) for a in alphas])
    for chunk in (None, 1, 2, 5):
        assert_close_ulps(sweep_alphas(fn, base, vector, alphas, chunk_size=chunk), expected, msg=f"chunk {chunk}")
