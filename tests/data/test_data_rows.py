"""Every row of the dataset counts: a changed or reordered sample never gets the old rows back.

A TensorDict dataset is digested whole (every leaf) into the job; a map-style Dataset,
read lazily, is digested a batch at a time as it is read, and the digest recorded with
each batch is checked when an ``out_dir`` is resumed or returned.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch.utils.data import Dataset

import tdhook_fn
import tdhook_fn.data
from tdhook_fn.attribution import integrated_gradients

N, BATCH = 12, 4  # three batches: samples 0-3, 4-7, 8-11


class Items(Dataset):
    """A map-style Dataset of dicts, read one item at a time."""

    def __init__(self, x: torch.Tensor):
        self.x = x

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input": self.x[i]}


@pytest.fixture
def model():
    torch.manual_seed(0)  # a nonlinear model: its IG maps depend on the inputs
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    return tdhook_fn.functional(net), tdhook_fn.params(net)


def _inputs() -> torch.Tensor:
    return torch.randn(N, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _changed(x: torch.Tensor, change: str) -> torch.Tensor:
    """``x`` with its first and last samples kept, and a middle one changed or two swapped."""
    x = x.clone()
    if change == "middle":
        x[5] += 10.0
    else:
        x[[5, 6]] = x[[6, 5]]
    return x


def _run(model, dataset, out_dir, **extra):
    f, p = model
    return tdhook_fn.data.attribute(integrated_gradients, f, p, dataset, out_dir, batch_size=BATCH, target=1,
                                    baselines=0.0, n_steps=4, progress=False, **extra)


def _fresh(model, x: torch.Tensor) -> torch.Tensor:
    f, p = model
    return integrated_gradients(f, p, TensorDict(input=x, batch_size=[N]), 0.0, target=1, n_steps=4)["input"]


@pytest.mark.parametrize("change", ["middle", "reorder"])
def test_a_tensordict_dataset_changed_anywhere_is_another_job(model, tmp_path, change):
    x = _inputs()
    _run(model, TensorDict(input=x, batch_size=[N]), tmp_path / "r")
    changed = TensorDict(input=_changed(x, change), batch_size=[N])
    with pytest.raises(ValueError, match="holds another job: dataset differ"):
        _run(model, changed, tmp_path / "r")
    out = _run(model, changed, tmp_path / "r", overwrite=True)
    torch.testing.assert_close(out["input"], _fresh(model, changed["input"]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("change", ["middle", "reorder"])
def test_a_finished_out_dir_of_a_changed_dataset_is_refused_naming_the_batch(model, tmp_path, change):
    x = _inputs()
    _run(model, Items(x), tmp_path / "r")
    with pytest.raises(ValueError, match=r"batch 1 \(samples 4 to 7\).*new out_dir.*delete the old one"):
        _run(model, Items(_changed(x, change)), tmp_path / "r")
    out = _run(model, Items(_changed(x, change)), tmp_path / "r", overwrite=True)
    torch.testing.assert_close(out["input"], _fresh(model, _changed(x, change)), rtol=1e-12, atol=1e-12)


def test_a_partial_out_dir_resumes_only_if_its_recorded_batches_are_unchanged(model, tmp_path):
    x = _inputs()
    _run(model, Items(x), tmp_path / "r")
    (tmp_path / "r" / "_done" / "2").unlink()  # killed before batch 2 was recorded
    (tmp_path / "r" / "_complete").unlink()
    with pytest.raises(ValueError, match=r"batch 1 \(samples 4 to 7\)"):
        _run(model, Items(_changed(x, "middle")), tmp_path / "r")  # a recorded batch changed: no mixed rows
    assert sorted(p.name for p in (tmp_path / "r" / "_done").iterdir()) == ["0", "1"]  # nothing written
    later = x.clone()
    later[9] += 10.0  # only the batch still to do changed: it is attributed on the data as it is now
    out = _run(model, Items(later), tmp_path / "r")
    torch.testing.assert_close(out["input"], _fresh(model, later), rtol=1e-12, atol=1e-12)
