"""Submodule paths, parsed by a small grammar and never evaluated.

A path names something reachable from a root module, in the syntax of tdhook's
``resolve_submodule_path``:

    "[0]"  "layers[-1]"  "layers['attr']"  "layers.attention"  "layers[1:3]"
    "fn(0)"  "<block0/module>.layers[0]"  "m1.<0>.layers"  "layers.0"

# NOTE [safe paths]
tdhook 0.1.3 hands these strings to ``eval``, so a path can run arbitrary code. Here a
path is scanned into steps (attribute, item, call) whose operands are Python literals
read by ``ast.literal_eval``, and resolving a path never changes the model:

- Dunder names are refused. Paths longer than 10,000 characters are refused before
  they are parsed.
- A call must directly follow a name (``fn(0)``, ``<fn>(0)``); calling the result of an
  item or of another call (``[0](1)``, ``fn(0)(1)``) is refused, as its name cannot be
  checked.
- A call is refused by the *name* it calls, overridden or not, when that name is part of
  an API that can change a model: anything defined on ``torch.nn.Module`` and its
  containers, the module classes of ``torch.nn`` and ``tensordict.nn``, ``torch.Tensor``,
  ``tensordict.TensorDictBase``, and transformers' ``PreTrainedModel`` and
  ``GenerationMixin`` once transformers is imported (we never import it); and any name
  ending in ``_``. So a user class overriding ``train`` cannot be switched to eval by
  ``"train(False)"``, nor a TensorDictModule re-initialised by
  ``"reset_parameters_recursive()"``. The read-only lookups ``get_submodule``,
  ``get_parameter`` and ``get_buffer`` stay callable. By name, not by where the function
  is defined: an override lives in user code and calls the library's version, and
  tensordict's and transformers' methods are not torch's, so a check of ``__module__``
  lets both through. See ``_path_calls.py``.
- The whole path is parsed and every call name checked *before* the first step is
  applied, so a refused call anywhere in a path means nothing in it ran. When a call is
  made, the object must be a Python function or method (no builtins, no classes), whose
  own name passes the rule and which is not defined in torch, tensordict or transformers
  (an alias such as ``self.fn = self.train`` is refused there).
- Parses are cached (``_path_cache.py``): at most 4,096 paths and 1 MiB of paths, steps
  and literals together, least recently used out first. Failed parses are not cached.
"""

from __future__ import annotations

import ast
import copy
import difflib
import re
import threading
from dataclasses import dataclass
from typing import Any

from torch import nn

from ._path_cache import ParseCache
from ._path_calls import call_refusal, callable_refusal

__all__ = ["Attr", "Call", "Item", "PathError", "Step", "parse_path", "path_to_name", "resolve_path"]

_NAME = re.compile(r"\w+")  # identifiers, also digit-led ("layers.0") and non-ASCII
_CLOSING = {"[": "]", "(": ")"}
_MAX_LENGTH = 10_000  # characters; longer paths are refused before parsing


@dataclass(frozen=True, slots=True)
class Attr:
    """``getattr(obj, name)``."""

    name: str


@dataclass(frozen=True, slots=True)
class Item:
    """``obj[key]`` with a literal key (int, str, slice, ...)."""

    key: Any


@dataclass(frozen=True, slots=True)
class Call:
    """``obj(*args, **kwargs)`` with literal arguments."""

    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]


Step = Attr | Item | Call


class PathError(ValueError):
    """A submodule path that does not parse, is refused, or does not resolve.

    The message names the path and says why. A ``ValueError``, so code catching
    ``ValueError`` (as for tdhook) keeps working.
    """


def _error(path: str, why: str) -> PathError:
    return PathError(f"invalid submodule path {path!r}: {why}")


def _find_closing(path: str, start: int) -> int:
    """Index of the bracket closing ``path[start]``, skipping quoted strings."""
    opening = path[start]
    closing = _CLOSING[opening]
    depth = 0
    quote: str | None = None
    i = start
    while i < len(path):
        c = path[i]
        if quote is not None:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == opening:
            depth += 1
        elif c == closing:
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise _error(path, f"missing closing {closing!r}")


