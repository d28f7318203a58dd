"""Paths reach only the user's modules: calls follow an allow-list, checked before any call runs.

A path calls ``get_submodule``/``get_parameter``/``get_buffer`` or a method the user's own
``nn.Module`` class defines, on a module; nothing else a model holds (NOTE [path calls]).
"""

import importlib
import logging
import pathlib
import random
import sys
from collections import defaultdict

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

import tdhook_fn
from tdhook_fn._code_origin import library_of
from tdhook_fn._paths import PathError, resolve_path
from tdhook_fn.attribution import saliency
from tdhook_fn.compat.hooks import resolve_submodule_path
from tdhook_fn.compat.latent import ActivationPatching
from tdhook_fn.compat.modules import HookedModule


class Helper:
    """A plain object (not a module) whose own method records its calls."""

    def __init__(self) -> None:
        self.pokes: list[int] = []

    def poke(self, i: int = 0) -> int:
        self.pokes.append(i)
        return i


class Holder(nn.Module):
    """A model holding, next to its layers, objects a path must not touch."""

    def __init__(self, checkpoint: pathlib.Path) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 2)])
        self.checkpoint = checkpoint
        self.log = logging.getLogger("tdhook_fn.tests.paths_allow_list")
        self.rng = torch.Generator().manual_seed(0)
        self.pyrng = random.Random(0)
        self.helper = Helper()
        self.table = {"a": 1}
        self.items = [self.layers[0]]
        self.lazy: defaultdict[str, list[int]] = defaultdict(list)
        self.calls: list[str] = []

    def fn(self, i):
        self.calls.append("fn")
        return self.layers[i]

    def me(self):
        self.calls.append("me")
        return self

    def helper_of(self):
        self.calls.append("helper_of")
        return self.helper

    @torch.no_grad()
    def guarded(self, i):  # a torch decorator on the user's own method: still the user's
        self.calls.append("guarded")
        return self.layers[i]

    @property
    def head(self):
        return self.layers[-1]

    def forward(self, input):
        return self.layers[1](self.layers[0](input))


@pytest.fixture
def holder(tmp_path):
    checkpoint = tmp_path / "ckpt.pt"
    checkpoint.write_text("weights")
    model = Holder(checkpoint)
    model.log.setLevel(logging.WARNING)
    return model


def _untouched(model: Holder) -> dict[str, object]:
    return {
        "file": model.checkpoint.read_text() if model.checkpoint.exists() else None,
        "files": sorted(p.name for p in model.checkpoint.parent.iterdir()),
        "level": model.log.level,
        "rng": model.rng.get_state().clone(),
        "pyrng": model.pyrng.getstate(),
        "pokes": list(model.helper.pokes),
        "table": dict(model.table),
        "items": list(model.items),
        "lazy": dict(model.lazy),
        "calls": list(model.calls),
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


def _assert_same(before: dict[str, object], after: dict[str, object]) -> None:
    assert after.keys() == before.keys()
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, after[key]), key  # type: ignore[arg-type]
        elif key == "state":
            assert all(torch.equal(v, after[key][k]) for k, v in value.items()), key  # type: ignore
        else:
            assert after[key] == value, key


# The reproducers and their kin: a call on anything a model holds that is not a module.
NOT_A_MODULE = [
    ("checkpoint.write_text('x')", "pathlib"),
    ("checkpoint.unlink()", "pathlib"),
    ("checkpoint.touch()", "pathlib"),
    ("log.setLevel(50)", "logging.Logger"),
    ("log.root", "logging.Logger"),  # a class attribute, not the instance's own
    ("rng.seed()", "Generator"),
    ("rng.manual_seed(3)", "Generator"),
    ("pyrng.seed(3)", "random.Random"),
    ("helper.poke(1)", "Helper"),
    ("items.count(None)", "list"),
    ("checkpoint.parent", "pathlib"),
    ("checkpoint.name", "pathlib"),
    ("layers[0].weight.data", "Parameter"),
    ("layers[0].weight[0]", "Parameter"),
    ("lazy['missing']", "defaultdict"),
]


