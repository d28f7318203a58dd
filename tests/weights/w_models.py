"""Models, score makers and ``torch.nn.utils.prune`` references for the weight tests."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torch.nn.utils import prune


def prunable_net(seed: int = 0) -> nn.Module:
    """Conv2d and Linear layers, with and without biases; input ``[B, 2, 5, 5]``."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(3, 4, 2),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 6),
        nn.ReLU(),
        nn.Linear(6, 2, bias=False),
    ).eval()


def small_mlp(seed: int = 0, d_in: int = 4, d_hidden: int = 8, d_out: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_out)).eval()


def key_of(module_name: str, param_name: str) -> tuple[str, ...]:
    return (*module_name.split("."), param_name) if module_name else (param_name,)


def direct_params(model: nn.Module) -> list[tuple[str, str, nn.Module]]:
    """``(module name, parameter name, module)`` in ``named_modules`` order, as tdhook walks them."""
    return [
        (name, pname, module)
        for name, module in model.named_modules()
        for pname, _ in module.named_parameters(recurse=False)
    ]


def make_scores(
    model: nn.Module, kind: str, seed: int = 0, select: Callable[[str, str], bool] = lambda m, p: True
) -> dict[tuple[str, str], torch.Tensor]:
    """Scores per ``(module name, parameter name)``: ``"abs"`` (magnitudes), ``"randn"``
    or ``"ties"`` (small integers, many equal, some negative)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[tuple[str, str], torch.Tensor] = {}
    for name, pname, module in direct_params(model):
        if not select(name, pname):
            continue
        p = getattr(module, pname).detach()
        if kind == "abs":
            out[(name, pname)] = p.abs().clone()
        elif kind == "randn":
            out[(name, pname)] = torch.randn(p.shape, generator=gen)
        elif kind == "ties":
            out[(name, pname)] = torch.randint(-3, 4, p.shape, generator=gen).float()
        else:
            raise ValueError(kind)
    return out


def scores_td(scores: dict[tuple[str, str], torch.Tensor]) -> TensorDict:
    td = TensorDict({}, batch_size=[])
    for (name, pname), s in scores.items():
        td.set(key_of(name, pname), s.clone())
    return td


def torch_global_masks(model: nn.Module, scores: dict[tuple[str, str], torch.Tensor], amount: Any) -> TensorDict:
    """The ``*_mask`` buffers ``prune.global_unstructured`` leaves on a deepcopy of ``model``."""
    twin = copy.deepcopy(model)
    modules = dict(twin.named_modules())
    order = [(name, pname) for name, pname, _ in direct_params(twin) if (name, pname) in scores]
    targets = [(modules[name], pname) for name, pname in order]
    prune.global_unstructured(
        targets,
        pruning_method=prune.L1Unstructured,
        importance_scores={(modules[name], pname): scores[(name, pname)].clone() for name, pname in order},
        amount=amount,
    )
    masks = TensorDict({}, batch_size=[])
    for name, pname in order:
        masks.set(key_of(name, pname), getattr(modules[name], pname + "_mask").bool())
    return masks


def torch_ln_mask(module: nn.Module, name: str, score: torch.Tensor, amount: Any, dim: int, n: float) -> torch.Tensor:
    twin = copy.deepcopy(module)
    prune.ln_structured(twin, name, amount=amount, n=n, dim=dim, importance_scores=score.clone())
    return getattr(twin, name + "_mask").bool()


def td_snapshot(td: TensorDictBase) -> dict[Any, tuple[int, torch.Tensor]]:
    """Leaves of ``td`` by key: identity and a copy of the value."""
    return {key: (id(t), t.detach().clone()) for key, t in td.items(True, True)}


def td_same(before: dict[Any, tuple[int, torch.Tensor]], td: TensorDictBase) -> bool:
    after = td_snapshot(td)
    if before.keys() != after.keys():
        return False
    return all(
        before[k][0] == after[k][0]
        and before[k][1].dtype == after[k][1].dtype
        and before[k][1].shape == after[k][1].shape
        and torch.equal(before[k][1], after[k][1])
        for k in before
    )


def tds_equal(a: TensorDictBase, b: TensorDictBase) -> bool:
    keys_a, keys_b = set(a.keys(True, True)), set(b.keys(True, True))
    return keys_a == keys_b and all(
        a.get(k).dtype == b.get(k).dtype and torch.equal(a.get(k), b.get(k)) for k in keys_a
    )


def tds_close(a: TensorDictBase, b: TensorDictBase, **tol: Any) -> bool:
    keys_a, keys_b = set(a.keys(True, True)), set(b.keys(True, True))
    return keys_a == keys_b and all(torch.allclose(a.get(k), b.get(k), **tol) for k in keys_a)
