"""Pruning masks against ``torch.nn.utils.prune`` and their properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from tensordict import TensorDict
from torch import nn
from w_models import (
    key_of,
    make_scores,
    prunable_net,
    scores_td,
    tds_equal,
    torch_global_masks,
    torch_ln_mask,
)

import tdhook_fn
from tdhook_fn.weights import (
    apply_masks,
    default_skip,
    global_unstructured_masks,
    ln_structured_mask,
    pruning_scores,
)

FAST = settings(max_examples=40, deadline=None)

# ---------------------------------------------------------------- global unstructured vs torch

SELECTIONS = {
    "all": lambda m, p: True,
    "weights_only": lambda m, p: p == "weight",
    "some": lambda m, p: m in ("2", "6") or (m == "0" and p == "bias"),
}


def _n_scored(model: nn.Module, select) -> int:
    return sum(s.numel() for s in make_scores(model, "randn", select=select).values())


@pytest.mark.parametrize("kind", ["abs", "randn", "ties"])
@pytest.mark.parametrize("selection", list(SELECTIONS))
@pytest.mark.parametrize("amount", [0.0, 0.1, 0.37, 0.5, 1.0, 0, 1, 17, "n", "n-1"])
def test_global_masks_equal_torch_prune(kind: str, selection: str, amount) -> None:
    model = prunable_net()
    select = SELECTIONS[selection]
    scores = make_scores(model, kind, seed=3, select=select)
    n = sum(s.numel() for s in scores.values())
    amount = {"n": n, "n-1": n - 1}.get(amount, amount) if isinstance(amount, str) else amount
    expected = torch_global_masks(model, scores, amount)
    masks = global_unstructured_masks(scores_td(scores), amount)
    assert tds_equal(masks, expected)
    assert list(masks.keys(True, True)) == list(expected.keys(True, True))


@pytest.mark.parametrize("kind", ["abs", "ties"])
@pytest.mark.parametrize("amount", [0.3, 0.5, 40])
def test_global_masks_from_pruning_scores_equal_torch_prune(kind: str, amount) -> None:
    """``pruning_scores`` walks the model in tdhook's (and prune's) order, so ties break alike."""
    model = prunable_net()
    scores = make_scores(model, kind, seed=5)
    params = tdhook_fn.params(model)
    seen: list[tuple[str, str]] = []

    def importance(module_key: str, parameter_name: str, parameter: torch.Tensor) -> torch.Tensor:
        seen.append((module_key, parameter_name))
        assert parameter is params.get(key_of(module_key, parameter_name))
        return scores[(module_key, parameter_name)]

    td = pruning_scores(model, params, importance, skip=default_skip)
    assert seen == list(scores)
    masks = global_unstructured_masks(td, amount)
    assert tds_equal(masks, torch_global_masks(model, scores, amount))


def test_pruning_scores_none_and_skip() -> None:
    model = prunable_net()
    params = tdhook_fn.params(model)
    td = pruning_scores(
        model,
        params,
        lambda module_key, parameter_name, parameter: parameter.abs() if parameter_name == "weight" else None,
        skip=lambda name, module: isinstance(module, nn.Conv2d) or default_skip(name, module),
    )
    assert sorted(td.keys(True, True)) == [("4", "weight"), ("6", "weight")]
    assert torch.equal(td["4", "weight"], params["4", "weight"].abs())


def test_default_skip_matches_tdhook_on_plain_modules() -> None:
    from tdhook.weights.pruning import Pruning

    model = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2)]), nn.ReLU())
    for name, module in [
        ("", model),
        ("td_module", nn.Linear(1, 1)),
        ("module", nn.Linear(1, 1)),
        *model.named_modules(),
    ]:
        assert default_skip(name, module) == Pruning.default_skip(name, module), name


# ---------------------------------------------------------------- ln structured vs torch


def _structured_amounts(size: int) -> list:
    return [0.0, 0.25, 0.37, 0.5, 1.0, 0, 1, size - 1, size]


def _structured_cases():
    torch.manual_seed(0)
    modules = {"linear": nn.Linear(7, 5), "conv": nn.Conv2d(3, 6, (3, 2))}
    for mname, module in modules.items():
        for dim in (0, 1, -1):
            size = module.weight.shape[dim]
            for amount in sorted(set(_structured_amounts(size)), key=lambda a: (type(a).__name__, a)):
                for n in (1, 2):
                    yield pytest.param(module, dim, amount, n, id=f"{mname}-dim{dim}-{amount!r}-n{n}")


@pytest.mark.parametrize("kind", ["abs", "ties"])
@pytest.mark.parametrize(("module", "dim", "amount", "n"), list(_structured_cases()))
def test_ln_structured_equals_torch_prune(module: nn.Module, dim: int, amount, n: int, kind: str) -> None:
    gen = torch.Generator().manual_seed(7)
    weight = module.weight.detach()
    score = weight.abs() if kind == "abs" else torch.randint(-2, 3, weight.shape, generator=gen).float()
    expected = torch_ln_mask(module, "weight", score, amount, dim, n)
    mask = ln_structured_mask(score, amount, dim, n=n)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("n", ["fro", 0, -1, 0.5, 3, math.inf, -math.inf])
@pytest.mark.parametrize("module", [nn.Linear(7, 5), nn.Conv2d(3, 6, (3, 2)), nn.Conv1d(2, 4, 3)], ids=str)
def test_ln_structured_takes_every_norm_torch_prune_takes(module: nn.Module, n) -> None:
    """torch.nn.utils.prune passes ``n`` to ``torch.norm``: 'fro', 0, negatives and infinities too."""
    score = torch.randint(-2, 3, module.weight.shape, generator=torch.Generator().manual_seed(3)).float()
    for dim in (0, -1):
        if n == "fro" and score.dim() > 3:  # torch.norm refuses 'fro' over 3 dims; it is the 2-norm
            expected = torch_ln_mask(module, "weight", score, 0.5, dim, 2)
        else:
            expected = torch_ln_mask(module, "weight", score, 0.5, dim, n)
        assert torch.equal(ln_structured_mask(score, 0.5, dim, n=n), expected)


def test_ln_structured_nuclear_norm_on_3d_scores_equals_torch_prune() -> None:
    module = nn.Conv1d(3, 6, 4)
    score = module.weight.detach().abs()
    for dim in (0, 1, 2):
        expected = torch_ln_mask(module, "weight", score, 2, dim, "nuc")
        assert torch.equal(ln_structured_mask(score, 2, dim, n="nuc"), expected)


def test_ln_structured_on_tensordict_masks_each_entry() -> None:
    torch.manual_seed(1)
    lin, conv = nn.Linear(6, 4), nn.Conv2d(2, 4, 3)
    scores = TensorDict(
        {"lin": {"weight": lin.weight.detach().clone()}, "conv": {"weight": conv.weight.detach().clone()}},
        batch_size=[],
    )
    masks = ln_structured_mask(scores, 0.5, 0, n=2)
    assert isinstance(masks, TensorDict)
    assert torch.equal(masks["lin", "weight"], torch_ln_mask(lin, "weight", lin.weight.detach(), 0.5, 0, 2))
    assert torch.equal(masks["conv", "weight"], torch_ln_mask(conv, "weight", conv.weight.detach(), 0.5, 0, 2))


# ---------------------------------------------------------------- bad input


def test_global_amount_out_of_range() -> None:
    scores = TensorDict(a=torch.randn(3, 4), b=torch.randn(5), batch_size=[])
    for amount in (-0.1, 1.01, 2.0, -1, 18, 100):
        with pytest.raises(ValueError, match="amount"):
            global_unstructured_masks(scores, amount)
    global_unstructured_masks(scores, 17)  # n itself is fine
    with pytest.raises(TypeError):
        global_unstructured_masks(scores, "0.5")


def test_ln_structured_bad_input() -> None:
    score = torch.randn(4, 3)
    for amount in (-0.5, 1.5, -1, 5):
        with pytest.raises(ValueError, match="amount"):
            ln_structured_mask(score, amount, 0)
    with pytest.raises(ValueError, match="2 dims"):
        ln_structured_mask(torch.randn(5), 0.5, 0)
    with pytest.raises(ValueError, match="2 dims"):
        ln_structured_mask(TensorDict(bias=torch.randn(5), batch_size=[]), 1, 0)
    with pytest.raises(ValueError, match="out of range"):
        ln_structured_mask(score, 0.5, 2)


def test_apply_masks_bad_input() -> None:
    params = tdhook_fn.params(nn.Sequential(nn.Linear(3, 2)))
    with pytest.raises(ValueError, match="nope"):
        apply_masks(params, TensorDict({"0": {"nope": torch.ones(2, 3, dtype=torch.bool)}}, batch_size=[]))
    with pytest.raises(ValueError, match=r"\(3, 2\)"):
        apply_masks(params, TensorDict({"0": {"weight": torch.ones(3, 2, dtype=torch.bool)}}, batch_size=[]))


# ---------------------------------------------------------------- properties

shapes = st.lists(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=5), min_size=1, max_size=4)


def _random_td(draw, shape_list, ints: bool = False) -> TensorDict:
    td = TensorDict({}, batch_size=[])
    for i, shape in enumerate(shape_list):
        if ints:
            elements = st.integers(-3, 3).map(float)
        else:
            elements = st.floats(-100, 100, allow_nan=False, allow_infinity=False, width=32)
        array = draw(hnp.arrays(np.float32, shape, elements=elements))
        td.set(("g", f"t{i}") if i % 2 else f"t{i}", torch.from_numpy(array.copy()))
    return td


@FAST
@given(st.data(), shapes, st.booleans())
def test_global_masks_prune_exact_count(data, shape_list, ints: bool) -> None:
    scores = _random_td(data.draw, shape_list, ints)
    n = sum(t.numel() for t in scores.values(True, True))
    if data.draw(st.booleans()):
        amount = data.draw(st.floats(0, 1))
        expected = round(amount * n)
    else:
        amount = expected = data.draw(st.integers(0, n))
    masks = global_unstructured_masks(scores, amount)
    pruned = sum(int((~m).sum()) for m in masks.values(True, True))
    assert pruned == expected
    # the pruned entries are ones with the smallest |score|
    flat_scores = torch.cat([scores.get(k).abs().flatten() for k in masks.keys(True, True)])
    flat_keep = torch.cat([m.flatten() for m in masks.values(True, True)])
    if 0 < expected < n:
        assert flat_scores[~flat_keep].max() <= flat_scores[flat_keep].min()


@FAST
@given(st.data(), shapes)
def test_apply_masks_idempotent(data, shape_list) -> None:
    params = _random_td(data.draw, shape_list)
    masks = global_unstructured_masks(_random_td(data.draw, shape_list), data.draw(st.floats(0, 1)))
    once = apply_masks(params, masks)
    assert tds_equal(apply_masks(once, masks), once)
    for key, m in masks.items(True, True):
        assert torch.equal(once.get(key)[~m], torch.zeros_like(once.get(key)[~m]))
        assert torch.equal(once.get(key)[m], params.get(key)[m])


@FAST
@given(st.data(), hnp.array_shapes(min_dims=2, max_dims=4, min_side=1, max_side=5), st.sampled_from([1, 2]))
def test_ln_structured_prunes_whole_slices(data, shape, n: int) -> None:
    score = torch.from_numpy(
        data.draw(hnp.arrays(np.float32, shape, elements=st.floats(-10, 10, allow_nan=False, width=32))).copy()
    )
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    size = shape[dim]
    if data.draw(st.booleans()):
        amount = data.draw(st.floats(0, 1))
        expected = round(amount * size)
    else:
        amount = expected = data.draw(st.integers(0, size))
    mask = ln_structured_mask(score, amount, dim, n=n)
    assert mask.shape == score.shape
    per_slice = mask.movedim(dim, 0).reshape(size, -1)
    all_true, all_false = per_slice.all(dim=1), (~per_slice).all(dim=1)
    assert bool((all_true | all_false).all())
    assert int(all_false.sum()) == expected


def test_pruning_scores_score_a_tied_weight_once():
    from zoo import Tied

    import tdhook_fn
    from tdhook_fn.weights import pruning_scores

    model = Tied()
    importance = lambda module_key, parameter_name, parameter: parameter.abs()
    scores = pruning_scores(model, tdhook_fn.params(model), importance)
    assert {".".join(k) for k in scores.keys(True, True)} == {"enc.weight"}


def test_a_stack_of_parameter_sets_is_refused() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    p = tdhook_fn.params(net)
    stack = torch.stack([p, p.apply(lambda t: 2 * t), p.apply(lambda t: -t)])
    importance = lambda module_key, parameter_name, parameter: parameter.abs()
    with pytest.raises(ValueError, match=r"params have batch size \[3\] \(a stack of parameter sets\)"):
        pruning_scores(net, stack, importance)
    scores = torch.stack([pruning_scores(net, p, importance)] * 3)
    with pytest.raises(ValueError, match=r"scores have batch size \[3\]"):
        global_unstructured_masks(scores, 0.5)
    with pytest.raises(ValueError, match=r"scores have batch size \[3\]"):
        ln_structured_mask(scores, 1, 0)


def test_a_tied_parameter_is_scored_under_its_first_name_where_that_module_is_skipped() -> None:
    embed, head = torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False)
    head.weight = embed.weight  # tied, as GPT-2's embedding and LM head
    net = torch.nn.Sequential(embed, torch.nn.Tanh(), head)
    importance = lambda module_key, parameter_name, parameter: parameter.abs()
    scores = pruning_scores(net, tdhook_fn.params(net), importance, skip=lambda name, _m: name == "0")
    assert list(scores.keys(True, True)) == [("0", "weight")]