@pytest.mark.parametrize(("path", "fragment"), NOT_A_MODULE)
def test_nothing_but_modules_is_called_read_or_indexed(holder, path, fragment):
    before = _untouched(holder)
    with pytest.raises(PathError, match="not an nn.Module|nn.Module objects|not nn.Module") as e:
        resolve_path(holder, path)
    assert repr(path) in str(e.value) and fragment in str(e.value)
    _assert_same(before, _untouched(holder))
    assert holder.checkpoint.read_text() == "weights"


def test_an_objects_own_attributes_are_read_as_tdhook_does_and_nothing_that_runs_code(holder):
    class Plain:
        def __init__(self):
            self.child = {"first": [1, 2]}

        @property
        def computed(self):  # a property runs code: never read
            raise AssertionError("ran")

    holder.plain = Plain()
    assert resolve_path(holder, "log.disabled") is holder.log.disabled
    assert resolve_path(holder, "plain.child['first'][1]") == 2
    with pytest.raises(PathError, match="own attributes"):
        resolve_path(holder, "plain.computed")


@pytest.mark.parametrize(
    "path",
    [
        "fn(0).checkpoint.unlink()",  # fn(0) must not run first
        "me().checkpoint.unlink()",
        "me().log.setLevel(50)",
        "me().pyrng.seed(3)",
        "me().me().helper.poke(2)",
        "get_submodule('layers').checkpoint.write_text('x')",
        "helper_of().poke(3)",
    ],
)
def test_a_later_call_no_module_class_defines_is_refused_before_any_call_runs(holder, path):
    before = _untouched(holder)
    with pytest.raises(PathError, match="no module class of this model defines") as e:
        resolve_path(holder, path)
    assert repr(path) in str(e.value)
    _assert_same(before, _untouched(holder))
    assert holder.calls == []


def test_a_later_call_needs_a_module_returned_by_the_earlier_one(holder):
    # 'me' is a method of the model's own class, so the name passes before anything runs;
    # helper_of() then returns a plain object, and the path stops before calling on it.
    with pytest.raises(PathError, match="'helper_of' returned a .*Helper, not an nn.Module"):
        resolve_path(holder, "helper_of().me()")
    assert holder.calls == ["helper_of"] and holder.helper.pokes == []


def test_the_user_s_own_methods_properties_and_lookups_still_resolve(holder):
    assert resolve_path(holder, "fn(1)") is holder.layers[1]
    assert resolve_path(holder, "me().fn(0)") is holder.layers[0]
    assert resolve_path(holder, "guarded(0)") is holder.layers[0]
    assert resolve_path(holder, "head") is holder.layers[1]
    assert resolve_path(holder, "checkpoint") is holder.checkpoint  # reading it is fine
    assert resolve_path(holder, "items[0]") is holder.layers[0]
    assert resolve_path(holder, "table['a']") == 1
    assert resolve_path(holder, "me().get_submodule('layers.1')") is holder.layers[1]
    assert resolve_path(holder, "get_parameter('layers.0.bias')") is holder.layers[0].bias
    assert holder.calls == ["fn", "me", "fn", "guarded", "me"]


