"""chunk_size changes memory, not the result beyond a few ulps (NOTE [weighted sums of the steps]).

The fold adds the path points in the same order whatever the chunk, but each chunk's
gradients come from a forward with another batch size, which CPU kernels need not round
identically (see tests/_tolerance.py): the chunked results agree to a few ulps.
"""

import attr_zoo
import pytest
import torch
from _tolerance import assert_close_ulps
from attr_zoo import DTYPES, NAMES, build

from tdhook_fn.attribution import SUPPORTED_METHODS, integrated_gradients

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")

N_STEPS = 10
CHUNKS = (1, 3, 7, None)  # 3 and 7 leave a ragged last chunk; None is one chunk of all steps


@pytest.fixture(autouse=True)
def _one_thread():
    yield from attr_zoo.one_thread()


def _assert_same(results):
    (first, first_delta), *rest = results
    for chunk, (attrs, delta) in zip(CHUNKS[1:], rest, strict=True):
        assert_close_ulps(attrs, first, msg=f"chunk_size={chunk}")
        total = float(sum(t.abs().sum() for t in first.values(True, True)))  # what the delta sums
        assert_close_ulps(delta, first_delta, scale=total, msg=f"delta, chunk_size={chunk}")


def _run(e, td, base, **kwargs):
    return [
        integrated_gradients(
            e.f, e.params, td, base, n_steps=N_STEPS, chunk_size=c, return_convergence_delta=True, **kwargs
        )
        for c in CHUNKS
    ]


@pytest.mark.parametrize("method", SUPPORTED_METHODS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("name", NAMES)
def test_chunk_size_is_invisible(name, dtype, method):
    e = build(name, dtype)
    td, base = e.inputs((2, 3)), e.baselines((2, 3))
    _assert_same(_run(e, td, base, target=1, method=method))


@pytest.mark.parametrize("name", NAMES)
def test_chunk_size_is_invisible_per_target(name):
    e = build(name)
    td, base = e.inputs((3,)), e.baselines((3,))
    results = _run(e, td, base, target=(0, 2), per_target=True, method="riemann_trapezoid")
    assert results[0][0].batch_size == torch.Size([2, 3])
    _assert_same(results)


@pytest.mark.parametrize("interpolate", ["layers", "inputs"])
@pytest.mark.parametrize("name", NAMES)
def test_chunk_size_is_invisible_with_layers(name, interpolate):
    e = build(name)
    td, base = e.inputs((2, 3)), e.baselines((2, 3))
    # in layer space one layer: the zoo's layers are in series, and the later one's interpolation would cut
    # the earlier one's gradient (integrated_gradients refuses it)
    layers = list(e.layers) if interpolate == "inputs" else list(e.layers)[-1:]
    # interpolate="inputs" integrates unmultiplied layer gradients; multiply_by_inputs=True
    # crashes there (see test_attr_layers.py), so the chunk check uses the path average
    multiply = interpolate == "layers"
    results = _run(e, td, base, target=0, layers=layers, interpolate=interpolate, multiply_by_inputs=multiply)
    expected_keys = set(layers) if interpolate == "layers" else {*layers, *e.in_keys}
    assert set(results[0][0].keys()) == expected_keys
    _assert_same(results)
    split = _run(
        e, td, base, target=(0, 1), per_target=True, layers=layers, interpolate=interpolate, multiply_by_inputs=multiply
    )
    _assert_same(split)


def test_chunk_size_is_invisible_for_one_sample():
    e = build("cnn", torch.float64)
    td, base = e.inputs(()), e.baselines(())
    _assert_same(_run(e, td, base, target=3, method="gausslegendre"))


def test_chunk_size_larger_than_n_steps_is_one_chunk():
    """One chunk of all 5 steps either way: the same forwards, so bitwise equal."""
    e = build("mlp")
    td = e.inputs((3,))
    one = integrated_gradients(e.f, e.params, td, 0.0, target=1, n_steps=5)
    big = integrated_gradients(e.f, e.params, td, 0.0, target=1, n_steps=5, chunk_size=50)
    assert torch.equal(one["input"], big["input"])
