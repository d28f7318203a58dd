"""Fuzzed submodule paths never run code: a sentinel reachable only through dunders stays uncalled.

The model also holds objects that are not modules (a checkpoint file, a logger, random
generators, a plain object with a method, a defaultdict): no path touches them
(NOTE [path calls], NOTE [path access]).
"""

import logging
import pathlib
import random
import tempfile
from collections import defaultdict

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from tdhook_fn._paths import Attr, _parse_steps, parse_path, resolve_path

SENTINEL_CALLS: list[object] = []
OK_CALLS: list[object] = []


def sentinel(*args, **kwargs):
    SENTINEL_CALLS.append((args, kwargs))
    return SENTINEL_CALLS


class Helper:
    """Not a module: its own method is the user's code, but no path may call it."""

    def poke(self, *args, **kwargs):
        return sentinel("poke", *args, **kwargs)


_TMP = tempfile.TemporaryDirectory()  # removed when the interpreter exits
CHECKPOINT = pathlib.Path(_TMP.name) / "ckpt.pt"
CHECKPOINT.write_text("weights")
LOG = logging.getLogger("tdhook_fn.tests.paths_fuzz")
LOG.setLevel(logging.WARNING)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(3, 3), nn.ReLU()) for _ in range(3)])
        self.add_module("0", nn.Linear(3, 1))
        self.register_buffer("x", torch.arange(3.0))
        self.checkpoint = CHECKPOINT
        self.log = LOG
        self.rng = torch.Generator().manual_seed(0)
        self.pyrng = random.Random(0)
        self.helper = Helper()
        self.lazy: defaultdict[str, list[int]] = defaultdict(list)

    def fn(self, i):
        return self.layers[i]

    def ok(self, i=0):
        OK_CALLS.append(i)
        return self.layers[i]

    def me(self):
        OK_CALLS.append("me")
        return self


MODEL = Net()
MODEL.eval()
STATE = {k: v.detach().clone() for k, v in MODEL.state_dict().items()}
N_MODULES = len(list(MODEL.modules()))
RNG_STATE = MODEL.rng.get_state().clone()
PYRNG_STATE = MODEL.pyrng.getstate()

ALPHABET = "abcdefgilnorstuxy_0123456789[]()<>.:-'\",=*/\\ #;+"
TOKENS = [
    *"""
    __class__ __init__ __globals__ __builtins__ ['__builtins__'] ['sentinel'] __import__ ('os')
    getcwd () sentinel sentinel() ( ) [ ] < > . : -1 'x' 0 1 layers fn fn(0) lambda ; __subclasses__
    __dict__ __func__ __self__ _modules train (False) pop zero_ weight data x get_submodule
    ('layers.0') __getattribute__ <0> <__class__> ' " , * ** = i=0 {} [] eval exec print _ __
    __mro__ [1:] [::-1] append (None) \\ #
    """.split(),
    "import os",
    " ",
    "\n",
]
text_paths = st.text(alphabet=ALPHABET, max_size=40)
grammar_paths = st.lists(st.sampled_from(TOKENS), max_size=14).map("".join)
NAMES = [
    *"layers fn train pop append insert zero_ fill_ mul_ weight data x _modules _buffers get_submodule"
    " clear eval half to requires_grad_ sentinel getcwd system 0 1 2".split(),
    *"checkpoint log rng pyrng helper lazy me poke unlink write_text parent setLevel seed manual_seed".split(),
    *"__class__ __init__ __globals__ __func__ __self__ __dict__ __subclasses__ __import__ __builtins__"
    " __base__ __mro__ __getattribute__ __setattr__ __call__".split(),
]
ITEMS = "[0] [-1] [2] [1:] [::-1] ['x'] ['layers'] ['sentinel'] ['__builtins__'] ['__import__'] [()]".split()
CALLS = "() (0) (1) (3) (50) (False) (True) ('os') ('x') (None) (1.0) ('layers.0') (i=0) ('x',None)".split()
step = st.one_of(
    st.sampled_from(NAMES).map(lambda n: "." + n),
    st.sampled_from(NAMES).map(lambda n: f"<{n}>"),
    st.sampled_from(ITEMS),
    st.sampled_from(CALLS),
)
structured_paths = st.lists(step, min_size=1, max_size=8).map("".join)
# Attacks grafted onto paths that resolve, so that a missing guard is found within a few examples.
PREFIXES = [
    *["", "layers", "layers[0]", "layers[-1][0]", "layers.0.0", "fn", "fn(0)", "fn(1)[0]", "<0>", "x"],
    *["get_submodule('layers.2')", "_modules['layers']", "<layers>[1:]", "me()", "me().me()", "checkpoint"],
]
ATTACKS = [
    *[".train()", ".train(True)", ".pop(0)", ".pop(-1)", ".append(None)", ".insert(0, None)", ".clear()"],
    *[".zero_()", ".weight.zero_()", ".weight.data.fill_(1.0)", ".mul_(0)", ".half()", ".to('meta')"],
    *[".requires_grad_(False)", "._modules.clear()", ".__dict__.clear()", ".__setattr__('training', 1)"],
    *[".checkpoint.unlink()", ".checkpoint.write_text('x')", ".unlink()", ".checkpoint.parent", ".log.setLevel(50)"],
    *[".rng.seed()", ".rng.manual_seed(3)", ".pyrng.seed(3)", ".helper.poke(1)", "<helper>.<poke>()", ".lazy['k']"],
    ".__globals__['sentinel']()",
    "<__globals__>['sentinel']()",
    ".__func__.__globals__['sentinel']()",
    ".__class__.fn.__globals__['sentinel']()",
    ".__class__.__init__.__globals__['sentinel']()",
    ".__class__.__init__.__globals__['__builtins__']['__import__']('os').getcwd()",
]
tails = st.lists(st.one_of(step, st.sampled_from(ATTACKS)), max_size=2).map("".join)
attack_paths = st.tuples(st.sampled_from(PREFIXES), st.sampled_from(ATTACKS), tails).map("".join)
EXPLOITS = [
    "fn.__globals__['sentinel']()",
    "<fn><__globals__>['sentinel']()",
    "fn.__func__.__globals__['sentinel']()",
    "__init__.__globals__['sentinel']()",
    "__class__.fn.__globals__['sentinel']()",
    "__class__.__init__.__globals__['sentinel']()",
    "layers.__class__.__mro__[-1].__subclasses__()",
    "__class__.__init__.__globals__['__builtins__']['__import__']('os').getcwd()",
]
exploit_paths = st.tuples(st.sampled_from(EXPLOITS), st.lists(step, max_size=2).map("".join)).map("".join)
paths = st.one_of(
    text_paths,
    exploit_paths,
    grammar_paths,
    structured_paths,
    attack_paths,
    st.tuples(st.one_of(structured_paths, grammar_paths), text_paths).map("".join),
)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _model_unchanged():
    state = MODEL.state_dict()
    assert state.keys() == STATE.keys()
    assert all(torch.equal(state[k], STATE[k]) for k in state)
    assert not any(m.training for m in MODEL.modules())
    assert len(list(MODEL.modules())) == N_MODULES and len(MODEL.layers) == 3
    assert CHECKPOINT.read_text() == "weights" and sorted(CHECKPOINT.parent.iterdir()) == [CHECKPOINT]
    assert LOG.level == logging.WARNING
    assert torch.equal(MODEL.rng.get_state(), RNG_STATE) and MODEL.pyrng.getstate() == PYRNG_STATE
    assert MODEL.lazy == {}