def _literal(path: str, node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        source = ast.unparse(node)
        raise _error(path, f"only literals may appear in brackets and call arguments, not {source!r}") from None


def _parse_subscript(path: str, content: str) -> Any:
    node = _parse_expression(path, f"_[{content}]")
    if not isinstance(node, ast.Subscript):
        raise _error(path, f"[{content}] is not a subscript")
    index = node.slice
    if isinstance(index, ast.Slice):
        bounds = (index.lower, index.upper, index.step)
        return slice(*(None if b is None else _literal(path, b) for b in bounds))
    return _literal(path, index)


def _parse_arguments(path: str, content: str) -> Call:
    node = _parse_expression(path, f"_({content})")
    if not isinstance(node, ast.Call) or any(isinstance(a, ast.Starred) for a in node.args):
        raise _error(path, f"({content}) is not a call with literal arguments")
    if any(k.arg is None for k in node.keywords):
        raise _error(path, "** arguments are not allowed")
    args = tuple(_literal(path, a) for a in node.args)
    kwargs = tuple((str(k.arg), _literal(path, k.value)) for k in node.keywords)
    return Call(args, kwargs)


# NOTE [ast under threads]: CPython 3.11's ast.parse converts its tree to Python objects
# with a per-interpreter recursion counter; two threads parsing at once can raise
# "SystemError: AST constructor recursion depth mismatch". Parses are cached, so
# serialising the rare uncached ones costs nothing measurable.
_AST_LOCK = threading.Lock()


def _parse_expression(path: str, source: str) -> ast.expr:
    try:
        with _AST_LOCK:  # NOTE [ast under threads]
            node = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise _error(path, f"cannot parse {source[1:]!r} ({e})") from None
    base = node.value if isinstance(node, ast.Subscript) else getattr(node, "func", None)
    if not (isinstance(base, ast.Name) and base.id == "_"):
        raise _error(path, f"cannot parse {source[1:]!r}")
    return node


def parse_path(path: str) -> tuple[Step, ...]:
    """Split a path into attribute, item and call steps.

    Only the syntax is checked here; `resolve_path` also refuses calls by name (paths are
    never evaluated).

    Args:
        path (str): a submodule path; ``""`` is the root itself.

    Returns:
        tuple[Step, ...]: the steps, applied left to right from the root.

    Raises:
        PathError: the path is not in the grammar, names a dunder attribute, calls
            something that does not directly follow a name, or is longer than 10,000
            characters.

    Examples:
        >>> parse_path("layers[0].<block/0>.fn(1)")
        (Attr(name='layers'), Item(key=0), Attr(name='block/0'), Attr(name='fn'), Call(args=(1,), kwargs=()))
    """
    if not isinstance(path, str):
        raise PathError(f"a submodule path must be a str, got {type(path).__name__}")
    if len(path) > _MAX_LENGTH:
        raise PathError(
            f"invalid submodule path {path[:40]!r}... ({len(path)} characters): "
            f"paths longer than {_MAX_LENGTH} characters are refused"
        )
    return _parse(path)


_CACHE: ParseCache[tuple[Step, ...]] = ParseCache(max_entries=4096, max_bytes=1 << 20)


def _parse(path: str) -> tuple[Step, ...]:
    """`_parse_steps`, cached (failures are not cached)."""
    steps = _CACHE.get(path)
    if steps is None:
        steps = _parse_steps(path)
        _CACHE.put(path, steps)
    return steps


def _parse_steps(path: str) -> tuple[Step, ...]:
    steps: list[Step] = []
    i = 0
    name_allowed = True  # a bare name may start the path or follow '.' or '<...>'
    after_name = False  # the last token was a name: only then may a call follow
    while i < len(path):
        c = path[i]
        if c == ".":
            i, name_allowed, after_name = i + 1, True, False
        elif c == "<":
            end = path.find(">", i + 1)
            if end < 0:
                raise _error(path, "missing closing '>'")
            steps.append(_checked_attr(path, path[i + 1 : end]))
            i, name_allowed, after_name = end + 1, True, True
        elif c == "[":
            end = _find_closing(path, i)
            steps.append(Item(_parse_subscript(path, path[i + 1 : end])))
            i, name_allowed, after_name = end + 1, False, False
        elif c == "(":
            if not after_name:
                raise _error(path, _misplaced_call(steps, i))
            end = _find_closing(path, i)
            steps.append(_parse_arguments(path, path[i + 1 : end]))
            i, name_allowed, after_name = end + 1, False, False
        elif (match := _NAME.match(path, i)) and name_allowed:
            steps.append(_checked_attr(path, match.group()))
            i, name_allowed, after_name = match.end(), False, True
        else:
            raise _error(path, f"unexpected {c!r} at position {i}")
    return tuple(steps)


def _misplaced_call(steps: list[Step], i: int) -> str:
    if not steps:
        return "a call needs a method name before it, as in 'fn(0)'"
    if isinstance(steps[-1], Attr):
        return f"a call must directly follow a method name, as in 'fn(0)' ('(' at position {i})"
    return (
        f"calling the result of an item or of another call ('(' at position {i}) is not allowed: "
        "a call must directly follow a method name, whose name is checked"
    )


def _checked_attr(path: str, name: str) -> Attr:
    if name.startswith("__"):
        raise _error(path, f"dunder names such as {name!r} are not allowed")
    return Attr(name)


def _children(obj: Any) -> list[str]:
    if isinstance(obj, nn.Module):
        return [*obj._modules, *obj._parameters, *obj._buffers]
    return [n for n in dir(obj) if not n.startswith("_")]


def _nearest(obj: Any, wanted: Any) -> str:
    names = _children(obj)
    close = difflib.get_close_matches(str(wanted), names, n=3)
    hint = f"nearest: {close}" if close else f"available: {names[:20]}"
    return f"{type(obj).__name__} has no {wanted!r} ({hint})"


def _check_calls(path: str, steps: tuple[Step, ...]) -> None:
    """Refuse the path if any of its calls is refused by name; nothing has run yet."""
    for i, step in enumerate(steps):
        if isinstance(step, Call):
            name = _called_name(steps, i)
            why = call_refusal(name)
            if why is not None:
                raise _error(path, f"calling {name!r} is not allowed in a path: {why}")


def _called_name(steps: tuple[Step, ...], i: int) -> str:
    before = steps[i - 1] if i > 0 else None
    if not isinstance(before, Attr):  # steps come from _parse_steps, which prevents this
        raise AssertionError(f"call step {i} does not follow a name")
    return before.name


def _apply(path: str, obj: Any, steps: tuple[Step, ...], i: int) -> Any:
    step = steps[i]
    if isinstance(step, Attr):
        try:
            return getattr(obj, step.name)
        except AttributeError:
            raise _error(path, _nearest(obj, step.name)) from None
    if isinstance(step, Item):
        try:
            return obj[_fresh(step.key)]
        except (IndexError, KeyError, TypeError) as e:
            raise _error(path, f"{_nearest(obj, step.key)}; {type(e).__name__}: {e}") from None
    why = callable_refusal(obj)
    if why is not None:
        raise _error(path, f"calling {_called_name(steps, i)!r} is not allowed in a path: {why}")
    return obj(*_fresh(step.args), **_fresh(dict(step.kwargs)))


_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), type(Ellipsis))


