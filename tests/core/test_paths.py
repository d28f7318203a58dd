"""Safe submodule paths: same answers as tdhook's eval-based resolver, without evaluating."""

import pytest
import torch
from tdhook.hooks import resolve_submodule_path, submodule_path_to_name
from torch import nn

from tdhook_fn._paths import Attr, Call, Item, parse_path, path_to_name, resolve_path


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.linear = nn.Sequential(nn.Linear(4, 4), nn.Tanh())


class Stack(nn.Module):
    """A ModuleList ``layers`` of blocks and a user method ``fn``."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(n)])

    def fn(self, i):
        return self.layers[i]


class DictNet(nn.Module):
    """``layers`` is a ModuleDict: ``layers['attr']``, ``layers.attention``, ``layers.<module>``."""

    def __init__(self) -> None:
        super().__init__()
        children = {"attr": Block(), "attention": nn.Sequential(nn.Linear(4, 4)), "module": Block()}
        self.layers = nn.ModuleDict(children)


class Odd(nn.Module):
    """Children whose names are not identifiers."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module("block0/module", DictNet())
        self.add_module("0", Stack(3))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.m1 = Odd()
        self.head = nn.Linear(4, 2)


def zoo():
    return {
        "seq": nn.Sequential(
            nn.Linear(4, 4),
            nn.Sequential(nn.Linear(4, 4), nn.ReLU()),
            nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.GELU())),
            nn.Identity(),
        ),
        "stack": Stack(),
        "dictnet": DictNet(),
        "mdict": nn.ModuleDict({"attr": Block(), "layers": nn.ModuleList([Block(), Block()])}),
        "odd": Odd(),
        "outer": Outer(),
    }


MODELS = zoo()

# Every documented form, plus compositions. Each is tried on every zoo model.
PATHS = [
    "",
    "[0]",
    "[-1]",
    "[1][1]",
    "[2][-1][0]",
    "[2][1][0].weight",
    "[0].weight",
    "layers",
    "layers[0]",
    "layers[-1]",
    "layers[1]",
    "layers['attr']",
    'layers["attr"]',
    "layers['attr'].linear[0]",
    "layers.attention",
    "layers.attention[0]",
    "layers[0].attention[0]",
    "layers[-1].linear[-1]",
    "layers.0",
    "layers.1.linear.0",
    "layers.0.attention",
    "..layers..attention.",
    "fn(0)",
    "fn(-1)",
    "fn(i=2)",
    "fn(1).linear[0]",
    "fn(0).attention[0].bias",
    "['attr']",
    "['layers'][1]",
    "attr.linear",
    "<block0/module>",
    "<block0/module>.layers.attention[0]",
    "<block0/module>.layers.<module>.linear[0]",
    "<block0/module>.layers['attr']",
    "<0>",
    "<0>.layers",
    "<0>.layers[-1].attention",
    "<0>.fn(1)",
    "m1",
    "m1.<block0/module>.layers.<module>.linear[0]",
    "m1.<0>.layers",
    "m1.<0>.layers.2.linear",
    "m1.<0>.layers[1]",
    "head.weight",
]
SLICES = ["[1:3]", "[::2]", "[:-1]", "layers[1:3]", "layers[::-1]", "<0>.layers[:2]", "m1.<0>.layers[1:]"]


def _oracle(model, path):
    try:
        return True, resolve_submodule_path(model, path)
    except Exception as e:  # tdhook raises ValueError, TypeError, ... for a bad path
        return False, e


def _snapshot(model):
    return (
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        [m.training for m in model.modules()],
        [len(m) for m in model.modules() if isinstance(m, nn.ModuleList | nn.Sequential | nn.ModuleDict)],
        [n for n, _ in model.named_modules()],
    )


def _assert_unchanged(model, snap):
    state, training, lengths, names = _snapshot(model)
    assert state.keys() == snap[0].keys()
    assert all(torch.equal(state[k], snap[0][k]) for k in state)
    assert (training, lengths, names) == snap[1:]


def _assert_path_error(excinfo, path):
    msg = str(excinfo.value)
    assert path in msg or repr(path) in msg, msg


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", MODELS)
def test_resolve_matches_tdhook(name, path):
    model = MODELS[name]
    ok, expected = _oracle(model, path)
    if ok:
        assert resolve_path(model, path) is expected
    else:
        with pytest.raises(ValueError) as e:
            resolve_path(model, path)
        _assert_path_error(e, path)


def test_every_path_resolves_somewhere():
    for path in PATHS + SLICES:
        assert any(_oracle(m, path)[0] for m in MODELS.values()), path


@pytest.mark.parametrize("path", SLICES)
@pytest.mark.parametrize("name", MODELS)
def test_slices_match_tdhook(name, path):
    model = MODELS[name]
    ok, expected = _oracle(model, path)
    if not ok:
        with pytest.raises(ValueError):
            resolve_path(model, path)
        return
    got = resolve_path(model, path)
    assert type(got) is type(expected) and got is not expected
    assert len(got) == len(expected) > 0
    assert all(a is b for a, b in zip(got, expected))


