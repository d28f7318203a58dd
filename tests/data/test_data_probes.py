"""data.fit_probes: a dataset streamed through a model equals the in-memory probes, and resumes where it stopped."""

import pytest
import torch
from tensordict import TensorDict
from torch.utils.data import Dataset

import tdhook_fn
import tdhook_fn.data
from tdhook_fn.latent import Site, cache
from tdhook_fn.latent.probing import fit_probes

SITES = ["[0]", "[2]", Site("[1]", index=(slice(0, 5),))]  # widths 12, 12 (one solve) and 5


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 12)).double().eval()


def _data(n=83, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64) * 3 + 1  # float64: batches of any size agree
    return TensorDict(input=x, label=(x[:, 0] > 1).long() + (x[:, 1] > 2).long(), batch_size=[n])


class Items(Dataset):
    """A lazily read dataset that can fail at one item (a killed run) and counts what it read."""

    def __init__(self, data, fail_at=None):
        self.data, self.fail_at, self.reads = data, fail_at, 0

    def __len__(self):
        return self.data.batch_size[0]

    def __getitem__(self, i):
        if i == self.fail_at:
            raise KeyboardInterrupt("killed")
        self.reads += 1
        return {"input": self.data["input"][i], "label": self.data["label"][i]}


def _in_memory(f, p, data, alpha=1.0, task="auto"):
    acts = cache(f, p, data.exclude("label"), SITES, detach=True, dtype=torch.float64)
    return fit_probes(acts, data["label"], alpha=alpha, task=task)


def _close(a, b):
    for key in a.keys(True, True):
        if a[key].is_floating_point():
            torch.testing.assert_close(a[key], b[key], rtol=1e-9, atol=1e-10)
        else:
            assert torch.equal(a[key], b[key])


def test_streamed_equals_in_memory(tmp_path):
    model, data = _model(), _data()
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    streamed = tdhook_fn.data.fit_probes(f, p, data, SITES, tmp_path / "run", batch_size=10, alpha=0.3, progress=False)
    _close(streamed, _in_memory(f, p, data, alpha=0.3))
    again = tdhook_fn.data.fit_probes(f, p, data, SITES, tmp_path / "run", batch_size=10, alpha=5.0, progress=False)
    _close(again, _in_memory(f, p, data, alpha=5.0))  # a finished run is solved again, with another penalty


def test_regression_targets(tmp_path):
    model, data = _model(), _data()
    data["label"] = data["input"][:, :2] ** 2
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    streamed = tdhook_fn.data.fit_probes(f, p, data, SITES, tmp_path / "r", batch_size=16, progress=False)
    _close(streamed, _in_memory(f, p, data))


def test_killed_run_resumes_from_its_checkpoint(tmp_path):
    model, data = _model(), _data()
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    classes = torch.arange(3)
    killed = Items(data, fail_at=55)
    with pytest.raises(KeyboardInterrupt):
        tdhook_fn.data.fit_probes(f, p, killed, SITES, tmp_path / "run", batch_size=10, classes=classes,
                                  checkpoint_every=2, progress=False)
    resumed = Items(data)
    probes = tdhook_fn.data.fit_probes(f, p, resumed, SITES, tmp_path / "run", batch_size=10, classes=classes,
                                       checkpoint_every=2, progress=False)
    _close(probes, _in_memory(f, p, data))
    # batches 0-3 were checkpointed: they are read again only to check their digests, then 4-8 run
    assert resumed.reads == 40 + 43


def test_refusals(tmp_path):
    model, data = _model(), _data()
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    tdhook_fn.data.fit_probes(f, p, data, SITES, tmp_path / "run", batch_size=10, progress=False)
    with pytest.raises(ValueError, match="another job: batch_size differ"):
        tdhook_fn.data.fit_probes(f, p, data, SITES, tmp_path / "run", batch_size=20, progress=False)
    with pytest.raises(ValueError, match="give classes="):
        tdhook_fn.data.fit_probes(f, p, Items(data), SITES, tmp_path / "lazy", batch_size=10, progress=False)
    changed = _data()
    changed["input"][3] += 1
    items = Items(data)
    with pytest.raises(KeyboardInterrupt):
        tdhook_fn.data.fit_probes(f, p, Items(data, fail_at=50), SITES, tmp_path / "lazy2", batch_size=10,
                                  classes=torch.arange(3), checkpoint_every=1, progress=False)
    items = Items(changed)
    with pytest.raises(ValueError, match="batch 0 .* differs"):
        tdhook_fn.data.fit_probes(f, p, items, SITES, tmp_path / "lazy2", batch_size=10, classes=torch.arange(3),
                                  checkpoint_every=1, progress=False)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not written by"):
        tdhook_fn.data.fit_probes(f, p, data, SITES, tmp_path / "foreign", progress=False)
    with pytest.raises(ValueError, match="label_key='y'"):
        tdhook_fn.data.fit_probes(f, p, data, SITES, tmp_path / "nolabel", label_key="y", progress=False)
