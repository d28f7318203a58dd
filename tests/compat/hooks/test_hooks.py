"""tdhook_fn.compat.hooks side by side with the oracle, tdhook 0.1.3's tdhook.hooks."""

from __future__ import annotations

import gc
import os
import typing
from collections.abc import Callable
from typing import Any

import pytest
import tdhook.hooks as ref
import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn.compat.hooks as ours

DIRECTIONS = list(ref.DIRECTION_TO_PARAMS)
LIBS = pytest.mark.parametrize("lib", [ref, ours], ids=["tdhook", "ours"])
BWD = ("bwd", "bwd_pre")
# The names tdhook 0.1.3 documents for tdhook.hooks.
DOCUMENTED = [
    "HookDirection",
    "T",
    "DIRECTION_TO_PARAMS",
    "DIRECTION_TO_RETURN",
    "DIRECTION_TO_RETURN_INDEX",
    "DIRECTION_TO_TYPE",
    "EarlyStoppingException",
    "RemovableHandleProtocol",
    "MultiHookHandle",
    "MultiHookManager",
    "MutableWeakRef",
    "TensorDictRef",
    "CacheProxy",
    "HookFactory",
    "_check_hook_signature",
    "merge_paths",
    "resolve_submodule_path",
    "submodule_path_to_name",
    "register_hook_to_module",
]


def outcome(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, Any]:
    """("ok", result) or ("raises", exception type name), to compare two libraries."""
    try:
        return "ok", fn(*args, **kwargs)
    except Exception as e:
        return "raises", type(e).__name__


def same(a: Any, b: Any) -> bool:
    """Deep equality: tensors by value, modules by identity, containers element-wise."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, TensorDict) or isinstance(b, TensorDict):
        ka, kb = (set(x.keys(include_nested=True, leaves_only=True)) for x in (a, b))
        return ka == kb and all(same(a.get(k), b.get(k)) for k in ka)
    if isinstance(a, nn.Module):
        return a is b
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


# --------------------------------------------------------------------------- module surface


def test_documented_names_are_exposed() -> None:
    assert sorted(ours.__all__) == sorted(DOCUMENTED)
    assert all(hasattr(ours, n) and hasattr(ref, n) for n in DOCUMENTED)
    assert typing.get_args(ours.HookDirection) == typing.get_args(ref.HookDirection)
    assert isinstance(ours.T, typing.TypeVar)


@pytest.mark.parametrize(
    "name",
    [
        "DIRECTION_TO_PARAMS",
        "DIRECTION_TO_RETURN",
        "DIRECTION_TO_RETURN_INDEX",
        "DIRECTION_TO_TYPE",
    ],
)
def test_direction_tables_equal(name: str) -> None:
    mine, theirs = getattr(ours, name), getattr(ref, name)
    assert type(mine) is dict
    assert mine == theirs
    assert list(mine) == list(theirs)


# --------------------------------------------------------------------------- hook signatures


def _posonly(module, args, output, /):
    return None


class _CallableHook:
    def __call__(self, module: Any, args: Any, output: Any) -> None:
        return None

    def method(self, module: Any, args: Any) -> None:
        return None


SIGNATURES: list[Callable[..., Any]] = [
    lambda: None,
    lambda m: None,
    lambda m, a: None,
    lambda m, a, o: None,
    lambda m, a, k, o: None,
    lambda m, a, k, o, x: None,
    lambda m, a, o, extra=1: None,
    lambda m, a=1, o=2: None,
    lambda m, a, o, **kw: None,
    lambda m, **kw: None,
    lambda m, a, *, k: None,
    lambda m, a, *, k=1: None,
    lambda *args: None,
    lambda *args, **kw: None,
    lambda m, *args: None,
    lambda m, a, o, *args: None,
    lambda m, a, k, o, *args: None,
    lambda m, a, k, o, x, *args: None,
    lambda m, a, *args, x=1, **kw: None,
    _posonly,
    _CallableHook(),
    _CallableHook().method,
    print,  # inspect.signature cannot read it: both raise ValueError
]


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("hook", SIGNATURES, ids=range(len(SIGNATURES)))
def test_check_hook_signature_agrees(hook: Callable[..., Any], direction: str) -> None:
    mine = outcome(ours._check_hook_signature, hook, direction)
    theirs = outcome(ref._check_hook_signature, hook, direction)
    assert mine == theirs


def test_check_hook_signature_accepts_something_in_every_direction() -> None:
    # Guards the agreement test against both sides rejecting everything.
    for direction in DIRECTIONS:
        accepted = [
            outcome(ours._check_hook_signature, h, direction)[0] == "ok" for h in SIGNATURES
        ]
        assert 0 < sum(accepted) < len(SIGNATURES)


@pytest.mark.parametrize("direction", ["forward", "", "FWD", None])
@LIBS
def test_check_hook_signature_invalid_direction(lib: Any, direction: Any) -> None:
    with pytest.raises(ValueError):
        lib._check_hook_signature(lambda *a: None, direction)


# --------------------------------------------------------------------------- paths


@pytest.mark.parametrize(
    "paths",
    [
        (),
        ("",),
        ("a",),
        ("a", "b"),
        ("", "a", "", "b", ""),
        ("a.b", "[0]"),
        ("<x/y>", "layers[1]"),
        ("a", ""),
    ],
)
def test_merge_paths(paths: tuple[str, ...]) -> None:
    assert ours.merge_paths(*paths) == ref.merge_paths(*paths)


NAME_PATHS = [
    "",
    "layers",
    "layers.0",
    "layers[0]",
    "layers[0][1]",
    "layers['attr']",
    'layers["attr"].fc',
    "layers[-1]",
    "layers[1:3]",
    "layers[::2]",
    "fn(0)",
    "fn(0).fc",
    "<block0/module>",
    "<block0/module>.layers[0]",
    "m1.<0>.layers",
    "m1.<block0/module>.layers.<module>.linear[0]",
    "..a..b..",
    "[0]",
    "a[0]['b'][1]",
]


@pytest.mark.parametrize("path", NAME_PATHS)
def test_submodule_path_to_name(path: str) -> None:
    assert ours.submodule_path_to_name(path) == ref.submodule_path_to_name(path)


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])
        self.attention = nn.Identity()


class ListNet(nn.Module):
    """Nested ModuleLists, a child named "block0/module", a child named "0", a method."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [
                nn.Linear(2, 2),
                nn.ModuleList([nn.ReLU(), nn.Linear(2, 2)]),
                nn.Tanh(),
                nn.Linear(2, 2),
            ]
        )
        self.add_module("block0/module", Inner())
        self.m1 = nn.Module()
        self.m1.add_module("0", Inner())

    def fn(self, i: int) -> nn.Module:
        return self.layers[i]


class DictNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"attr": nn.ReLU(), "attention": Inner()})


ZOO: dict[str, Callable[[], nn.Module]] = {
    "seq": lambda: nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Tanh(), nn.Linear(2, 2)),
    "list": ListNet,
    "dict": DictNet,
}

RESOLVABLE = [
    ("seq", ""),
    ("seq", "[0]"),
    ("seq", "[-1]"),
    ("seq", "[1:3]"),
    ("seq", ".0"),
    ("list", "layers"),
    ("list", "layers[-1]"),
    ("list", "layers[1:3]"),
    ("list", "layers[1][0]"),
    ("list", "layers[1][-1]"),
    ("list", "layers.0"),
    ("list", "layers.1.1"),
    ("list", "layers..1.0."),
    ("list", "layers[ 2 ]"),
    ("list", "fn(0)"),
    ("list", "fn(1)[1]"),
    ("list", "fn(i=2)"),
    ("list", "<block0/module>"),
    ("list", "<block0/module>.layers[0]"),
    ("list", "<block0/module>.attention"),
    ("list", "m1.<0>.layers"),
    ("list", "m1.0.layers.1"),
    ("list", "m1.<0>.<layers>[0]"),
    ("list", "layers[0].weight"),
    ("dict", "layers['attr']"),
    ("dict", 'layers["attention"].layers[0]'),
    ("dict", "layers.attention"),
    ("dict", "layers.attention.layers[0:2]"),
]


@pytest.mark.parametrize(("model", "path"), RESOLVABLE)
def test_resolve_submodule_path_same_object(model: str, path: str) -> None:
    root = ZOO[model]()
    mine, theirs = ours.resolve_submodule_path(root, path), ref.resolve_submodule_path(root, path)
    assert type(mine) is type(theirs)
    if isinstance(theirs, (nn.ModuleList, nn.Sequential)) and ":" in path:
        # Slicing builds a new container each time: compare what it holds.
        assert mine is not theirs
        assert len(mine) == len(theirs) > 0
        assert all(a is b for a, b in zip(mine, theirs))
    else:
        assert mine is theirs


