"""A module's input as a tap at its input reads it: what the forward gets positionally, or by its first name."""

from __future__ import annotations

import inspect
import weakref
from typing import Any

from ._paths import path_to_name

__all__ = ["first_input", "input_name", "keyword_input_error", "with_first_input"]

# NOTE [a module's input]
# A tap at a module's input reads what its forward receives positionally: the one
# argument, or the tuple of several (the keyword arguments stay as they are, as in a call
# ``attn(h, mask=m)``). A call that passes nothing positionally passes its input by name:
# ``act(input=h)``, a Hugging Face layer calling its attention with ``hidden_states=h``,
# the root, which ``f`` calls with its in_keys by name. There the argument of the
# forward's first parameter stands for the input, as if passed by position, and what a
# tap hands on goes back under that name. Where the forward's first parameter takes
# ``*args`` or is positional-only, or the call leaves it out, no argument is the input:
# the tap raises, naming the module, rather than read (or replace) nothing.

# (per forward, held weakly: a class's, or an instance's own, as accelerate's hooks set; a signature costs ~20 us)
_first_names: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()


def _first_parameter(forward: Any) -> str | None:
    """The name of ``forward``'s first parameter where it can be passed by name (``self`` bound)."""
    try:
        first = next(iter(inspect.signature(forward).parameters.values()), None)
    except (TypeError, ValueError):  # (a callable without a signature Python can read)
        return None
    return first.name if first is not None and first.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD else None


def input_name(module: Any, kwargs: dict[str, Any]) -> str | None:
    """The keyword that passes ``module``'s input in a call without positional arguments (NOTE [a module's input]);
    ``None`` where none of ``kwargs`` does."""
    function = vars(module).get("forward") or type(module).forward
    try:
        if function not in _first_names:
            _first_names[function] = _first_parameter(module.forward)
        name = _first_names[function]
    except TypeError:  # (a forward that cannot be held weakly: read each time)
        name = _first_parameter(module.forward)
    return name if name in kwargs else None


def first_input(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, str | None]:
    """``module``'s first input in a call, and the keyword passing it (``None``: by position, or no input there)."""
    if args or not kwargs:
        return (args[0] if args else None), None
    name = input_name(module, kwargs)
    return (None if name is None else kwargs[name]), name


def with_first_input(args: tuple[Any, ...], kwargs: dict[str, Any], name: str | None,
                     value: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with ``value`` as its first input (passed by ``name``, else by position)."""
    return ((value, *args[1:]), kwargs) if name is None else (args, {**kwargs, name: value})


def keyword_input_error(path: str, kwargs: dict[str, Any]) -> ValueError:
    """The error of a tap at the input of the module at ``path``, called with keyword arguments ``kwargs`` only, none
    of them its input (NOTE [a module's input])."""
    where = f"module {path!r}" if path_to_name(path) else "model itself (the root module)"
    return ValueError(f"a tap at the input of the {where}: the module is called with keyword arguments only "
                      f"({', '.join(map(repr, kwargs))}), none of them the argument of its forward's first "
                      "parameter, which a tap at a module's input reads (or its positional arguments); read the "
                      "output of the module that computes the input instead, or call the module with it by position")
