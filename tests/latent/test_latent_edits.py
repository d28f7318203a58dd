"""Edits at sites do what they say or raise: tuple elements, selections, runs, sources, modes."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from zoo import same, snapshot

import tdhook_fn
from tdhook_fn.latent import Site, activation_addition, cache, patch, patching_sweep, steer


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return 2.0 * x, self.lin(x)


class PairNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair, self.out, self.unused = Pair(), nn.Linear(4, 3), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.pair(x)
        return self.out(a + b)


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lin(self.lin(x)))


def pure(model: nn.Module) -> tuple[tdhook_fn.Functional, TensorDict]:
    torch.manual_seed(0)
    return tdhook_fn.pure(model.double())


def batch(*shape: int) -> TensorDict:
    return TensorDict(input=torch.randn(*shape, dtype=torch.float64), batch_size=shape[:1])


@pytest.mark.parametrize("element", [1, -1])
def test_a_negative_element_edits_that_element_of_a_tuple(element: int) -> None:
    torch.manual_seed(0)
    model = PairNet().double()
    f, p = tdhook_fn.pure(model)
    x, source = batch(5, 4), torch.randn(5, 4, dtype=torch.float64)
    out = patch(f, p, x, Site("pair", element=element), TensorDict({"pair#" + str(element): source}, batch_size=[5]))
    with torch.no_grad():
        expected = model.out(2.0 * x["input"] + source)
    torch.testing.assert_close(out["output"], expected)
    steered = steer(f, p, x, Site("pair", element=element), TensorDict({"pair#" + str(element): source[0]}), alpha=2.0)
    with torch.no_grad():
        expected = model.out(2.0 * x["input"] + model.pair.lin(x["input"]) + 2.0 * source[0])
    torch.testing.assert_close(steered["output"], expected)


def test_an_index_with_two_lists_is_refused() -> None:
    with pytest.raises(ValueError, match="more than one list"):
        Site("[0]", index=([0, 2], [1, 3]))


def test_activation_addition_of_one_unbatched_pair_is_its_difference() -> None:
    f, p = pure(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)))
    pos, neg = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    one = activation_addition(f, p, TensorDict(input=pos), TensorDict(input=neg), "[1]")["1"]
    batched = activation_addition(f, p, TensorDict(input=pos[None], batch_size=[1]),
                                  TensorDict(input=neg[None], batch_size=[1]), "[1]")["1"]
    assert one.shape == (4,)
    torch.testing.assert_close(one, batched)


@pytest.mark.parametrize("method", ["patch", "steer"])
def test_an_edit_that_never_runs_or_runs_twice_raises(method: str) -> None:
    def edit(f: tdhook_fn.Functional, p: TensorDict, site: Site) -> None:
        values = TensorDict({site.key: torch.zeros(4, dtype=torch.float64)})
        if method == "patch":
            patch(f, p, batch(5, 4), site, values)
        else:
            steer(f, p, batch(5, 4), site, values)

    f, p = pure(PairNet())
    with pytest.raises(ValueError, match="'unused' never ran"):
        edit(f, p, Site("unused"))
    with pytest.raises(ValueError, match=r"never ran in the forward \(call=3"):
        edit(f, p, Site("out", call=3))
    f, p = pure(Twice())
    with pytest.raises(ValueError, match="'lin' ran 2 times"):
        edit(f, p, Site("lin"))
    edit(f, p, Site("lin", call=1))


def test_patch_never_writes_the_callers_sources() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 3)).double()
    f, p = pure(model)
    clean = cache(f, p, batch(5, 4), "[0]")
    assert bool((clean["0"] < 0).any())
    kept = clean["0"].clone()
    before = snapshot(model)
    out = patch(f, p, batch(5, 4), "[0]", clean)
    with torch.no_grad():
        expected = model[2](torch.relu(kept))
    torch.testing.assert_close(out["output"], expected)
    assert torch.equal(clean["0"], kept) and same(snapshot(model), before)


def test_a_per_sample_source_meets_the_activation_batch_first() -> None:
    # [N, D] per sample at a [N, L, D] site with N == L: each sample's vector at all of its positions
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).double()
    f, p = pure(model)
    x = TensorDict(input=torch.randn(3, 3, 4, dtype=torch.float64), batch_size=[3])
    v = torch.randn(3, 4, dtype=torch.float64)
    out = patch(f, p, x, "[0]", TensorDict({"0": v}, batch_size=[3]))
    with torch.no_grad():
        torch.testing.assert_close(out["output"], model[1](v[:, None, :].expand(3, 3, 4)))
        steered = steer(f, p, x, "[0]", TensorDict({"0": v}, batch_size=[3]), alpha=0.5)
        torch.testing.assert_close(steered["output"], model[1](model[0](x["input"]) + 0.5 * v[:, None, :]))
        several = steer(f, p, x, "[0]", TensorDict({"0": v}, batch_size=[3]), alpha=torch.tensor([0.5, 2.0]))
        torch.testing.assert_close(several["output"][1], model[1](model[0](x["input"]) + 2.0 * v[:, None, :]))


def test_runs_that_share_a_batch_refuse_batch_statistics_and_vmap_refuses_dropout() -> None:
    sites = [Site("[2]", index=(i,)) for i in range(4)]
    metric = lambda out: out["output"][..., 0]
    f, p = pure(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.Linear(4, 3)).train())
    for batching in ("vmap", "fold"):
        with pytest.raises(ValueError, match=r"batch norms that normalise with the statistics of the batch"):
            patching_sweep(f, p, batch(5, 4), batch(5, 4), sites, metric, batching=batching)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"batch norms"):
        steer(f, p, batch(5, 4), "[2]", TensorDict({"2": torch.ones(4)}), alpha=torch.tensor([0.0, 1.0]))
    cache(f, p, batch(5, 4), "[2]")  # one forward of the caller's batch: the model's own train-mode forward
    def dropping() -> tuple[tdhook_fn.Functional, TensorDict]:  # a new model: each warns once
        return pure(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4), nn.Linear(4, 3)).train())

    f, p = dropping()
    with pytest.raises(ValueError, match=r"dropout in training mode \(under vmap"), pytest.warns(RuntimeWarning):
        patching_sweep(f, p, batch(5, 4), batch(5, 4), sites, metric)
    f, p = dropping()
    with pytest.warns(RuntimeWarning, match="dropout in training mode"):
        patching_sweep(f, p, batch(5, 4), batch(5, 4), sites, metric, batching="fold")


def test_negative_entries_of_a_list_index_count_from_the_end() -> None:
    f, p = pure(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)))
    x, source = batch(5, 4), torch.randn(5, 2, dtype=torch.float64)
    negative = patch(f, p, x, Site("[1]", index=([-1, 0],)), TensorDict({"1[[-1, 0]]": source}, batch_size=[5]))
    positive = patch(f, p, x, Site("[1]", index=([3, 0],)), TensorDict({"1[[3, 0]]": source}, batch_size=[5]))
    torch.testing.assert_close(negative["output"], positive["output"])


def test_the_callers_inputs_are_never_written_by_in_place_modules() -> None:
    f, p = pure(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4), nn.Linear(4, 3)))
    x = batch(5, 4)
    kept = x["input"].clone()
    assert bool((kept < 0).any())
    clean = cache(f, p, x, "[1]")
    patch(f, p, x, "[1]", clean)
    steer(f, p, x, "[1]", TensorDict({"1": torch.ones(4, dtype=torch.float64)}))
    patching_sweep(f, p, x, batch(5, 4), [Site("[1]", index=(i,)) for i in range(4)], lambda out: out["output"][..., 0])
    assert torch.equal(x["input"], kept)
