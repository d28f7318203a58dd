"""What a compat factory's ``_prepare_module`` changed on a module, and putting it back (NOTE [prepared attributes])."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["attribute_state", "changes_since", "put_back"]


# NOTE [prepared attributes]
# tdhook's ``_prepare_module`` may set attributes on the context's TensorDictModule
# (the user's, when they passed one) for ``_restore_module`` to delete. Whatever the
# prepare step changed there (names added, removed or rebound, in ``__dict__`` or in
# ``_parameters``/``_buffers``/``_modules``) is recorded against the state before it, and
# on exit any of it that the restore step did not undo is put back: after a failing
# prepare, body or restore too. Only the prepare step's own changes are undone, so
# contexts over one module may close in any order, and the body's changes are the
# user's. ``training`` is left alone (``train()`` changes the whole tree).
_SLOTS = ("_parameters", "_buffers", "_modules")
_SKIPPED = frozenset((*_SLOTS, "training"))
_State = dict[str, tuple[str, Any]]


def attribute_state(module: nn.Module) -> _State:
    """Name -> (where it lives, value) for the attributes of ``module`` itself."""
    state = {}
    for name, value in vars(module).items():  # (loops, not comprehensions: no call per entry point)
        if name not in _SKIPPED:
            state[name] = ("__dict__", value)
    for slot in _SLOTS:
        for name, value in getattr(module, slot).items():
            state[name] = (slot, value)
    return state


def _same(a: tuple[str, Any] | None, b: tuple[str, Any] | None) -> bool:
    return a is b or (a is not None and b is not None and a[0] == b[0] and a[1] is b[1])


def changes_since(module: nn.Module, before: _State) -> dict[str, tuple[str, Any] | None]:
    """The names whose state differs from ``before``, with their state before."""
    after = attribute_state(module)
    if len(after) == len(before):  # the usual case, nothing changed: checked without a call per name
        for name, (slot, value) in after.items():
            old = before.get(name)
            if old is None or old[0] != slot or old[1] is not value:
                break
        else:
            return {}
    names = before.keys() | after.keys()
    return {name: before.get(name) for name in names if not _same(before.get(name), after.get(name))}


def put_back(module: nn.Module, changes: dict[str, tuple[str, Any] | None]) -> None:
    """Give each name in ``changes`` its recorded state again, where it differs now."""
    now = attribute_state(module)
    for name, old in changes.items():
        current = now.get(name)
        if _same(current, old):
            continue
        if current is not None:
            del (vars(module) if current[0] == "__dict__" else getattr(module, current[0]))[name]
            if current[0] == "_buffers":
                module._non_persistent_buffers_set.discard(name)
        if old is not None:
            (vars(module) if old[0] == "__dict__" else getattr(module, old[0]))[name] = old[1]
