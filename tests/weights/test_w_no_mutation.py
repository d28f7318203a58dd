"""Every weight function leaves models and the TensorDicts it is given as they were."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from w_models import key_of, prunable_net, small_mlp, td_same, td_snapshot
from zoo import same, snapshot

import tdhook_fn
from tdhook_fn.weights import (
    adapter_params,
    apply_masks,
    apply_vectors,
    best_alpha,
    default_skip,
    forget_vector,
    global_unstructured_masks,
    ln_structured_mask,
    pruning_scores,
    sweep_alphas,
    task_vector,
    with_adapters,
)


def _bn_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def test_task_vector_functions_change_nothing() -> None:
    base_model, ft_model = _bn_net(0).eval(), _bn_net(1).eval()
    before_base, before_ft = snapshot(base_model), snapshot(ft_model)
    base, ft = tdhook_fn.params(base_model), tdhook_fn.params(ft_model)
    seen_base, seen_ft = td_snapshot(base), td_snapshot(ft)
    vector = task_vector(base, ft)
    forget = forget_vector(base, ft)
    seen_vector, seen_forget = td_snapshot(vector), td_snapshot(forget)
    apply_vectors(base, vector, forget, alpha=0.3)
    apply_vectors(base)
    x = torch.randn(6, 3)
    fn = lambda p: tdhook_fn.call(base_model, p, x).mean()
    for chunk in (None, 1, 2):
        sweep_alphas(fn, base, vector, [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0], chunk_size=chunk)
    scores, adequate = torch.tensor([1.0, 2.0]), torch.tensor([True, True])
    best_alpha([0.1, 0.2], scores, adequate)
    assert torch.equal(scores, torch.tensor([1.0, 2.0])) and torch.equal(adequate, torch.tensor([True, True]))
    assert same(before_base, snapshot(base_model)) and same(before_ft, snapshot(ft_model))
    for seen, td in ((seen_base, base), (seen_ft, ft), (seen_vector, vector), (seen_forget, forget)):
        assert td_same(seen, td)


def test_pruning_functions_change_nothing() -> None:
    model = prunable_net()
    before = snapshot(model)
    params = tdhook_fn.params(model)
    seen_params = td_snapshot(params)
    scores = pruning_scores(
        model, params, lambda module_key, parameter_name, parameter: parameter.abs(), skip=default_skip
    )
    seen_scores = td_snapshot(scores)
    masks = global_unstructured_masks(scores, 0.4)
    seen_masks = td_snapshot(masks)
    structured = ln_structured_mask(scores.select(("0", "weight"), ("4", "weight")), 0.5, 0, n=2)
    single = scores["2", "weight"]
    single_before = single.clone()
    ln_structured_mask(single, 2, 1)
    pruned = apply_masks(params, masks)
    apply_masks(params, structured)
    apply_masks(pruned, masks)
    tdhook_fn.call(model, pruned, torch.randn(2, 2, 5, 5))
    assert same(before, snapshot(model))
    assert td_same(seen_params, params) and td_same(seen_scores, scores) and td_same(seen_masks, masks)
    assert torch.equal(single, single_before)
    # the model's own tensors are still what they were
    for name, p in model.named_parameters():
        assert torch.equal(p, seen_params[tuple(name.split("."))][1])


def test_pruning_scores_hands_the_params_entries() -> None:
    """``importance`` sees the params' tensors (not the model's), and may not change them."""
    model = prunable_net()
    params = tdhook_fn.params(model).apply(lambda t: t + 1.0)
    got = {}

    def importance(module_key: str, parameter_name: str, parameter: torch.Tensor) -> torch.Tensor:
        got[(module_key, parameter_name)] = parameter
        return parameter

    pruning_scores(model, params, importance, skip=default_skip)
    for (module_key, parameter_name), tensor in got.items():
        assert tensor is params.get(key_of(module_key, parameter_name))


def test_adapter_functions_change_nothing() -> None:
    model = small_mlp()
    torch.manual_seed(2)
    sae = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    before_model, before_sae = snapshot(model), snapshot(sae)
    adapters = {"sae": (sae, "[0]", "[1]")}
    g = with_adapters(tdhook_fn.functional(model), adapters)
    p = tdhook_fn.params(model).update(adapter_params(adapters))
    seen_p = td_snapshot(p)
    x = torch.randn(5, 4)
    td = TensorDict(input=x, batch_size=[5])
    seen_td = td_snapshot(td)
    g(p, td)
    torch.func.vmap(g, (None, 0))(p, td)
    grads = torch.func.grad(lambda q: g(q, td)["output"].sum())(p)
    assert set(grads.keys(True, True)) == set(p.keys(True, True))
    assert same(before_model, snapshot(model)) and same(before_sae, snapshot(sae))
    assert td_same(seen_p, p) and td_same(seen_td, td)


def test_failed_calls_leave_their_arguments_as_they_were() -> None:
    """A bad mask or score after good ones: refused before anything is written."""
    params = tdhook_fn.params(nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2)))
    vector = params.apply(torch.ones_like)
    good = torch.ones(2, 3, dtype=torch.bool)
    masks = TensorDict({"0": {"weight": good}, "1": {"weight": torch.full((2, 2), 0.5)}}, batch_size=[])
    seen_params, seen_masks = td_snapshot(params), td_snapshot(masks)
    with pytest.raises(TypeError, match="'1.weight'"):
        apply_masks(params, masks)
    with pytest.raises(ValueError, match="'0.bias'"):
        ln_structured_mask(params, 1, 0)
    with pytest.raises(TypeError, match="alpha=0.5"):
        apply_vectors(params, vector, 0.5)
    with pytest.raises(ValueError, match="finite"):
        sweep_alphas(lambda p: p["0", "weight"].sum(), params, vector, [0.0, float("inf")])
    assert td_same(seen_params, params) and td_same(seen_masks, masks)
