"""Paths never change the model: refused calls are refused by name, before anything runs.

Regression tests for an audit of NOTE [safe paths]: a user class overriding ``train``, a
TensorDictModule's ``reset_parameters_recursive``, compat's ``HookedModule.get`` calling
the method before failing, and unbounded parse cost and cache memory.
"""

import gc
import sys
import threading
import tracemalloc
import types

import pytest
import torch
from tdhook.hooks import resolve_submodule_path as tdhook_resolve
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

import tdhook_fn
from tdhook_fn._path_cache import ParseCache, footprint
from tdhook_fn._path_calls import call_refusal
from tdhook_fn._paths import _CACHE, _MAX_LENGTH, PathError, parse_path, resolve_path
from tdhook_fn.compat.hooks import resolve_submodule_path
from tdhook_fn.compat.modules import HookedModule


class Counted(nn.Module):
    """A model whose own methods count their calls, some named like torch's API."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3), nn.ReLU())])
        self.register_buffer("stat", torch.arange(3.0))
        self.calls: list[str] = []

    def fn(self, i):
        self.calls.append("fn")
        return self.layers[i]

    def ok(self):
        self.calls.append("ok")
        return self

    def train(self, mode=True):
        self.calls.append("train")
        return super().train(mode)

    def forward(self, x):
        self.calls.append("forward")
        return self.layers[1](self.layers[0](x))

    def reset_parameters(self):
        self.calls.append("reset_parameters")
        for layer in self.modules():
            if isinstance(layer, nn.Linear):
                layer.reset_parameters()
        return self

    def get(self, i):
        self.calls.append("get")
        return self.layers[i]

    def pick_(self, i):
        self.calls.append("pick_")
        return self.layers[i]


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    now = model.state_dict()
    assert now.keys() == state.keys()
    assert all(torch.equal(now[k], state[k]) for k in state)


# --------------------------------------------------------------------------- the reproducers


def test_user_class_overriding_train_stays_in_train_mode():
    model = Counted()
    model.train()
    model.calls.clear()
    with pytest.raises(PathError) as e:
        resolve_path(model, "train(False)")
    message = str(e.value)
    assert "'train(False)'" in message and "calling 'train' is not allowed" in message
    assert "torch.nn.Module method" in message and "your own methods" in message
    assert all(m.training for m in model.modules())
    assert model.calls == []


def test_tensordict_module_reset_parameters_recursive_leaves_weights_bitwise_unchanged():
    td_module = TensorDictModule(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), ["x"], ["y"])
    state = _state(td_module)
    with pytest.raises(PathError, match="reset_parameters_recursive.*tensordict.nn.TensorDictModuleBase"):
        resolve_path(td_module, "reset_parameters_recursive()")
    _assert_same_state(td_module, state)


class SpyTDModule(TensorDictModule):
    resets = 0

    def reset_parameters_recursive(self, *args, **kwargs):
        type(self).resets += 1
        return super().reset_parameters_recursive(*args, **kwargs)


def test_compat_hooked_get_refuses_before_resetting():
    td_module = SpyTDModule(nn.Linear(3, 2), ["x"], ["y"])
    hooked = HookedModule(td_module)
    state = _state(td_module)
    path = "td_module.reset_parameters_recursive()"
    with pytest.raises(PathError, match=r"not allowed in a path") as e:
        hooked.get(TensorDict(), path, relative=False)
    assert repr(path) in str(e.value)
    with pytest.raises(PathError):
        hooked.get(TensorDict(), "reset_parameters_recursive()")  # relative: starts at td_module
    with pytest.raises(PathError), hooked.run(TensorDict(x=torch.ones(2, 3), batch_size=[2])) as run:
        run.get(path, relative=False)
    assert SpyTDModule.resets == 0
    _assert_same_state(td_module, state)


@pytest.mark.parametrize(
    "path",
    [
        "ok().train(False)",
        "ok().<train>(False)",
        "ok().reset_parameters()",
        "ok().layers[0].weight.zero_()",
        "ok().stat.fill_(0.0)",
        "fn(0).reset_parameters()",
        "fn(1).pop(0)",
        "ok().ok().fn(0).half()",
        "ok().fn(0)(1)",
        "ok().layers[0](1)",
        "ok().__class__",
    ],
)
def test_allowed_call_before_a_refused_one_is_never_made(path):
    model = Counted()
    state = _state(model)
    with pytest.raises(PathError) as e:
        resolve_path(model, path)
    assert repr(path) in str(e.value)
    assert model.calls == []
    _assert_same_state(model, state)
    assert all(m.training for m in model.modules())


# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize(
    ("path", "owner"),
    [
        ("train()", "torch.nn.Module"),
        ("forward(1.0)", "torch.nn.Module"),
        ("reset_parameters()", "torch.nn."),  # defined on torch.nn's layers
        ("get(0)", "torch.nn.ParameterDict"),
        ("select(0)", "tensordict.TensorDictBase"),
        ("pick_(0)", "in-place"),
        ("layers.zero_()", "in-place"),
        ("layers[0].weight.register_hook(None)", "torch.Tensor"),
    ],
)
def test_names_of_mutating_apis_refused_even_when_overridden(path, owner):
    model = Counted()
    with pytest.raises(PathError, match="not allowed in a path") as e:
        resolve_path(model, path)
    assert owner in str(e.value)
    assert model.calls == []


@pytest.mark.parametrize(
    "name",
    "train eval to apply zero_grad pop append load_state_dict reset_parameters_recursive select update"
    " reset_running_stats flatten_parameters anything_".split(),
)
def test_call_refusal_covers_the_apis(name):
    assert call_refusal(name) is not None


@pytest.mark.parametrize("name", ["fn", "block", "layer", "pick", "get_submodule", "get_parameter", "get_buffer"])
def test_call_refusal_allows_user_names_and_read_only_lookups(name):
    assert call_refusal(name) is None


def test_read_only_lookups_stay_callable():
    model = Counted()
    assert resolve_path(model, "get_submodule('layers.1.0')") is model.layers[1][0]
    assert resolve_path(model, "get_parameter('layers.0.weight')") is model.layers[0].weight
    assert resolve_path(model, "get_buffer('stat')") is model.stat


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(2, 2), nn.Tanh()) for _ in range(3)])

    def fn(self, i):
        return self.layers[i]


@pytest.mark.parametrize("path", ["fn(0)", "fn(-1)", "fn(i=2)", "fn(1)[0]", "fn(1)[0].weight", "<fn>(0)"])
def test_user_method_resolves_like_tdhook(path):
    model = Stack()
    ours = resolve_path(model, path)
    assert ours is tdhook_resolve(model, path.replace("<fn>", "fn"))
    assert resolve_submodule_path(model, path) is ours


@pytest.mark.parametrize("path", ["layers[0](1)", "fn(0)(1)", "fn.(0)", "fn..(0)", "(0)", "[0](1)"])
def test_a_call_must_directly_follow_a_name(path):
    model = Counted()
    with pytest.raises(PathError, match="call"):
        resolve_path(model, path)
    assert model.calls == []


class Aliases(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.make = nn.Linear  # a class: calling it constructs
        self.size_of = len  # a builtin
        self.switch = self.train  # an alias of torch's method under a harmless name
        self.init = torch.nn.init.xavier_normal  # a torch function, not a method


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("make(2, 2)", "(a class)"),
        ("size_of('ab')", "builtin_function_or_method"),
        ("switch(False)", "Module.train"),
        ("init(None)", "defined in torch"),
    ],
)
def test_attributes_set_on_the_instance_are_never_called(path, fragment):
    model = Aliases()
    state = _state(model)
    with pytest.raises(PathError, match="not allowed in a path") as e:
        resolve_path(model, path)
    assert fragment in str(e.value)
    assert model.training
    _assert_same_state(model, state)


# --------------------------------------------------------------------------- transformers


class HFLike(nn.Module):
    """A user model with methods named like transformers' API (but not inheriting it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(2, 2)

    def get_output_embeddings(self):
        return self.lm_head


