"""Hooks registered on a hooked module between its calls, and from two threads at once, all apply."""

from __future__ import annotations

import threading

import torch
from tensordict import TensorDict
from torch import nn

from tdhook_fn.compat.contexts import HookingContextFactory


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def _td() -> TensorDict:
    return TensorDict(input=torch.randn(5, 3), batch_size=[5])


def test_hooks_set_after_calls_without_any_apply_and_removing_them_restores_the_output() -> None:
    model, td = _model(), _td()
    with HookingContextFactory().prepare(model) as hooked:
        plain = hooked(td.clone())["output"]
        handle = hooked.set("[0]", torch.zeros(5, 4))
        hooked_out = hooked(td.clone())["output"]
        handle.remove()
        again = hooked(td.clone())["output"]
    torch.testing.assert_close(hooked_out, model[2](torch.zeros(5, 4)).expand(5, 2))
    torch.testing.assert_close(again, plain)


def test_first_hooks_registered_by_two_threads_at_once_both_apply() -> None:
    model, td = _model(), _td()
    seen: list[str] = []
    with HookingContextFactory().prepare(model) as hooked:
        start = threading.Barrier(2)

        def register(path: str) -> None:
            start.wait()
            hooked.register_submodule_hook(path, lambda module, args, output: seen.append(path), "fwd")

        threads = [threading.Thread(target=register, args=(path,)) for path in ("[0]", "[2]")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        hooked(td.clone())
    assert sorted(seen) == ["[0]", "[2]"]
