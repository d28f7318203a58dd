"""Submodule paths, parsed by a small grammar and never evaluated.

A path names something reachable from a root module, in the syntax of tdhook's
``resolve_submodule_path``::

    "[0]"  "layers[-1]"  "layers['attr']"  "layers.attention"  "layers[1:3]"
    "fn(0)"  "<block0/module>.layers[0]"  "m1.<0>.layers"  "layers.0"

# NOTE [safe paths]
tdhook 0.1.3 hands these strings to ``eval``, so a path can run arbitrary code. Here a
path is scanned into steps (attribute, item, call) whose operands are Python literals
read by ``ast.literal_eval``. Dunder names are refused, and a call step may only invoke
a function or method defined outside torch (torch's own methods such as ``train``,
``to`` or ``ModuleList.pop`` change the model).
"""

from __future__ import annotations

import ast
import copy
import difflib
import functools
import inspect
import re
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["Attr", "Call", "Item", "Step", "parse_path", "path_to_name", "resolve_path"]

_NAME = re.compile(r"\w+")  # identifiers, also digit-led ("layers.0") and non-ASCII
_CLOSING = {"[": "]", "(": ")"}
_CALLABLE_FROM_TORCH = ("get_submodule",)


@dataclass(frozen=True)
class Attr:
    """``getattr(obj, name)``."""

    name: str


@dataclass(frozen=True)
class Item:
    """``obj[key]`` with a literal key (int, str, slice, ...)."""

    key: Any


@dataclass(frozen=True)
class Call:
    """``obj(*args, **kwargs)`` with literal arguments."""

    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]


Step = Attr | Item | Call


class _PathError(ValueError):
    """A ValueError that already names the path."""


def _error(path: str, why: str) -> ValueError:
    return _PathError(f"invalid submodule path {path!r}: {why}")


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


def _parse_expression(path: str, source: str) -> ast.expr:
    try:
        node = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise _error(path, f"cannot parse {source[1:]!r} ({e})") from None
    base = node.value if isinstance(node, ast.Subscript) else getattr(node, "func", None)
    if not (isinstance(base, ast.Name) and base.id == "_"):
        raise _error(path, f"cannot parse {source[1:]!r}")
    return node


def parse_path(path: str) -> tuple[Step, ...]:
    """Split a path into attribute, item and call steps.

    Args:
        path (str): a submodule path; ``""`` is the root itself.

    Returns:
        tuple[Step, ...]: the steps, applied left to right from the root.

    Raises:
        ValueError: the path is not in the grammar, or names a dunder attribute.

    >>> parse_path("layers[0].<block/0>.fn(1)")
    (Attr(name='layers'), Item(key=0), Attr(name='block/0'), Attr(name='fn'), Call(args=(1,), kwargs=()))
    """
    if not isinstance(path, str):
        raise ValueError(f"a submodule path must be a str, got {type(path).__name__}")
    return _parse(path)


@functools.lru_cache(maxsize=4096)
def _parse(path: str) -> tuple[Step, ...]:
    steps: list[Step] = []
    i = 0
    name_allowed = True  # a bare name may start the path or follow '.' or '<...>'
    while i < len(path):
        c = path[i]
        if c == ".":
            i, name_allowed = i + 1, True
        elif c == "<":
            end = path.find(">", i + 1)
            if end < 0:
                raise _error(path, "missing closing '>'")
            steps.append(_checked_attr(path, path[i + 1 : end]))
            i, name_allowed = end + 1, True
        elif c == "[":
            end = _find_closing(path, i)
            steps.append(Item(_parse_subscript(path, path[i + 1 : end])))
            i, name_allowed = end + 1, False
        elif c == "(":
            if not steps:
                raise _error(path, "a call needs something to call")
            end = _find_closing(path, i)
            steps.append(_parse_arguments(path, path[i + 1 : end]))
            i, name_allowed = end + 1, False
        elif (match := _NAME.match(path, i)) and name_allowed:
            steps.append(_checked_attr(path, match.group()))
            i, name_allowed = match.end(), False
        else:
            raise _error(path, f"unexpected {c!r} at position {i}")
    return tuple(steps)


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


def _check_callable(path: str, fn: Any) -> None:
    """Refuse torch's own methods (they can change the model) and builtins."""
    func = getattr(fn, "__func__", fn)
    name = getattr(func, "__name__", "")
    if name in _CALLABLE_FROM_TORCH and inspect.ismethod(fn):
        return
    module = getattr(func, "__module__", None) or ""
    if not inspect.isfunction(func) or module == "torch" or module.startswith("torch."):
        raise _error(path, f"calling {name or type(fn).__name__!r} is not allowed: only functions "
                     "and methods defined outside torch may be called from a path")


def _apply(path: str, obj: Any, step: Step) -> Any:
    if isinstance(step, Attr):
        try:
            return getattr(obj, step.name)
        except AttributeError:
            raise _error(path, _nearest(obj, step.name)) from None
    if isinstance(step, Item):
        try:
            return obj[step.key]
        except (IndexError, KeyError, TypeError) as e:
            raise _error(path, f"{_nearest(obj, step.key)}; {type(e).__name__}: {e}") from None
    _check_callable(path, obj)
    # copies: a method that mutates its arguments must not change the cached parse
    return obj(*copy.deepcopy(step.args), **copy.deepcopy(dict(step.kwargs)))


def resolve_path(root: nn.Module, path: str) -> Any:
    """Follow ``path`` from ``root`` without evaluating it.

    Args:
        root (nn.Module): where the path starts.
        path (str): a submodule path (see the module docstring); ``""`` is ``root``.

    Returns:
        Any: the object the path names, usually a submodule.

    Raises:
        ValueError: the path does not parse, names a dunder, or does not resolve; the
            message names the path and the nearest existing names.

    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    >>> resolve_path(net, "[0]") is net[0] and resolve_path(net, "<1>") is net[1]
    True
    """
    obj: Any = root
    for step in parse_path(path):
        try:
            obj = _apply(path, obj, step)
        except _PathError:
            raise
        except Exception as e:  # a user method or property failed: still a bad path
            raise _error(path, f"{type(e).__name__}: {e}") from e
    return obj


def path_to_name(path: str) -> str:
    """A key-friendly name for a path, as tdhook names them.

    Paths holding a negative index, a slice or a call are returned unchanged; otherwise
    quotes are dropped and brackets become dots.

    >>> path_to_name("layers[0]['attn']"), path_to_name("<block/0>.fc")
    ('layers.0.attn', 'block/0.fc')
    """
    if re.search(r"\[-|[:()]", path):
        return path
    name = re.sub(r"[<>\[\]]", ".", re.sub(r"[\"']", "", path))
    return re.sub(r"\.+", ".", name).strip(".")