@pytest.mark.parametrize(
    ("path", "steps"),
    [
        ("", ()),
        ("[0]", (Item(0),)),
        ("layers[-1]", (Attr("layers"), Item(-1))),
        ("layers['attr']", (Attr("layers"), Item("attr"))),
        ('layers["a]b"]', (Attr("layers"), Item("a]b"))),
        ("layers.attention", (Attr("layers"), Attr("attention"))),
        ("layers[1:3]", (Attr("layers"), Item(slice(1, 3, None)))),
        ("[::-2]", (Item(slice(None, None, -2)),)),
        ("[(1, 'a')]", (Item((1, "a")),)),
        ("fn(0)", (Attr("fn"), Call((0,), ()))),
        ("fn(1, k='v')", (Attr("fn"), Call((1,), (("k", "v"),)))),
        ("fn()", (Attr("fn"), Call((), ()))),
        ("<block0/module>", (Attr("block0/module"),)),
        (
            "<block0/module>.layers.attention[0]",
            (Attr("block0/module"), Attr("layers"), Attr("attention"), Item(0)),
        ),
        (
            "m1.<block0/module>.layers.<module>.linear[0]",
            (Attr("m1"), Attr("block0/module"), Attr("layers"), Attr("module"), Attr("linear"), Item(0)),
        ),
        ("m1.<0>.layers", (Attr("m1"), Attr("0"), Attr("layers"))),
        ("layers.0", (Attr("layers"), Attr("0"))),
        ("layers.0abc", (Attr("layers"), Attr("0abc"))),
        ("<a>b", (Attr("a"), Attr("b"))),
        ("..a..b.", (Attr("a"), Attr("b"))),
        ("a[0][1].fn(2)[3]", (Attr("a"), Item(0), Item(1), Attr("fn"), Call((2,), ()), Item(3))),
        ("<fn>(2)", (Attr("fn"), Call((2,), ()))),
        ("_private", (Attr("_private"),)),
    ],
)
def test_parse_path(path, steps):
    assert parse_path(path) == steps


@pytest.mark.parametrize(
    "path",
    [
        *PATHS,
        *SLICES,
        "layers[-1].x",
        "a['b']['c']",
        "<a/b>.c",
        '<x>["y"]',
        "...a...",
        "a[0:1]",
        "a[:]",
        "fn(0)",
        "a.b()",
        "[0]",
        "a]b[c",
        "<>",
        "'q'",
        "layers['x.y']",
    ],
)
def test_path_to_name_matches_tdhook(path):
    assert path_to_name(path) == submodule_path_to_name(path)


EXPLOIT = "__class__.__init__.__globals__['__builtins__']['__import__']('os').getcwd()"
BAD = [
    # (model, path, fragment the message must contain)
    ("stack", "layres", "layers"),
    ("stack", "layers[0].atention", "attention"),
    ("stack", "layers[0].lineer", "linear"),
    ("dictnet", "layers.attentoin", "attention"),
    ("odd", "<block0/modul>", "block0/module"),
    ("outer", "m2", "m1"),
    ("stack", "layers[10]", "IndexError"),
    ("stack", "layers[-5]", "IndexError"),
    ("seq", "[4]", "IndexError"),
    ("stack", "fn(17)", "IndexError"),
    ("dictnet", "layers['missing']", "KeyError"),
    ("mdict", "['atr']", "attr"),
    ("stack", "layers['attr']", "TypeError"),
    ("stack", "layers[1.5]", "TypeError"),
    ("stack", "fn()", "TypeError"),
    ("stack", "fn(0, 1)", "TypeError"),
    ("seq", "[[0]]", ""),
    ("odd", "<block0/module", "'>'"),
    ("outer", "m1.<0.layers", "'>'"),
    ("stack", "layers[0", "']'"),
    ("stack", "layers['a", "']'"),
    ("stack", "fn(0", "')'"),
    ("stack", "fn(0).linear[", "']'"),
    ("stack", "layers [0]", ""),
    ("stack", " layers", ""),
    ("stack", "layers ", ""),
    ("stack", "layers. attention", ""),
    ("stack", "lay ers", ""),
    ("stack", "layers\t", ""),
    ("stack", "layers\n[0]", ""),
    ("stack", "__class__", "dunder"),
    ("stack", "<__class__>", "dunder"),
    ("stack", "layers.__dict__", "dunder"),
    ("stack", "fn.__func__", "dunder"),
    ("stack", "layers.__len__()", "dunder"),
    ("stack", EXPLOIT, "dunder"),
    ("stack", "fn(__import__('os'))", ""),
    ("stack", "layers[len('a')]", "literal"),
    ("stack", "fn(*[0])", ""),
    ("stack", "fn(**{'i': 0})", ""),
    ("stack", "(0)", "call"),
    ("stack", "layers[0](1)", "not allowed"),
    ("stack", "train(False)", "not allowed"),
    ("stack", "eval()", "not allowed"),
    ("stack", "requires_grad_(False)", "not allowed"),
    ("stack", "zero_grad()", "not allowed"),
    ("stack", "half()", "not allowed"),
    ("stack", "to('meta')", "not allowed"),
    ("stack", "register_buffer('x', None)", "not allowed"),
    ("stack", "layers.pop(0)", "not allowed"),
    ("stack", "layers.append(None)", "not allowed"),
    ("stack", "layers.insert(0, None)", "not allowed"),
    ("stack", "layers.extend([])", "not allowed"),
    ("stack", "_modules.clear()", "not allowed"),
    ("stack", "_modules.pop('layers')", "not allowed"),
    ("stack", "layers[0].linear[0].weight.zero_()", "not allowed"),
    ("stack", "layers[0].linear[0].weight.data.fill_(1.0)", "not allowed"),
    ("seq", "[0].weight.zero_()", "not allowed"),
    ("seq", "[2][0].weight.share_memory_()", "not allowed"),
    ("seq", "[-1].train(False)", "not allowed"),
    ("seq", "pop(0)", "not allowed"),
    ("dictnet", "layers.pop('attr')", "not allowed"),
    ("dictnet", "layers.clear()", "not allowed"),
    ("odd", "<0>.layers.pop(0)", "not allowed"),
    ("outer", "m1.<0>.train(False)", "not allowed"),
    ("outer", "head.reset_parameters()", "not allowed"),
    ("outer", "training.__class__", "dunder"),
    ("outer", "head.weight.mul_(0)", "not allowed"),
]


