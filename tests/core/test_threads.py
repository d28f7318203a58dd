"""Threads sharing one model: every call sees only its own params and taps."""

import threading

import pytest
import torch
from torch import nn
from zoo import same, snapshot

import tdhook_fn

N_THREADS, N_CALLS = 4, 150


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Results are compared bitwise with the single-threaded ones: the same ops on the same
    shapes, and with one intra-op thread the same sequential kernels (a BLAS free to pick
    its thread count may split a product differently)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.Tanh())]).eval()


def _run_threads(work):
    errors: list[BaseException] = []
    barrier = threading.Barrier(N_THREADS)

    def target(i):
        try:
            barrier.wait()
            work(i)
        except BaseException as e:  # collected and re-raised by the test
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_four_threads_with_different_params_get_their_own_results():
    model = _model()
    before = snapshot(model)
    base = tdhook_fn.params(model)
    params = [base.apply(lambda t, i=i: t * (1.0 + 0.25 * i)) for i in range(N_THREADS)]
    x = torch.randn(16, 32)
    expected = [tdhook_fn.call(model, p, x) for p in params]
    wrong = [0] * N_THREADS

    def work(i):
        for _ in range(N_CALLS):
            if not torch.equal(tdhook_fn.call(model, params[i], x), expected[i]):
                wrong[i] += 1

    assert _run_threads(work) == []
    assert sum(wrong) == 0
    assert same(before, snapshot(model))


def test_taps_are_private_to_their_call():
    model = _model()
    before = snapshot(model)
    p = tdhook_fn.params(model)
    x = torch.randn(16, 32)
    paths = ["[0]", "[2]", "[4]", "[6]"]
    reference = {path: tdhook_fn.call_with_taps(model, p, [tdhook_fn.capture(path)], x)[1] for path in paths}
    failures = [0] * N_THREADS

    def work(i):
        path = paths[i]
        scale = float(i + 1)
        for _ in range(N_CALLS // 3):
            taps = [tdhook_fn.capture(path), tdhook_fn.intervene(path, lambda v: v * scale)]
            out, seen = tdhook_fn.call_with_taps(model, p, taps, x)
            if seen.keys() != {tdhook_fn.path_to_name(path)}:
                failures[i] += 1
            elif not torch.equal(seen[tdhook_fn.path_to_name(path)], reference[path][tdhook_fn.path_to_name(path)]):
                failures[i] += 1
            check = tdhook_fn.call_with_taps(model, p, [tdhook_fn.intervene(path, lambda v: v * scale)], x)[0]
            if not torch.equal(out, check):
                failures[i] += 1

    assert _run_threads(work) == []
    assert sum(failures) == 0
    assert same(before, snapshot(model))


def test_threads_on_an_accelerate_hooked_model():
    """Rebinding (accelerate's forward partials) happens on each call's private shadow."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    model = _model()
    for i in (0, 4):
        add_hook_to_module(model[i], ModelHook())
    forwards = [model[i].__dict__["forward"] for i in (0, 4)]
    before = snapshot(model)
    base = tdhook_fn.params(model)
    params = [base.apply(lambda t, i=i: t * (1.0 + 0.25 * i)) for i in range(N_THREADS)]
    x = torch.randn(16, 32)
    expected = [tdhook_fn.call(model, p, x) for p in params]
    plain = _model()
    assert all(torch.equal(e, tdhook_fn.call(plain, p, x)) for e, p in zip(expected, params))
    wrong = [0] * N_THREADS

    def work(i):
        for _ in range(N_CALLS):
            wrong[i] += not torch.equal(tdhook_fn.call(model, params[i], x), expected[i])

    assert not _run_threads(work)
    assert wrong == [0] * N_THREADS
    assert same(before, snapshot(model))
    assert [model[i].__dict__["forward"] for i in (0, 4)] == forwards
