"""compat Pruning under threads: the shared model is never pruned, not even for a moment."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import tdhook.weights
import torch
from tensordict import TensorDict
from torch import nn
from zoo import Blocks, same, snapshot

import tdhook_fn
import tdhook_fn.compat.weights

N_THREADS, N_CALLS = 4, 150
X = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))


def make_blocks() -> nn.Module:
    torch.manual_seed(0)
    return Blocks().eval()


def magnitude(module_key: str, parameter_name: str, parameter: torch.Tensor) -> torch.Tensor | None:
    """Magnitude with a per-module offset; biases (1-d) are left alone."""
    return parameter.detach().abs() + 0.01 * len(module_key) if parameter.dim() > 1 else None


SETTINGS: list[dict[str, Any]] = [
    {"amount_to_prune": 0.3},
    {"amount_to_prune": 17},
    {"modules_to_prune": {"layers[0]": (0, 0.5), "heads['main']": (1, 2)}},
    {"amount_to_prune": 0.6, "relative_path": "layers"},
]


def tdhook_output(model: nn.Module, settings: dict[str, Any]) -> torch.Tensor:
    with tdhook.weights.Pruning(magnitude, **settings).prepare(copy.deepcopy(model)) as hooked:
        return hooked(TensorDict(input=X, batch_size=[5]))["output"].detach()  # type: ignore[no-any-return]


def run_threads(work: Callable[[int], int]) -> list[int]:
    """``work(i)`` in N_THREADS threads started together; the numbers of wrong results."""
    errors: list[BaseException] = []
    wrong = [0] * N_THREADS
    barrier = threading.Barrier(N_THREADS)

    def target(i: int) -> None:
        try:
            barrier.wait()
            wrong[i] = work(i)
        except BaseException as e:  # re-raised below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return wrong


def test_pure_calls_stay_unpruned_while_a_context_is_open() -> None:
    """Thread 0 enters and exits Pruning contexts; the others call with params taken before."""
    model = make_blocks()
    before = snapshot(model)
    taken = tdhook_fn.params(model)  # shares the model's storage
    plain = tdhook_fn.call(model, taken, X)
    pruned = tdhook_output(model, SETTINGS[0])
    pruning = tdhook_fn.compat.weights.Pruning(magnitude, **SETTINGS[0])

    def work(i: int) -> int:
        wrong = 0
        if i == 0:
            with pruning.prepare(model) as held:  # held open for the whole run
                for _ in range(N_CALLS):
                    with pruning.prepare(model) as hooked:
                        out = hooked(TensorDict(input=X, batch_size=[5]))["output"]
                    wrong += not torch.equal(out, pruned)
                wrong += not torch.equal(held(TensorDict(input=X, batch_size=[5]))["output"], pruned)
            return wrong
        for _ in range(N_CALLS):
            wrong += not torch.equal(tdhook_fn.call(model, taken, X), plain)
            wrong += not torch.equal(model(X), plain)
        return wrong

    assert run_threads(work) == [0] * N_THREADS
    assert same(before, snapshot(model))


def test_overlapping_contexts_in_threads_each_get_their_own_pruning() -> None:
    model = make_blocks()
    before = snapshot(model)
    expected = [tdhook_output(model, settings) for settings in SETTINGS]
    assert len({tuple(e.flatten().tolist()) for e in expected}) == N_THREADS

    def work(i: int) -> int:
        wrong = 0
        pruning = tdhook_fn.compat.weights.Pruning(magnitude, **SETTINGS[i])
        for _ in range(N_CALLS // 5):
            with pruning.prepare(model) as hooked:
                for _ in range(5):
                    wrong += not torch.equal(hooked(TensorDict(input=X, batch_size=[5]))["output"], expected[i])
        return wrong

    assert run_threads(work) == [0] * N_THREADS
    assert same(before, snapshot(model))


def test_one_hooked_module_called_from_threads() -> None:
    model = make_blocks()
    before = snapshot(model)
    expected = tdhook_output(model, SETTINGS[2])

    with tdhook_fn.compat.weights.Pruning(magnitude, **SETTINGS[2]).prepare(model) as hooked:

        def work(i: int) -> int:
            wrong = 0
            for _ in range(N_CALLS):
                wrong += not torch.equal(hooked(TensorDict(input=X, batch_size=[5]))["output"], expected)
            return wrong

        assert run_threads(work) == [0] * N_THREADS
    assert same(before, snapshot(model))