@FUZZ
@given(paths)
def test_resolve_returns_or_raises_value_error_and_runs_nothing(path):
    try:
        resolve_path(MODEL, path)
    except ValueError:
        pass
    assert SENTINEL_CALLS == []
    _model_unchanged()


@FUZZ
@given(paths)
def test_parse_is_deterministic_and_never_yields_dunders(path):
    try:
        steps = parse_path(path)
    except ValueError as e:
        # uncached parse fails the same way
        try:
            _parse_steps(path)
        except ValueError as again:
            assert str(again) == str(e)
        else:
            raise AssertionError(f"{path!r} parsed uncached but not cached") from None
        return
    assert isinstance(steps, tuple)
    assert repr(_parse_steps(path)) == repr(steps)
    assert all(not s.name.startswith("__") for s in steps if isinstance(s, Attr))
    assert SENTINEL_CALLS == []


# Paths whose allowed calls come before a refused one: the allowed calls must not run either.
CALL_PREFIXES = ["ok()", "ok(1)", "ok(0)[0]", "ok(2).0", "<ok>(1)", "layers[0]", "fn(0)", "x", "me()", "me().me()"]
refused_after_calls = st.tuples(
    st.lists(st.sampled_from(CALL_PREFIXES), min_size=1, max_size=2).map(".".join),
    st.sampled_from([a for a in ATTACKS if "(" in a]),
    tails,
).map("".join)


@FUZZ
@given(refused_after_calls)
def test_a_refused_call_anywhere_means_no_call_runs(path):
    OK_CALLS.clear()  # other tests may make allowed calls
    try:
        resolve_path(MODEL, path)
    except ValueError:
        pass
    else:
        raise AssertionError(f"{path!r} resolved")
    assert OK_CALLS == [] and SENTINEL_CALLS == []
    _model_unchanged()


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(["", "layers", "fn(0)", "<0>", "layers[1:]", "get_submodule('layers.2')"]))
def test_fuzz_model_is_reachable(path):
    # the fuzzed model does answer good paths, so the properties above are not vacuous
    assert resolve_path(MODEL, path) is not None
    assert SENTINEL_CALLS == []


def test_sentinel_is_live():
    OK_CALLS.clear()
    # sentinel would record a call, and is only reachable through dunders
    sentinel(1)
    assert SENTINEL_CALLS == [((1,), {})]
    SENTINEL_CALLS.clear()
    assert MODEL.fn.__func__.__globals__["sentinel"] is sentinel
    # and ok() records its calls when a path may make them
    assert resolve_path(MODEL, "ok(1)") is MODEL.layers[1]
    assert OK_CALLS == [1]
    OK_CALLS.clear()
    # the held objects are live: a path could change them if it reached them
    assert MODEL.helper.poke(0) is SENTINEL_CALLS
    SENTINEL_CALLS.clear()
    assert resolve_path(MODEL, "me().checkpoint") is CHECKPOINT and OK_CALLS == ["me"]
    OK_CALLS.clear()
