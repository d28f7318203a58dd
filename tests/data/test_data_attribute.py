"""tdhook_fn.data.attribute in one process: the whole-dataset numbers, the files, the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from tensordict.memmap import MemoryMappedTensor
from torch.utils.data import Dataset

import tdhook_fn
import tdhook_fn.data
from tdhook_fn.attribution import DimsConfig, grad_cam, integrated_gradients, saliency


def _cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(3 * 6 * 6, 4)).double()


@pytest.fixture
def job():
    net = _cnn()
    g = torch.Generator().manual_seed(2)
    data = TensorDict(input=torch.randn(23, 1, 6, 6, generator=g, dtype=torch.float64),
                      label=torch.randint(0, 4, (23,), generator=g), batch_size=[23])
    return net, tdhook_fn.functional(net), tdhook_fn.params(net), data


class Items(Dataset):
    """A map-style Dataset of dicts, as a torch user writes one."""

    def __init__(self, td: TensorDict):
        self.td = td

    def __len__(self) -> int:
        return self.td.batch_size[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input": self.td["input"][i], "label": self.td["label"][i]}


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("as_dataset", [False, True], ids=["tensordict", "dataset-of-dicts"])
def test_saliency_over_the_dataset_equals_one_call_on_all_of_it(job, tmp_path, as_dataset):
    net, f, p, data = job
    target = tdhook_fn.label("label")
    out = tdhook_fn.data.attribute(saliency, f, p, Items(data) if as_dataset else data, tmp_path / "run",
                                   batch_size=5, target=target, progress=False)
    whole = saliency(f, p, data, target=target)
    assert out.batch_size == torch.Size([23]) and isinstance(out["input"], MemoryMappedTensor)
    _close(out["input"], whole["input"])
    reopened = TensorDict.load_memmap(tmp_path / "run")
    assert torch.equal(reopened["input"], out["input"])


def test_integrated_gradients_per_target_rows_hold_each_samples_maps(job, tmp_path):
    net, f, p, data = job
    data = data.exclude("label")
    kwargs = dict(target=(0, 2, 3), per_target=True, baselines=0.0, n_steps=6)
    out = tdhook_fn.data.attribute(integrated_gradients, f, p, data, tmp_path / "ig", batch_size=7,
                                   progress=False, **kwargs)
    whole = integrated_gradients(f, p, data, **kwargs)  # [T, N]
    assert out.batch_size == torch.Size([23, 3])
    _close(out["input"], whole["input"].transpose(0, 1))


def test_grad_cam_over_the_dataset_equals_one_call(job, tmp_path):
    net, f, p, data = job
    kwargs = dict(target=1, layers={"[1]": DimsConfig((1, 2), (0,))})
    out = tdhook_fn.data.attribute(grad_cam, f, p, data.exclude("label"), tmp_path / "cam", batch_size=6,
                                   progress=False, **kwargs)
    whole = grad_cam(f, p, data.exclude("label"), **kwargs)
    assert set(out.keys(True, True)) == set(whole.keys(True, True))
    for key in whole.keys(True, True):
        _close(out[key], whole[key])


def test_baselines_may_be_a_callable_of_the_batch(job, tmp_path):
    net, f, p, data = job
    data = data.exclude("label")
    blur = lambda batch: TensorDict(input=batch["input"].mean(dim=(2, 3), keepdim=True).expand_as(batch["input"]),
                                    batch_size=batch.batch_size)
    out = tdhook_fn.data.attribute(integrated_gradients, f, p, data, tmp_path / "b", batch_size=4, target=0,
                                   baselines=blur, n_steps=4, progress=False)
    whole = integrated_gradients(f, p, data, target=0, baselines=blur(data), n_steps=4)
    _close(out["input"], whole["input"])


def _counting(log: Path):
    """saliency logging each batch's size to the file ``log``, and a reader of the log.

    A file, not a list: the values of the globals and closure cells a method reads are part
    of its fingerprint, so a list it grows would make each run another job.
    """
    path = str(log)

    def counted_saliency(f, params, inputs, **kwargs):
        with open(path, "a") as fh:
            fh.write(f"{inputs.batch_size[0]}\n")
        return saliency(f, params, inputs, **kwargs)

    return counted_saliency, lambda: [int(n) for n in log.read_text().split()] if log.exists() else []


def test_a_method_closing_over_changing_state_is_another_job(job, tmp_path):
    net, f, p, data = job
    seen: list[int] = []
    def method(f, params, inputs, **kwargs):
        seen.append(1)
        return saliency(f, params, inputs, **kwargs)
    tdhook_fn.data.attribute(method, f, p, data, tmp_path / "r", target=1, progress=False)
    with pytest.raises(ValueError, match="method differ"):
        tdhook_fn.data.attribute(method, f, p, data, tmp_path / "r", target=1, progress=False)


def test_a_finished_out_dir_is_returned_without_attributing_again(job, tmp_path):
    net, f, p, data = job
    method, calls = _counting(tmp_path / "calls")
    first = tdhook_fn.data.attribute(method, f, p, data, tmp_path / "r", batch_size=10, target=1, progress=False)
    assert calls() == [10, 10, 3]
    again = tdhook_fn.data.attribute(method, f, p, data, tmp_path / "r", batch_size=10, target=1, progress=False)
    assert calls() == [10, 10, 3]
    assert torch.equal(first["input"], again["input"])


def test_a_partial_out_dir_resumes_only_its_missing_batches(job, tmp_path):
    net, f, p, data = job
    method, calls = _counting(tmp_path / "calls")
    full = tdhook_fn.data.attribute(method, f, p, data, tmp_path / "r", batch_size=5, target=1, progress=False)
    expected = full["input"].clone()
    for name in ("2", "4"):
        (tmp_path / "r" / "_done" / name).unlink()
    (tmp_path / "r" / "_complete").unlink()
    (tmp_path / "calls").unlink()
    with pytest.raises(FileExistsError, match="resume=False"):
        tdhook_fn.data.attribute(method, f, p, data, tmp_path / "r", batch_size=5, target=1, progress=False,
                                 resume=False)
    out = tdhook_fn.data.attribute(method, f, p, data, tmp_path / "r", batch_size=5, target=1, progress=False)
    assert calls() == [5, 3]  # batches 2 and 4 only
    assert torch.equal(out["input"], expected)


@pytest.mark.parametrize("change", ["method", "target", "n_samples", "params", "batch_size", "values"])
def test_an_out_dir_of_another_job_is_refused_and_overwrite_starts_again(job, tmp_path, change):
    net, f, p, data = job
    base = dict(method=saliency, params=p, dataset=data, batch_size=5, target=1)
    tdhook_fn.data.attribute(base["method"], f, p, data, tmp_path / "r", batch_size=5, target=1, progress=False)
    other = dict(base)
    if change == "method":
        other["method"] = _counting(tmp_path / "calls")[0]
    elif change == "target":
        other["target"] = 2
    elif change == "n_samples":
        other["dataset"] = data[:20]
    elif change == "params":
        other["params"] = p.apply(lambda t: t * 2)
    elif change == "batch_size":
        other["batch_size"] = 6
    else:
        changed = data.clone()
        changed["input"][-1] += 1
        other["dataset"] = changed
    run = lambda **extra: tdhook_fn.data.attribute(other["method"], f, other["params"], other["dataset"],
                                                   tmp_path / "r", batch_size=other["batch_size"],
                                                   target=other["target"], progress=False, **extra)
    before = json.loads((tmp_path / "r" / "_job.json").read_text())
    with pytest.raises(ValueError, match="holds another job") as err:
        run()
    assert {"method": "method", "target": "argument target", "n_samples": "dataset", "params": "params",
            "batch_size": "batch_size", "values": "dataset"}[change] in str(err.value)
    assert json.loads((tmp_path / "r" / "_job.json").read_text()) == before  # nothing written
    out = run(overwrite=True)
    whole = saliency(f, other["params"], other["dataset"], target=other["target"])
    _close(out["input"], whole["input"])


def test_labels_closed_over_by_the_target_are_part_of_the_job(job, tmp_path):
    net, f, p, data = job
    data = data.set("other", data["label"].flip(0))
    tdhook_fn.data.attribute(saliency, f, p, data, tmp_path / "r", target=tdhook_fn.label("label", "output"),
                             progress=False)
    with pytest.raises(ValueError, match="argument target"):
        tdhook_fn.data.attribute(saliency, f, p, data, tmp_path / "r", target=tdhook_fn.label("other", "output"),
                                 progress=False)


def test_a_directory_not_written_by_attribute_is_never_deleted(job, tmp_path):
    net, f, p, data = job
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("years of work")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError, match="never deleted"):
            tdhook_fn.data.attribute(saliency, f, p, data, tmp_path / "mine", target=1, progress=False,
                                     overwrite=overwrite)
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "years of work"
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        tdhook_fn.data.attribute(saliency, f, p, data, tmp_path / "file", target=1, progress=False)


def test_the_model_and_params_are_untouched(job, tmp_path):
    net, f, p, data = job
    before = {k: v.clone() for k, v in net.state_dict().items()}
    p_before = p.clone()
    tdhook_fn.data.attribute(saliency, f, p, data, tmp_path / "r", batch_size=8, target=1, progress=False)
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    assert (p == p_before).all()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(batch_size=0), ValueError, "batch_size must be a positive int"),
        (dict(batch_size=2.5), ValueError, "batch_size must be a positive int"),
        (dict(dataset=torch.randn(4, 1, 6, 6)), TypeError, "dataset is a Tensor; name its key"),
        (dict(dataset=object()), TypeError, "dataset must be a TensorDict"),
        (dict(dataset=TensorDict(input=torch.randn(1, 6, 6), batch_size=[])), ValueError, "leading batch dim"),
        (dict(dataset=[(torch.randn(1, 6, 6), 0)]), TypeError, r"dataset\[0\] is a tuple"),
        (dict(dataset=TensorDict(input=torch.randn(0, 1, 6, 6), batch_size=[0])), ValueError, "empty"),
        (dict(method=lambda f, p, x, **k: x["input"]), TypeError, "returned a Tensor, not a TensorDict"),
        (dict(method=lambda f, p, x, **k: x[:1]), ValueError, "expected the samples along dim 0"),
        (dict(params={"weight": torch.ones(1)}), TypeError, "params must be a TensorDict"),
        (dict(method="saliency"), TypeError, "method must be a pure method"),
    ],
)
def test_bad_arguments_raise_clear_errors(job, tmp_path, kwargs, error, match):
    net, f, p, data = job
    args = dict(method=saliency, params=p, dataset=data.exclude("label"), batch_size=4) | kwargs
    with pytest.raises(error, match=match):
        tdhook_fn.data.attribute(args["method"], f, args["params"], args["dataset"], tmp_path / "r",
                                 batch_size=args["batch_size"], target=1, progress=False)


def test_the_progress_bar_shows_on_a_terminal_only(job, tmp_path, monkeypatch, capsys):
    net, f, p, data = job
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    tdhook_fn.data.attribute(saliency, f, p, data, tmp_path / "tty", batch_size=5, target=1)
    shown = capsys.readouterr().err
    assert "attribute" in shown and "23/23" in shown and "sample/s" in shown
    tdhook_fn.data.attribute(saliency, f, p, data, tmp_path / "off", batch_size=5, target=1, progress=False)
    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    tdhook_fn.data.attribute(saliency, f, p, data, tmp_path / "pipe", batch_size=5, target=1)
    assert capsys.readouterr().err == ""


def test_a_changed_module_or_tap_closure_is_another_job(tmp_path):
    """A module attribute (not a tensor) or a list a tap closes over changes the job: refused, never reused."""
    from tdhook_fn.attribution import saliency

    data = TensorDict(input=torch.randn(10, 4), batch_size=[10])
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LeakyReLU(0.01), torch.nn.Linear(8, 3)).eval()
    f, p = tdhook_fn.pure(net)

    def run(g, out):
        return tdhook_fn.data.attribute(saliency, g, p, data, out, batch_size=4, target=1, progress=False)

    run(f, tmp_path / "a")
    net[1].negative_slope = 0.9
    with pytest.raises(ValueError):
        run(f, tmp_path / "a")

    def ablate(units):
        return lambda h: h.index_fill(-1, torch.tensor(units), 0.0)

    run(f.with_taps(tdhook_fn.intervene("[1]", ablate([0, 1, 2, 3]))), tmp_path / "b")
    with pytest.raises(ValueError):
        run(f.with_taps(tdhook_fn.intervene("[1]", ablate([4, 5, 6, 7]))), tmp_path / "b")