UNRESOLVABLE = [
    ("list", "layers[9]"),
    ("list", "layers.nope"),
    ("list", "nope.layers"),
    ("list", "<block0/module"),
    ("list", "layers . 0"),
    ("list", "layers[0]x"),
    ("list", "layers.-1"),
    ("dict", "layers['nope']"),
    ("dict", "layers.nope"),
    ("seq", "fn(0)"),
]


@pytest.mark.parametrize(("model", "path"), UNRESOLVABLE)
@LIBS
def test_resolve_submodule_path_bad_paths(lib: Any, model: str, path: str) -> None:
    with pytest.raises(ValueError):
        lib.resolve_submodule_path(ZOO[model](), path)


EXPLOIT = "__class__.__init__.__globals__['__builtins__']['__import__']('os').getcwd()"


def test_exploit_runs_in_tdhook_but_not_here() -> None:
    root = ZOO["seq"]()
    assert ref.resolve_submodule_path(root, EXPLOIT) == os.getcwd()  # tdhook evaluates it
    with pytest.raises(ValueError, match="dunder"):
        ours.resolve_submodule_path(root, EXPLOIT)


@pytest.mark.parametrize(
    "path", ["__class__", "layers.__dict__", "<__class__>", "fn.__func__", "layers[0].train()"]
)
def test_dunders_and_torch_methods_refused(path: str) -> None:
    with pytest.raises(ValueError):
        ours.resolve_submodule_path(ListNet(), path)


# --------------------------------------------------------------------------- registration

HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def hook_counts(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Per submodule, how many hooks each of torch's hook dicts holds (non-empty only)."""
    counts = {
        name: tuple(len(getattr(m, d)) for d in HOOK_DICTS) for name, m in model.named_modules()
    }
    return {name: c for name, c in counts.items() if any(c)}


def any_hook(*args: Any) -> None:
    return None


@pytest.mark.parametrize("prepend", [False, True])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_register_hook_to_module_same_dicts(direction: str, prepend: bool) -> None:
    model = ZOO["seq"]()
    for lib in (ref, ours):
        handle = lib.register_hook_to_module(model[0], any_hook, direction, prepend)
        counts = hook_counts(model)
        handle.remove()
        assert hook_counts(model) == {}
        if lib is ref:
            expected = counts
    assert counts == expected
    assert len(counts) == 1


@pytest.mark.parametrize(("hook", "direction"), [(lambda m: None, "fwd"), (any_hook, "sideways")])
@LIBS
def test_register_hook_to_module_rejects(
    lib: Any, hook: Callable[..., Any], direction: str
) -> None:
    model = ZOO["seq"]()
    with pytest.raises(ValueError):
        lib.register_hook_to_module(model[0], hook, direction)
    assert hook_counts(model) == {}


class FakeHandle:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def remove(self) -> None:
        self.log.append(self.name)


@LIBS
def test_multi_hook_handle(lib: Any) -> None:
    log: list[str] = []
    a = lib.MultiHookHandle([FakeHandle(log, "a"), FakeHandle(log, "b")])
    b = lib.MultiHookHandle([FakeHandle(log, "c")])
    both = a + b
    assert type(both) is lib.MultiHookHandle
    both.remove()
    assert log == ["a", "b", "c"]
    log.clear()
    with a as entered:
        assert entered is a
        assert log == []
    assert log == ["a", "b"]
    log.clear()
    with pytest.raises(KeyError), b:  # the context manager removes and does not swallow
        raise KeyError("boom")
    assert log == ["c"]
    lib.MultiHookHandle().remove()
    lib.MultiHookHandle(None).remove()
    assert ((lib.MultiHookHandle() + lib.MultiHookHandle())._handles) == []


@pytest.mark.parametrize("other", [1, None, [], "x", object()])
def test_multi_hook_handle_bad_add(other: Any) -> None:
    with pytest.raises(TypeError, match=type(other).__name__):
        ours.MultiHookHandle() + other
    with pytest.raises(TypeError, match=type(other).__name__):
        ref.MultiHookHandle() + other
    with pytest.raises(TypeError):  # ours and tdhook's handles do not mix either
        ours.MultiHookHandle() + ref.MultiHookHandle()


def test_multi_hook_handle_removes_real_hooks() -> None:
    model = ZOO["seq"]()
    handles = [ours.register_hook_to_module(m, any_hook, "fwd") for m in model]
    with ours.MultiHookHandle(handles[:2]) + ours.MultiHookHandle(handles[2:]):
        assert len(hook_counts(model)) == 4
    assert hook_counts(model) == {}


MANAGER_CASES: list[dict[str, Any]] = [
    {},
    {"pattern": r".*"},
    {"pattern": r"layers"},
    {"pattern": r"layers\.\d+$"},
    {"pattern": r"layers\.1\."},
    {"pattern": r"block0/module"},
    {"pattern": r"m1\.0\.layers\.0"},
    {"pattern": r".*", "classes_to_hook": (nn.Linear,)},
    {"pattern": r".*", "classes_to_hook": (nn.Linear, nn.ReLU)},
    {"pattern": r".*", "classes_to_skip": (nn.ModuleList, nn.ReLU)},
    {"pattern": r"layers", "classes_to_hook": (nn.Linear,), "classes_to_skip": (nn.Linear,)},
    {"pattern": r".*", "relative_path": "layers"},
    {"pattern": r"1", "relative_path": "layers"},
    {"pattern": r"layers", "relative_path": "<block0/module>"},
    {"pattern": r".*", "relative_path": "m1.<0>"},
    {"pattern": r".*", "relative_path": "m1.0.layers"},
    {"pattern": r"0", "relative_path": "layers[1]"},
    {"pattern": r".*", "relative_path": ""},
]


@pytest.mark.parametrize("case", MANAGER_CASES, ids=range(len(MANAGER_CASES)))
def test_multi_hook_manager_same_modules(case: dict[str, Any]) -> None:
    case = dict(case)
    relative_path = case.pop("relative_path", None)
    model = ListNet()
    seen: dict[str, Any] = {}
    for lib in (ref, ours):
        names: list[str] = []

        def factory(name: str, names: list[str] = names) -> Callable[..., Any]:
            names.append(name)
            return any_hook

        manager = lib.MultiHookManager(**case)
        handle = manager.register_hook(model, factory, relative_path=relative_path)
        assert isinstance(handle, lib.MultiHookHandle)
        seen[lib.__name__] = (names, hook_counts(model))
        handle.remove()
        assert hook_counts(model) == {}
    assert seen["tdhook_fn.compat.hooks"] == seen["tdhook.hooks"]
    # Guard against both hooking nothing: only the default pattern and a skip list that
    # covers the hook list select no module.
    skip, hook = case.get("classes_to_skip", ()), case.get("classes_to_hook", (nn.Module,))
    hooks_none = "pattern" not in case or skip == hook
    assert bool(seen["tdhook.hooks"][0]) is not hooks_none


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_multi_hook_manager_every_direction(direction: str) -> None:
    model = ListNet()
    counts = []
    for lib in (ref, ours):
        handle = lib.MultiHookManager(r".*").register_hook(
            model, lambda name: any_hook, direction=direction
        )
        counts.append(hook_counts(model))
        handle.remove()
        assert hook_counts(model) == {}
    assert counts[0] == counts[1]
    assert len(counts[0]) == len(list(model.modules())) - 1  # all but the root


def _run(model: nn.Module, direction: str, x: torch.Tensor | None = None) -> torch.Tensor:
    """Forward, and backward for the backward directions."""
    x = torch.linspace(-1, 1, 4).reshape(2, 2).requires_grad_() if x is None else x
    out: torch.Tensor = model(x)
    if direction in BWD:
        out.sum().backward()
    return out


@pytest.mark.parametrize("prepend", [False, True])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_multi_hook_manager_prepend_order(direction: str, prepend: bool) -> None:
    model = ZOO["seq"]()
    orders = []
    for lib in (ref, ours):
        order: list[str] = []
        existing = lib.register_hook_to_module(
            model[0], lambda *a: order.append("existing"), direction
        )
        manager = lib.MultiHookManager(r"0$")
        handle = manager.register_hook(
            model, lambda name: lambda *a: order.append(name), direction=direction, prepend=prepend
        )
        _run(model, direction)
        handle.remove()
        existing.remove()
        assert hook_counts(model) == {}
        orders.append(order)
    assert orders[0] == orders[1] == (["0", "existing"] if prepend else ["existing", "0"])


@LIBS
def test_multi_hook_manager_pattern_property(lib: Any) -> None:
    model = ZOO["seq"]()
    manager = lib.MultiHookManager()
    assert manager.pattern == "a^"
    names: list[str] = []
    manager.register_hook(model, lambda n: names.append(n) or any_hook).remove()
    assert names == []
    manager.pattern = r"[13]"
    assert manager.pattern == r"[13]"
    manager.register_hook(model, lambda n: names.append(n) or any_hook).remove()
    assert names == ["1", "3"]
    assert lib.MultiHookManager(r"x").pattern == "x"


@LIBS
def test_multi_hook_manager_bad_relative_path(lib: Any) -> None:
    with pytest.raises(ValueError):
        lib.MultiHookManager(r".*").register_hook(
            ListNet(), lambda n: any_hook, relative_path="nope"
        )


def test_multi_hook_manager_failure_leaves_no_hooks() -> None:
    # The factory's second hook has a bad signature. tdhook keeps the first hook registered;
    # ours removes it, so a failed call leaves the model as it was.
    leftovers = []
    for lib in (ref, ours):
        model = ZOO["seq"]()
        hooks = iter([any_hook, lambda m: None, any_hook, any_hook])
        with pytest.raises(ValueError):
            lib.MultiHookManager(r".*").register_hook(model, lambda n: next(hooks))
        leftovers.append(hook_counts(model))
    assert leftovers == [{"0": (1, 0, 0, 0, 0, 0)}, {}]


# --------------------------------------------------------------------------- references


class Referee:
    pass


@LIBS
def test_mutable_weak_ref(lib: Any) -> None:
    a, b = Referee(), Referee()
    r = lib.MutableWeakRef(a)
    assert r.resolve() is a
    r.set(b)
    assert r.resolve() is b
    del b
    gc.collect()
    assert r.resolve() is None
    with pytest.raises(TypeError):  # ints cannot be weakly referenced
        lib.MutableWeakRef(1)


@LIBS
def test_tensordict_ref(lib: Any) -> None:
    r = lib.TensorDictRef(None)
    assert r.resolve() is None
    td = TensorDict({"a": torch.ones(2)})
    r.set(td)
    assert r.resolve() is td
    assert lib.TensorDictRef(td).resolve() is td


@pytest.mark.parametrize("kind", ["td", "weak", "ref"])
@pytest.mark.parametrize("key", ["a", ("n", "b")])
def test_cache_proxy_resolves_like_tdhook(kind: str, key: Any) -> None:
    values = []
    for lib in (ref, ours):
        td = TensorDict({"a": torch.arange(3.0), "n": {"b": torch.ones(2)}})
        cache = {"td": td, "weak": lib.MutableWeakRef(td), "ref": lib.TensorDictRef(td)}[kind]
        proxy = lib.CacheProxy(key, cache)
        first = proxy.resolve()
        if kind != "td":  # the proxy follows the reference to a new TensorDict
            other = TensorDict({"a": torch.zeros(1), "n": {"b": torch.zeros(1)}})
            cache.set(other)
            values.append((first, proxy.resolve()))
        else:
            td[key] = torch.full((4,), 7.0)  # and sees later writes
            values.append((first, proxy.resolve()))
        assert lib.CacheProxy("missing", cache).resolve() is None
    assert same(values[0], values[1])


@pytest.mark.parametrize("case", ["dead_td", "temporary_ref", "dead_weak_target", "empty_ref"])
@LIBS
def test_cache_proxy_dead_references(lib: Any, case: str) -> None:
    if case == "dead_td":
        td = TensorDict({"a": torch.ones(1)})
        proxy = lib.CacheProxy("a", td)
        del td
    elif case == "temporary_ref":  # the proxy holds the reference weakly, so it dies at once
        keep = TensorDict({"a": torch.ones(1)})
        proxy = lib.CacheProxy("a", lib.MutableWeakRef(keep))
    elif case == "dead_weak_target":
        td = TensorDict({"a": torch.ones(1)})
        weak = lib.MutableWeakRef(td)
        proxy = lib.CacheProxy("a", weak)
        del td
    else:
        empty = lib.TensorDictRef(None)
        proxy = lib.CacheProxy("a", empty)
    gc.collect()
    with pytest.raises(ValueError, match="Dead reference"):
        proxy.resolve()


# --------------------------------------------------------------------------- hook factory


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 2))


