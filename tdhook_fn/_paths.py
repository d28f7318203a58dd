"""Submodule paths, parsed by a small grammar and never evaluated.

A path names something reachable from a root module, in the syntax of tdhook's
``resolve_submodule_path``:

    "[0]"  "layers[-1]"  "layers['attr']"  "layers.attention"  "layers[1:3]"
    "fn(0)"  "<block0/module>.layers[0]"  "m1.<0>.layers"  "layers.0"
"""

# NOTE [safe paths]
# tdhook 0.1.3 hands these strings to ``eval``, so a path can run arbitrary code. Here a
# path is scanned into steps (attribute, item, call) whose operands are Python literals
# read by ``ast.literal_eval``, and resolving a path never changes the model, nor reaches
# past the model's modules:
#
# - Dunder names are refused. Paths longer than 10,000 characters are refused before
#   they are parsed.
# - A call must directly follow a name (``fn(0)``, ``<fn>(0)``); calling the result of an
#   item or of another call (``[0](1)``, ``fn(0)(1)``) is refused, as its name cannot be
#   checked.
# - Calls follow an allow-list (NOTE [path calls] in ``_path_calls.py``): a path calls only
#   ``get_submodule``, ``get_parameter``, ``get_buffer`` and methods the user's own
#   ``nn.Module`` classes define, on an ``nn.Module``; never a method of torch's,
#   tensordict's, transformers' or another installed library's code (``train``, ``to``,
#   ``ModuleList.pop``, ``reset_parameters_recursive``), also where a class overrides it,
#   and never a method of an object that is not a module (``checkpoint.unlink()``,
#   ``log.setLevel(50)``, ``rng.seed(3)``). Every call is checked before it runs, the first
#   in full and the later ones by name before any call runs.
# - Attribute and item steps read modules and plain containers only (NOTE [path access]
#   in ``_path_access.py``).
# - Parses are cached (``_path_cache.py``): at most 4,096 paths and 1 MiB of paths, steps
#   and literals together, least recently used out first. Failed parses are not cached.

from __future__ import annotations

import ast
import functools
import re
import threading
from dataclasses import dataclass
from typing import Any

from torch import nn

from ._path_access import AccessRefused, read_attribute, read_item, type_name
from ._path_cache import ParseCache, fresh
from ._path_calls import CallRefused, call_refusal, checked_method, later_call_refusal

__all__ = ["Attr", "Call", "Item", "PathError", "Step", "name_to_path", "parse_path", "path_to_name", "resolve_path"]

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


def _check_calls(path: str, root: Any, steps: tuple[Step, ...]) -> frozenset[int]:
    """The indices of the call steps, after refusing the path if any call is refused before
    anything runs: by the name rule, and for a later call by the model's classes (NOTE [path calls])."""
    calls = [i for i, step in enumerate(steps) if isinstance(step, Call)]
    for i in calls:
        name = _called_name(steps, i)
        why = call_refusal(name)
        if why is not None:
            raise _error(path, f"calling {name!r} is not allowed in a path: {why}")
    for i in calls[1:]:
        name = _called_name(steps, i)
        why = later_call_refusal(root, name)
        if why is not None:
            raise _error(path, f"calling {name!r} is not allowed in a path: {why}")
    return frozenset(calls)


def _called_name(steps: tuple[Step, ...], i: int) -> str:
    before = steps[i - 1] if i > 0 else None
    if not isinstance(before, Attr):  # steps come from _parse_steps, which prevents this
        raise AssertionError(f"call step {i} does not follow a name")
    return before.name


def _call(path: str, obj: Any, name: str, call: Call) -> Any:
    """``obj.name(*args, **kwargs)``, where NOTE [path calls] allows it."""
    try:
        method = checked_method(obj, name)
    except CallRefused as e:
        raise _error(path, f"calling {name!r} is not allowed in a path: {e}") from None
    return method(*fresh(call.args), **fresh(dict(call.kwargs)))


def resolve_path(root: nn.Module, path: str) -> Any:
    """Follow ``path`` from ``root`` without evaluating it, and without changing ``root``.

    The whole path is parsed and its calls checked before the first call runs (paths are
    never evaluated): a path may call only methods your own ``nn.Module`` classes
    define (``"fn(0)"``) and ``get_submodule``, ``get_parameter``, ``get_buffer``, on a
    module; it reads attributes of modules (of other objects, their own ``__dict__``
    entries only), and indexes modules, lists, tuples and dicts only.

    Args:
        root (nn.Module): where the path starts.
        path (str): a submodule path (see the module docstring); ``""`` is ``root``.

    Returns:
        Any: the object the path names, usually a submodule.

    Raises:
        PathError: (a ``ValueError``) the path does not parse, names a dunder, calls,
            reads or indexes something it may not, or does not resolve; the message names
            the path and the nearest existing names, or the refused step and why.

    Examples:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
        >>> resolve_path(net, "[0]") is net[0] and resolve_path(net, "<1>") is net[1]
        True
    """
    steps = parse_path(path)
    last_call = max(_check_calls(path, root, steps), default=-1)
    obj: Any = root
    i = 0
    while i < len(steps):
        step, following = steps[i], steps[i + 1] if i + 1 < len(steps) else None
        try:
            if isinstance(step, Attr) and isinstance(following, Call):
                obj = _call(path, obj, step.name, following)
                i += 2
                if i <= last_call and not isinstance(obj, nn.Module):
                    raise _error(
                        path,
                        f"{step.name!r} returned a {type_name(obj)}, not an nn.Module, and a later call "
                        "of the path needs a module to call a method of",
                    )
            elif isinstance(step, Call):  # steps come from _parse_steps, which prevents this
                raise AssertionError(f"call step {i} does not follow a name")
            elif isinstance(step, Attr):
                obj = read_attribute(obj, step.name)
                i += 1
            else:
                obj = read_item(obj, fresh(step.key))
                i += 1
        except AccessRefused as e:
            raise _error(path, str(e)) from None
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


@functools.lru_cache(maxsize=4096)  # a pure function of a string, asked per module on hot paths
def name_to_path(name: str) -> str:
    """The path of the submodule called ``name`` in ``named_modules`` (``""``: the root).

    Each dotted part that is not an identifier is quoted, ``<part>``; the path resolves
    to the submodule with `resolve_path`. The inverse of `path_to_name` on such names.

    Raises:
        PathError: a part is empty, holds ``>`` (the quoting ends there) or starts with
            ``__`` (paths refuse those): the submodule has no path form.

    Examples:
        >>> name_to_path("layers.0.attn"), name_to_path("blocks.stage/1.fc")
        ('layers.0.attn', 'blocks.<stage/1>.fc')
    """
    if not name:
        return ""
    parts = name.split(".")
    for part in parts:
        if not part or ">" in part or part.startswith("__"):
            raise PathError(f"the submodule {name!r} has no path form (its part {part!r} is empty, holds '>' or starts "
                            "with '__', which paths refuse); rename the module (add_module with another name)")
    return ".".join(part if _NAME.fullmatch(part) else f"<{part}>" for part in parts)
