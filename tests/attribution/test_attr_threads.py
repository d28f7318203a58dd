"""Threads sharing one model: layer attribution calls see only their own taps and inputs.

tdhook 0.1.3 registers its hooks on the shared model and errored in 34 of 120 such calls.
"""

import threading

import attr_zoo
import pytest
import torch
from attr_zoo import build
from zoo import same, snapshot

from tdhook_fn.attribution import DimsConfig, grad_cam, integrated_gradients, saliency

N_THREADS, N_CALLS = 3, 40


@pytest.fixture(autouse=True)
def _one_thread():
    yield from attr_zoo.one_thread()


def _run_threads(work):
    errors: list[BaseException] = []
    barrier = threading.Barrier(N_THREADS)

    def target(i):
        try:
            barrier.wait()
            work(i)
        except BaseException as error:  # collected and reported by the test
            errors.append(error)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


@pytest.mark.parametrize("name", ["cnn", "two_input"])
def test_three_threads_of_layer_attribution_match_the_single_threaded_results(name):
    e = build(name)
    f, p = e.f, e.params
    before = snapshot(e.model)
    paths = list(e.layers)
    # each thread its own inputs, baselines, target and layer: any leak between calls shows
    jobs = [
        (e.inputs((4,), seed=10 + i), e.baselines((4,), seed=20 + i), i % 3, paths[i % len(paths)])
        for i in range(N_THREADS)
    ]

    def layer_saliency(i):
        td, _, target, path = jobs[i]
        return saliency(f, p, td, target=target, layers=[path], multiply_by_inputs=True)

    def layer_ig(i):
        td, base, target, path = jobs[i]
        return integrated_gradients(f, p, td, base, target=target, n_steps=8, layers=[path], chunk_size=3)

    calls = [layer_saliency, layer_ig]
    expected = [[call(i) for call in calls] for i in range(N_THREADS)]
    wrong = [0] * N_THREADS

    def work(i):
        for k in range(N_CALLS):
            which = k % len(calls)
            got = calls[which](i)
            want = expected[i][which]
            if set(got.keys()) != set(want.keys()) or not all(torch.equal(got[key], want[key]) for key in want.keys()):
                wrong[i] += 1

    errors = _run_threads(work)
    assert errors == [], f"{len(errors)} errors, first: {errors[0]!r}" if errors else ""
    assert wrong == [0] * N_THREADS
    assert same(before, snapshot(e.model))
    # the jobs differ, so equal results are not vacuous
    key = e.in_keys[0]
    assert not torch.equal(expected[0][0][key], expected[1][0][key])


def test_threads_mixing_grad_cam_and_per_target_calls():
    e = build("conv1d", torch.float64)
    f, p = e.f, e.params
    before = snapshot(e.model)
    dims = DimsConfig((1,), (0,))
    inputs = [e.inputs((2, 3), seed=30 + i) for i in range(N_THREADS)]
    calls = [
        lambda td: grad_cam(f, p, td, target=(0, 1), per_target=True, layers={"[0]": dims, "[2]": dims}),
        lambda td: saliency(f, p, td, target=(1, 2), per_target=True, layers=["[2]"], use_inputs=False),
    ]
    expected = [[call(td) for call in calls] for td in inputs]
    wrong = [0] * N_THREADS

    def work(i):
        for k in range(N_CALLS // 2):
            got = calls[k % 2](inputs[i])
            want = expected[i][k % 2]
            if not all(torch.equal(got[key], want[key]) for key in want.keys()):
                wrong[i] += 1

    assert _run_threads(work) == []
    assert wrong == [0] * N_THREADS
    assert same(before, snapshot(e.model))