def _fresh(value: Any) -> Any:
    """``value`` or, if it holds anything mutable, a deep copy: code that mutates its
    arguments or keys must not change the cached parse."""
    if isinstance(value, _IMMUTABLE):
        return value
    if isinstance(value, tuple) and all(isinstance(v, _IMMUTABLE) for v in value):
        return value
    if isinstance(value, slice) and all(isinstance(v, _IMMUTABLE) for v in (value.start, value.stop, value.step)):
        return value
    if isinstance(value, dict) and all(isinstance(v, _IMMUTABLE) for v in value.values()):
        return value  # a new dict each call (from step.kwargs); its keys are str
    return copy.deepcopy(value)


def resolve_path(root: nn.Module, path: str) -> Any:
    """Follow ``path`` from ``root`` without evaluating it, and without changing ``root``.

    The whole path is parsed and its calls checked before the first step is taken (paths
    are never evaluated): a path may call only your own methods (``"fn(0)"``) and
    ``get_submodule``, ``get_parameter``, ``get_buffer``.

    Args:
        root (nn.Module): where the path starts.
        path (str): a submodule path (see the module docstring); ``""`` is ``root``.

    Returns:
        Any: the object the path names, usually a submodule.

    Raises:
        PathError: (a ``ValueError``) the path does not parse, names a dunder, calls
            something it may not, or does not resolve; the message names the path and
            the nearest existing names, or the refused method and why.

    Examples:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
        >>> resolve_path(net, "[0]") is net[0] and resolve_path(net, "<1>") is net[1]
        True
    """
    steps = parse_path(path)
    _check_calls(path, steps)
    obj: Any = root
    for i in range(len(steps)):
        try:
            obj = _apply(path, obj, steps, i)
        except PathError:
            raise
        except Exception as e:  # a user method or property failed: still a bad path
            raise _error(path, f"{type(e).__name__}: {e}") from e
    return obj


def path_to_name(path: str) -> str:
    """A key-friendly name for a path, as tdhook names them.

    Paths holding a negative index, a slice or a call are returned unchanged; otherwise
    quotes are dropped and brackets become dots.

    Args:
        path (str): a submodule path, as `tdhook_fn.resolve_path` reads it.

    Examples:
        >>> path_to_name("layers[0]['attn']"), path_to_name("<block/0>.fc")
        ('layers.0.attn', 'block/0.fc')
    """
    if re.search(r"\[-|[:()]", path):
        return path
    name = re.sub(r"[<>\[\]]", ".", re.sub(r"[\"']", "", path))
    return re.sub(r"\.+", ".", name).strip(".")