def run_hooked(
    lib: Any, model: nn.Module, hook: Callable[..., Any], direction: str
) -> dict[str, Any]:
    """Run ``model`` with ``hook`` on its first layer; the output, input grad or error."""
    x = torch.linspace(-1, 1, 4).reshape(2, 2).requires_grad_()
    handle = lib.register_hook_to_module(model[0], hook, direction)
    try:
        out = model(x)
        out.sum().backward()
        return {"out": out.detach(), "grad": x.grad}
    except Exception as e:
        return {"error": type(e).__name__}
    finally:
        handle.remove()
        assert hook_counts(model) == {}


def first_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return next(v for v in value if isinstance(v, torch.Tensor))


def recorder(
    calls: list[dict[str, Any]], result: Callable[[dict[str, Any]], Any] | None = None
) -> Any:
    def callback(**kwargs: Any) -> Any:
        calls.append(kwargs)
        return None if result is None else result(kwargs)

    return callback


def compare_runs(
    make: Callable[[Any, list[dict[str, Any]]], tuple[Callable[..., Any], Any]], direction: str
) -> Any:
    """Build a hook with each library, run it, and check both runs agree; returns tdhook's."""
    model = make_model()
    results = []
    for lib in (ref, ours):
        calls: list[dict[str, Any]] = []
        hook, state = make(lib, calls)
        results.append((run_hooked(lib, model, hook, direction), calls, state))
    assert same(results[0], results[1]), (results[0], results[1])
    return results[0]


