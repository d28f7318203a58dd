"""Pruning over another context's hooked module, and composed with another Pruning, against tdhook 0.1.3: tdhook
prunes the weights that module runs with (pruned, or an applied vectors block's), and names modules from it."""

from __future__ import annotations

from typing import Any

import pytest
import tdhook.contexts
import tdhook.weights
import torch
from tensordict import TensorDict
from torch import nn
from zoo import Blocks

import tdhook_fn.compat.contexts
import tdhook_fn.compat.weights
from tdhook_fn._paths import PathError

LIBS = [tdhook.weights, tdhook_fn.compat.weights]
X = TensorDict(input=torch.randn(5, 4, generator=torch.Generator().manual_seed(3)), batch_size=[5])


def make_blocks() -> nn.Module:
    torch.manual_seed(0)
    return Blocks().eval()


def scattered(module_key: str, parameter_name: str, parameter: torch.Tensor) -> torch.Tensor | None:
    """Not monotone in the value: a pruned (zero) entry need not be chosen again by a second pruning."""
    return torch.cos(100 * parameter.detach()).abs() if parameter.dim() > 1 else None


def recording(log: list[str]) -> Any:
    def importance(module_key: str, parameter_name: str, parameter: torch.Tensor) -> torch.Tensor | None:
        log.append(f"{module_key}.{parameter_name}")
        return scattered(module_key, parameter_name, parameter)

    return importance


class Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.enc, self.dec = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, **_: Any) -> torch.Tensor:
        return self.dec(torch.relu(self.enc(x)))


OVER_VECTORS: dict[str, dict[str, Any]] = {
    "global": {"amount_to_prune": 0.4},
    "global_skip": {"amount_to_prune": 0.4, "skip_modules": lambda name, _: name == "td_module.module.layers.1"},
    "global_relative": {"amount_to_prune": 0.4, "relative_path": "td_module.module.layers"},
    "structured": {"modules_to_prune": {"td_module.module.layers[0]": (0, 0.5), "td_module.module.heads['main']":
                                        (1, 2)}},
}


@pytest.mark.parametrize("name", list(OVER_VECTORS))
def test_over_a_task_vectors_module_names_and_outputs_are_tdhooks(name: str) -> None:
    results = []
    for lib in LIBS:
        log: list[str] = []
        with lib.TaskVectors([1.0], lambda m: 0.0, lambda m: True).prepare(make_blocks()) as hooked:
            with lib.Pruning(recording(log), **OVER_VECTORS[name]).prepare(hooked) as pruned:
                results.append((log, pruned(X.clone())["output"].detach()))
    (their_log, theirs), (our_log, ours) = results
    assert our_log == their_log
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("how", ["over_the_hooked_module", "composite"])
def test_a_second_pruning_scores_the_first_ones_pruned_weights(how: str) -> None:
    results = []
    for lib, contexts in zip(LIBS, [tdhook.contexts, tdhook_fn.compat.contexts], strict=True):
        first, second = lib.Pruning(scattered, 0.3), lib.Pruning(scattered, 0.5)
        if how == "composite":
            class Both(contexts.CompositeHookingContextFactory):  # type: ignore[name-defined,misc]
                _hooking_context_class = lib.pruning.PruningContext

            with Both(first, second).prepare(make_blocks()) as pruned:
                results.append(pruned(X.clone())["output"].detach())
        else:
            with first.prepare(make_blocks()) as once, second.prepare(once) as twice:
                results.append(twice(X.clone())["output"].detach())
    theirs, ours = results
    torch.testing.assert_close(ours, theirs)


def test_over_an_adapters_module_its_adapters_must_be_left_out() -> None:
    """tdhook also prunes the adapters' parameters the hooked module holds: compat raises, naming one, and agrees
    with tdhook once they are skipped."""
    adapters = {"sparse": (Sparse(), "layers[0]", "layers[0]")}
    with tdhook_fn.compat.weights.Adapters(adapters).prepare(make_blocks()) as hooked:
        with pytest.raises(NotImplementedError, match=r"adapters\.sparse\.enc\.weight"):
            with tdhook_fn.compat.weights.Pruning(scattered, 0.4).prepare(hooked):
                pass
        with pytest.raises(PathError, match="td_module"):
            with tdhook_fn.compat.weights.Pruning(scattered, 0.4, relative_path="adapters").prepare(hooked):
                pass
    outputs = []
    for lib in LIBS:
        with lib.Adapters({"sparse": (Sparse(), "layers[0]", "layers[0]")}).prepare(make_blocks()) as hooked:
            skip = lambda name, _: name.startswith("adapters")
            with lib.Pruning(scattered, 0.4, skip_modules=skip).prepare(hooked) as pruned:
                outputs.append(pruned(X.clone())["output"].detach())
    torch.testing.assert_close(outputs[1], outputs[0])