@pytest.mark.parametrize(("name", "path", "fragment"), BAD)
def test_bad_paths_raise_value_error_and_change_nothing(name, path, fragment):
    model = zoo()[name]
    snap = _snapshot(model)
    with pytest.raises(ValueError) as e:
        resolve_path(model, path)
    _assert_path_error(e, path)
    assert fragment in str(e.value)
    _assert_unchanged(model, snap)


def test_unknown_name_lists_nearest_names():
    with pytest.raises(ValueError, match=r"nearest: \['layers'\]") as e:
        resolve_path(Stack(), "layres")
    _assert_path_error(e, "layres")
    with pytest.raises(ValueError, match="attention") as e:
        resolve_path(Stack(), "layers[0].atention.x")
    # nothing close: the available names are listed instead
    with pytest.raises(ValueError, match=r"available: \['layers'\]"):
        resolve_path(Stack(), "zzzzzz")


def test_torch_methods_refused_but_user_methods_and_get_submodule_allowed():
    model = Stack()
    snap = _snapshot(model)
    assert resolve_path(model, "fn(2)") is model.layers[2]
    assert resolve_path(model, "get_submodule('layers.1.linear')") is model.layers[1].linear
    model.eval()
    with pytest.raises(ValueError, match="not allowed"):
        resolve_path(model, "train()")
    assert not any(m.training for m in model.modules())
    model.train()
    _assert_unchanged(model, snap)


@pytest.mark.parametrize("path", [None, 0, b"layers"])
def test_non_string_path_is_value_error(path):
    with pytest.raises(ValueError, match="must be a str"):
        resolve_path(Stack(), path)


# Known library bugs (reported, not fixed here). strict: an XPASS means a fix landed; drop the mark.
@pytest.mark.parametrize(("name", "path"), [("seq", "[::0]"), ("stack", "layers[::0]")])
def test_value_error_from_inside_still_names_the_path(name, path):
    with pytest.raises(ValueError) as e:
        resolve_path(MODELS[name], path)
    _assert_path_error(e, path)


def test_unhashable_path_is_value_error():
    with pytest.raises(ValueError, match="must be a str"):
        resolve_path(Stack(), ["layers"])


class Picky(Stack):
    def pick(self, idx):
        return self.layers[idx.pop()]


def test_same_path_resolves_the_same_twice():
    model = Picky()
    assert resolve_path(model, "pick([0, 2])") is model.layers[2]
    assert resolve_path(model, "pick([0, 2])") is model.layers[2]


def test_name_to_path_resolves_every_submodule_and_refuses_names_without_a_path_form() -> None:
    from tdhook_fn._paths import PathError, name_to_path, path_to_name, resolve_path

    model = nn.Sequential()
    block = nn.Sequential()
    block.add_module("stage/1", nn.Linear(2, 2))
    block.add_module("a b", nn.ReLU())
    model.add_module("blocks", block)
    model.add_module("0", nn.Tanh())
    for name, module in model.named_modules():
        path = name_to_path(name)
        assert resolve_path(model, path) is module
        assert path_to_name(path) == name
    assert name_to_path("blocks.stage/1") == "blocks.<stage/1>"
    for bad in ("a>b", "x.__class__", "x..y"):
        with pytest.raises(PathError, match="has no path form"):
            name_to_path(bad)