@pytest.mark.parametrize("cache_kind", ["td", "weak", "ref"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_caching_hook_without_callback(direction: str, cache_kind: str) -> None:
    def make(lib: Any, calls: list[dict[str, Any]]) -> tuple[Callable[..., Any], Any]:
        td = TensorDict()
        cache = {"td": td, "weak": lib.MutableWeakRef(td), "ref": lib.TensorDictRef(td)}[cache_kind]
        return lib.HookFactory.make_caching_hook("k", cache, direction=direction), td

    result, _, td = compare_runs(make, direction)
    if direction in ("fwd", "fwd_kwargs"):  # only these hand a tensor as last argument
        assert "error" not in result
        assert torch.equal(td["k"], make_model()[0](torch.linspace(-1, 1, 4).reshape(2, 2)))
    else:
        assert result == {"error": "RuntimeError"}
        assert "k" not in td.keys()


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_caching_hook_picks_the_same_argument(direction: str) -> None:
    # Called directly with a tensor in every slot, the hook shows which argument it stores
    # (the last one, but the positional args for fwd_pre_kwargs). tdhook stores it as is; ours
    # a copy (docs/compat.md: a later in-place write would change a stored reference).
    args = [torch.full((1,), float(i)) for i in range(len(ref.DIRECTION_TO_PARAMS[direction]))]
    stored = []
    for lib in (ref, ours):
        td = TensorDict()
        assert lib.HookFactory.make_caching_hook("k", td, direction=direction)(*args) is None
        stored.append(td["k"])
    picked = args[-2 if direction == "fwd_pre_kwargs" else -1]
    assert stored[0] is picked
    assert stored[1] is not picked and torch.equal(stored[1], picked)


@pytest.mark.parametrize("key", ["k", ("outer", "k")])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_caching_hook_with_callback(direction: str, key: Any) -> None:
    returned = ref.DIRECTION_TO_RETURN[direction]

    def make(lib: Any, calls: list[dict[str, Any]]) -> tuple[Callable[..., Any], Any]:
        td = TensorDict()
        callback = recorder(calls, lambda kw: first_tensor(kw[returned]) * 2)
        return lib.HookFactory.make_caching_hook(
            key, td, callback=callback, direction=direction
        ), td

    result, calls, td = compare_runs(make, direction)
    assert "error" not in result
    assert len(calls) == 1
    assert set(calls[0]) == {*ref.DIRECTION_TO_PARAMS[direction], "key", "direction"}
    assert calls[0]["key"] == key
    assert calls[0]["direction"] == direction
    assert torch.equal(td[key], first_tensor(calls[0][returned]) * 2)


@pytest.mark.parametrize("bad", [1.0, None, (torch.ones(1),), [torch.ones(1)], "x"])
def test_caching_hook_rejects_non_tensors(bad: Any) -> None:
    def make(lib: Any, calls: list[dict[str, Any]]) -> tuple[Callable[..., Any], Any]:
        td = TensorDict()
        return lib.HookFactory.make_caching_hook(
            "k", td, callback=recorder(calls, lambda kw: bad)
        ), td

    result, calls, td = compare_runs(make, "fwd")
    assert result == {"error": "RuntimeError"}
    assert len(calls) == 1
    assert list(td.keys()) == []


def test_caching_hook_stores_tensordicts() -> None:
    def make(lib: Any, calls: list[dict[str, Any]]) -> tuple[Callable[..., Any], Any]:
        td = TensorDict()
        callback = recorder(
            calls, lambda kw: TensorDict({"out": kw["output"], "in": kw["args"][0]})
        )
        return lib.HookFactory.make_caching_hook("k", td, callback=callback), td

    result, _, td = compare_runs(make, "fwd")
    assert "error" not in result
    assert set(td["k"].keys()) == {"out", "in"}


@pytest.mark.parametrize("kind", ["weak", "ref"])
@LIBS
def test_caching_hook_dead_cache(lib: Any, kind: str) -> None:
    if kind == "weak":
        td = TensorDict()
        cache = lib.MutableWeakRef(td)
        del td
        gc.collect()
    else:
        cache = lib.TensorDictRef(None)
    hook = lib.HookFactory.make_caching_hook("k", cache)
    with pytest.raises(ValueError, match="Dead reference"):
        hook(nn.Identity(), (torch.ones(1),), torch.ones(1))


SET_VALUES = {
    "fwd": torch.full((2, 3), 0.5),
    "fwd_kwargs": torch.full((2, 3), 0.5),
    "fwd_pre": (torch.ones(2, 2),),
    "fwd_pre_kwargs": (torch.ones(2, 2),),  # torch wants (args, kwargs) back: both fail alike
    "bwd": (torch.full((2, 2), 3.0),),
    "bwd_pre": (torch.full((2, 3), -1.0),),
}


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_setting_hook_value(direction: str) -> None:
    def make(lib: Any, calls: list[dict[str, Any]]) -> tuple[Callable[..., Any], Any]:
        return lib.HookFactory.make_setting_hook(SET_VALUES[direction], direction=direction), None

    result, _, _ = compare_runs(make, direction)
    plain = run_hooked(ref, make_model(), any_hook, direction)
    if direction == "fwd_pre_kwargs":
        assert result == {"error": "RuntimeError"}
    elif direction == "bwd":  # only the input gradient changes
        assert torch.equal(result["out"], plain["out"])
        assert torch.equal(result["grad"], SET_VALUES["bwd"][0])
    else:
        assert not same(result, plain)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_setting_hook_callback(direction: str) -> None:
    def make(lib: Any, calls: list[dict[str, Any]]) -> tuple[Callable[..., Any], Any]:
        callback = recorder(
            calls,
            lambda kw: None if kw["value"] == "keep" else kw[ref.DIRECTION_TO_RETURN[direction]],
        )
        return lib.HookFactory.make_setting_hook(
            "keep", callback=callback, direction=direction
        ), None

    result, calls, _ = compare_runs(make, direction)
    assert same(result, run_hooked(ref, make_model(), any_hook, direction))  # None keeps the value
    assert len(calls) == 1
    assert set(calls[0]) == {*ref.DIRECTION_TO_PARAMS[direction], "value", "direction"}
    assert calls[0]["value"] == "keep"


@pytest.mark.parametrize("direction", ["fwd", "fwd_kwargs"])
def test_setting_hook_from_cache_proxy(direction: str) -> None:
    # The proxy is read when the hook runs, so a value cached after building the hook is used.
    def make(lib: Any, calls: list[dict[str, Any]]) -> tuple[Callable[..., Any], Any]:
        td = TensorDict()
        hook = lib.HookFactory.make_setting_hook(
            lib.CacheProxy("v", td),
            callback=recorder(calls, lambda kw: kw["value"] * 2),
            direction=direction,
        )
        td["v"] = torch.full((2, 3), 0.25)
        return hook, td

    result, calls, _ = compare_runs(make, direction)
    assert torch.equal(calls[0]["value"], torch.full((2, 3), 0.25))
    model = make_model()
    assert torch.equal(result["out"], model[2](model[1](torch.full((2, 3), 0.5))).detach())


@pytest.mark.parametrize(
    ("direction", "value"),
    [
        ("fwd", 1.0),
        ("fwd", [torch.ones(2, 3)]),
        ("fwd", nn.Parameter(torch.ones(2, 3))),
        ("bwd", torch.ones(2, 2)),
    ],
)
def test_setting_hook_wrong_type(direction: str, value: Any) -> None:
    def make(lib: Any, calls: list[dict[str, Any]]) -> tuple[Callable[..., Any], Any]:
        return lib.HookFactory.make_setting_hook(value, direction=direction), None

    result, _, _ = compare_runs(make, direction)
    assert result == {"error": "RuntimeError"}


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_reading_hook(direction: str) -> None:
    def make(lib: Any, calls: list[dict[str, Any]]) -> tuple[Callable[..., Any], Any]:
        return lib.HookFactory.make_reading_hook(
            callback=recorder(calls, lambda kw: 123), direction=direction
        ), None

    result, calls, _ = compare_runs(make, direction)
    assert same(result, run_hooked(ref, make_model(), any_hook, direction))  # changes nothing
    assert len(calls) == 1
    assert set(calls[0]) == {*ref.DIRECTION_TO_PARAMS[direction], "direction"}
    assert calls[0]["direction"] == direction


def test_stopping_hook() -> None:
    model = make_model()
    raised = []
    for lib in (ref, ours):
        hook = lib.HookFactory.make_stopping_hook("layer0")
        handle = lib.register_hook_to_module(model[1], hook, "fwd")
        with pytest.raises(lib.EarlyStoppingException) as info:
            model(torch.ones(1, 2))
        handle.remove()
        raised.append((str(info.value), info.value._key, info.value.args))
        with pytest.raises(ValueError):  # only forward hooks have its signature
            lib.register_hook_to_module(model[1], hook, "fwd_pre")
    assert raised[0] == raised[1]
    assert raised[0][:2] == ("Early stopping triggered for key layer0", "layer0")
    assert hook_counts(model) == {}
    assert issubclass(ours.EarlyStoppingException, Exception)


def _cb_posonly(module, /, **kw):
    return None


CALLBACKS: list[Any] = [
    None,
    lambda **kw: None,
    lambda *a, **kw: None,
    lambda *a: None,
    lambda module: None,
    lambda module, args, output: None,
    lambda module, args, output, **kw: None,
    lambda module, grad_input, grad_output, **kw: None,
    lambda module, args, kwargs, output=None, **kw: None,
    lambda module=None, args=None, kwargs=None, output=None, grad_input=None, grad_output=None: (
        None
    ),
    lambda *, module, args: None,
    _cb_posonly,
]


@pytest.mark.parametrize("direction", [*DIRECTIONS, "bogus"])
@pytest.mark.parametrize("callback", CALLBACKS, ids=range(len(CALLBACKS)))
@pytest.mark.parametrize("factory", ["caching", "setting", "reading", "check"])
def test_callback_signature_checks_agree(factory: str, callback: Any, direction: str) -> None:
    def build(lib: Any) -> tuple[str, Any]:
        factory_of = lib.HookFactory
        if factory == "caching":
            return outcome(
                factory_of.make_caching_hook,
                "k",
                TensorDict(),
                callback=callback,
                direction=direction,
            )
        if factory == "setting":
            return outcome(factory_of.make_setting_hook, 1, callback=callback, direction=direction)
        if factory == "reading":
            return outcome(factory_of.make_reading_hook, callback=callback, direction=direction)
        params = set(lib.DIRECTION_TO_PARAMS.get(direction, ("module",)))
        return outcome(factory_of._check_callback_signature, callback, params)

    mine, theirs = build(ours), build(ref)
    assert mine[0] == theirs[0]
    if mine[0] == "raises":
        assert mine[1] == theirs[1] == "ValueError"
    elif factory != "check":
        assert callable(mine[1])


def test_a_virtual_hooks_registry_is_itself_copies_with_its_entries_and_compares_by_identity() -> None:
    """A registry is a dict of entries by order: two empty ones are different registries (a scope holds them by
    identity), and a copy (deepcopy, pickle) keeps the entries in a registry of its own."""
    import copy
    import pickle

    from tdhook_fn.compat.modules import VirtualHooks

    first, second = VirtualHooks(), VirtualHooks()
    assert first != second and first not in (second,) and len({first, second}) == 2
    target = nn.Linear(2, 2)
    handle = first.add(target, print, "fwd_pre")
    for twin in (copy.deepcopy(first), pickle.loads(pickle.dumps(first))):
        assert type(twin) is VirtualHooks and twin is not first
        [entry] = twin.entries()
        assert entry.hook is print and entry.direction == "fwd_pre"
    handle.remove()
    assert first.entries() == [] and not first