class Mixed(nn.Module, logging.Filterer):
    """A user module inheriting a standard-library mixin: its methods are not the user's."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        logging.Filterer.__init__(self)
        self.lin = nn.Linear(2, 2)

    wipe = staticmethod(pathlib.Path.unlink)  # a library function under the user's name
    tidy = logging.Logger.setLevel


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("addFilter('x')", "defined in logging"),
        ("removeFilter('x')", "defined in logging"),
        ("tidy(50)", "defined in logging"),
        ("wipe('nothing')", "defined in pathlib"),
    ],
)
def test_methods_inherited_from_other_libraries_are_refused(path, fragment):
    model = Mixed()
    with pytest.raises(PathError, match="is library code") as e:
        resolve_path(model, path)
    assert fragment in str(e.value)
    assert model.filters == []


FAKE_LIBRARY = '''
import pathlib
from torch import nn


class Saver(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def snapshot(self, where):
        pathlib.Path(where).write_text("saved")
        return self.lin
'''


def test_methods_of_a_library_installed_in_site_packages_are_refused(tmp_path, monkeypatch):
    packages = tmp_path / "site-packages"
    packages.mkdir()
    (packages / "fake_saver_lib.py").write_text(FAKE_LIBRARY)
    monkeypatch.syspath_prepend(str(packages))
    monkeypatch.delitem(sys.modules, "fake_saver_lib", raising=False)
    saver_class = importlib.import_module("fake_saver_lib").Saver

    class UserModel(saver_class):  # the user's subclass: inherited methods stay the library's
        def lin_again(self):
            return self.lin

    model = UserModel()
    target = tmp_path / "written.txt"
    with pytest.raises(PathError, match=r"Saver.snapshot' is library code \(defined in fake_saver_lib\)"):
        resolve_path(model, f"snapshot({str(target)!r})")
    assert not target.exists()
    assert resolve_path(model, "lin_again()") is model.lin


@pytest.mark.parametrize("path", ["disable_context()", "restore()", "td_module.module.fn(0)"])
def test_tdhook_fn_s_own_module_classes_are_library_code(path):
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def fn(self, i):
            return self.lin

        def forward(self, input):
            return self.lin(input)

    hooked = HookedModule(TensorDictModule(Net(), ["input"], ["y"]))
    if path.startswith("td_module"):  # the user's module inside: its own methods stay callable
        assert resolve_path(hooked, path) is hooked.td_module.module.lin
        return
    with pytest.raises(PathError, match="is library code") as e:
        resolve_path(hooked, path)
    assert "tdhook_fn.compat" in str(e.value)


def test_library_of_tells_library_code_from_user_code():
    assert library_of(pathlib.Path.unlink) == "pathlib"
    assert library_of(nn.Module.train).startswith("torch.")
    assert library_of(TensorDict.update).startswith("tensordict")
    assert library_of(tdhook_fn.resolve_path) == "tdhook_fn._paths"
    assert library_of(Holder.fn) is None  # tests are user code
    assert library_of(Holder.guarded) is None  # unwrapped from torch.no_grad's wrapper
    pytest.importorskip("hypothesis")
    from hypothesis import given

    assert library_of(given) is not None  # installed in site-packages


def test_the_decision_is_made_again_when_the_class_changes(holder, monkeypatch):
    assert resolve_path(holder, "fn(0)") is holder.layers[0]
    monkeypatch.setattr(Holder, "fn", pathlib.Path.unlink)
    with pytest.raises(PathError, match="defined in pathlib"):
        resolve_path(holder, "fn(0)")
    assert holder.checkpoint.exists()


def test_compat_resolver_and_saliency_layers_refuse_before_touching_the_file(holder):
    before = _untouched(holder)
    with pytest.raises(PathError):
        resolve_submodule_path(holder, "checkpoint.unlink()")
    f = tdhook_fn.functional(holder)
    inputs = TensorDict(input=torch.randn(4, 3), batch_size=[4])
    with pytest.raises(PathError, match="checkpoint.unlink"):
        saliency(f, tdhook_fn.params(holder), inputs, target=0, layers=["checkpoint.unlink()"])
    _assert_same(before, _untouched(holder))
    assert holder.checkpoint.read_text() == "weights"


def test_compat_activation_patching_refuses_before_touching_the_file(holder):
    before = _untouched(holder)
    holder.ckpt = holder.checkpoint
    context = ActivationPatching(["ckpt.unlink()"])
    with pytest.raises(PathError, match="ckpt.unlink"), context.prepare(holder, in_keys=["input"], out_keys=["y"]):
        pass
    assert holder.checkpoint.read_text() == "weights"
    del holder.ckpt
    _assert_same(before, _untouched(holder))
