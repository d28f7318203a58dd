"""The plan of a causal sweep's chunks (NOTE [causal chunks]): every run once, ordered by start, within the cap."""

from hypothesis import given, settings
from hypothesis import strategies as st

from tdhook_fn.latent._causal_chunks import causal_chunks


@st.composite
def _sweeps(draw):
    length = draw(st.integers(1, 12))
    n_modules = draw(st.integers(1, 20))
    modules, starts = [], []
    for _ in range(n_modules):
        runs = draw(st.lists(st.integers(0, length - 1), min_size=1, max_size=15))
        modules.append(list(range(len(starts), len(starts) + len(runs))))
        starts += runs
    shares = sorted(draw(st.lists(st.floats(0.0, 0.99), min_size=n_modules, max_size=n_modules)))
    return modules, shares, starts, length, draw(st.floats(0.0, 64.0)), draw(st.integers(1, 40))


@settings(max_examples=200, deadline=None)
@given(_sweeps())
def test_every_run_once_by_start_within_the_cap(sweep):
    modules, shares, starts, length, fixed, most = sweep
    chunks = causal_chunks(modules, shares, starts, length, fixed, most)
    assert sorted(k for chunk in chunks for k in chunk) == list(range(len(starts)))
    for chunk in chunks:
        assert 1 <= len(chunk) <= most
        assert [starts[k] for k in chunk] == sorted(starts[k] for k in chunk)


def test_a_grid_shares_chunks_across_neighbouring_layers():
    layers, length = 12, 16
    modules = [list(range(layer * length, (layer + 1) * length)) for layer in range(layers)]
    starts = [t for _ in range(layers) for t in range(length)]
    shares = [(layer + 1) / (layers + 1) for layer in range(layers)]
    chunks = causal_chunks(modules, shares, starts, length, 16.0, 1000)
    assert len(chunks) < layers * 2  # one module a chunk took 25 on this grid
    assert any(len({k // length for k in chunk}) > 1 for chunk in chunks)


def test_one_module_with_a_large_fixed_cost_is_one_chunk():
    starts = list(range(8))
    assert causal_chunks([starts], [0.5], starts, 8, 1e6, 100) == [starts]