def _fake_transformers() -> types.ModuleType:
    fake = types.ModuleType("transformers.modeling_utils")

    class PreTrainedModel(nn.Module):
        def get_output_embeddings(self):
            return None

        def tie_weights(self):
            return None

    fake.PreTrainedModel = PreTrainedModel
    return fake


def test_transformers_names_join_only_once_transformers_is_imported(monkeypatch):
    had_transformers = "transformers" in sys.modules
    model = HFLike()
    if "transformers.modeling_utils" not in sys.modules:
        assert resolve_path(model, "get_output_embeddings()") is model.lm_head
    assert ("transformers" in sys.modules) is had_transformers  # we never import it
    monkeypatch.setitem(sys.modules, "transformers.modeling_utils", _fake_transformers())
    with pytest.raises(PathError, match="transformers.PreTrainedModel"):
        resolve_path(model, "get_output_embeddings()")
    monkeypatch.undo()
    if "transformers.modeling_utils" not in sys.modules:
        assert resolve_path(model, "get_output_embeddings()") is model.lm_head


# --------------------------------------------------------------------------- length and cache


def test_paths_over_the_length_cap_are_refused_before_parsing():
    long_path = "a." * (_MAX_LENGTH // 2) + "b"
    before = len(_CACHE)
    with pytest.raises(PathError, match=f"longer than {_MAX_LENGTH} characters") as e:
        parse_path(long_path)
    assert len(str(e.value)) < 300
    assert _CACHE.get(long_path) is None and len(_CACHE) <= before
    with pytest.raises(PathError, match="longer than"):
        resolve_path(Counted(), "[" * 1_000_000)
    assert len(parse_path("a." * (_MAX_LENGTH // 2))) == _MAX_LENGTH // 2  # at the cap: parsed


def _long_paths(i: int) -> list[str]:
    """Distinct ~9,000-character paths of shapes that keep many or large objects."""
    n = 9_000
    return [
        f"p{i}" + ".a" * ((n - 8) // 2),  # thousands of steps
        f"p{i}['" + "x" * (n - 10) + "']",  # one large literal
        f"p{i}.fn(" + "0," * ((n - 12) // 2) + ")",  # a long tuple of arguments
        f"p{i}[{{" + ",".join(f"{k}:{k}" for k in range(1_000)) + "}]",  # a dict literal
    ]


def test_parse_cache_is_bounded_in_bytes():
    _CACHE.clear()
    gc.collect()
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        for i in range(12):  # 48 distinct paths, each ~150 KiB parsed: the 1 MiB budget holds 7
            for path in _long_paths(i):
                assert len(path) <= _MAX_LENGTH
                parse_path(path)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    assert 0 < _CACHE.nbytes <= _CACHE.max_bytes == 1 << 20
    assert kept < 4 * 2**20, f"{kept / 2**20:.1f} MiB kept"
    _CACHE.clear()


def test_parse_cache_evicts_least_recently_used():
    cache = ParseCache(max_entries=3, max_bytes=1 << 20)
    for path in ["a", "b", "c"]:
        cache.put(path, parse_path(path))
    assert cache.get("a") is not None  # "b" is now the least recently used
    cache.put("d", parse_path("d"))
    assert cache.get("b") is None and all(cache.get(p) is not None for p in "acd")
    small = ParseCache(max_entries=100, max_bytes=footprint("x.y", parse_path("x.y")) * 2)
    for path in ["x.y", "x.z", "x.w"]:
        small.put(path, parse_path(path))
    assert len(small) == 2 and small.get("x.y") is None and small.nbytes <= small.max_bytes
    small.put("q" * 5_000, parse_path("q" * 5_000))  # larger than the whole budget: not kept
    assert small.get("q" * 5_000) is None


def test_parse_cache_under_threads():
    cache = ParseCache(max_entries=64, max_bytes=1 << 16)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(300):
                path = f"t{t}.layers[{i % 80}]"
                got = cache.get(path)
                steps = parse_path(path)
                assert got is None or got == steps
                cache.put(path, steps)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(cache) <= 64 and cache.nbytes <= 1 << 16
    assert cache.nbytes == sum(footprint(p, s) for p, (s, _) in cache._entries.items())


# --------------------------------------------------------------------------- the error class


def test_path_error_is_a_public_value_error():
    assert tdhook_fn.PathError is PathError and issubclass(PathError, ValueError)
    assert "PathError" in tdhook_fn.__all__ and "PathError" in tdhook_fn._paths.__all__
    model = Counted()
    for bad in ["nope", "layers[9]", "__class__", "train()", "layers[0", "fn(0)(1)", 3]:
        with pytest.raises(PathError):
            resolve_path(model, bad)
        with pytest.raises(PathError):
            resolve_submodule_path(model, bad)


def test_compat_key_errors_are_path_errors():
    hooked = HookedModule(TensorDictModule(nn.Sequential(nn.Linear(2, 2)), ["x"], ["y"]))
    for key in ["nope", "[0].weight", "[0].train(False)"]:
        with pytest.raises(PathError):
            hooked.get(TensorDict(), key)


class PickyItems(nn.Module):
    """``__getitem__`` that consumes its (list) key: the cached parse must not change."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Identity(), nn.ReLU(), nn.Tanh()])

    def __getitem__(self, idx):
        return self.layers[idx.pop()]


def test_mutated_keys_do_not_change_the_cached_parse():
    model = PickyItems()
    assert resolve_path(model, "[[0, 2]]") is model.layers[2]
    assert resolve_path(model, "[[0, 2]]") is model.layers[2]


def test_uncached_parses_under_threads() -> None:
    """CPython 3.11's ast.parse can raise SystemError when threads parse at once (NOTE [ast under threads])."""
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(300):
                parse_path(f"m{t}_{i}.layers[{i}]['k{i}'].fn({i}, x={i})[1:{i}]")
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
