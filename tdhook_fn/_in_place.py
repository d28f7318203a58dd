"""Taps on a module that writes its input in place: the module runs on a copy, the tap's result goes back into it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ._module_input import first_input, with_first_input

__all__ = ["Handed", "InPlaceFrames", "handed", "tap_hooks", "writes_in_place", "written_back"]

# NOTE [replaced derivatives of in-place modules]
# A module that writes its input in place (``y = relu_(h)``) leaves ``h`` holding its
# output, and a model may read ``h`` again (``head(y) + other(h)``). A tap that replaces
# the module's derivative hands the module a copy of ``h`` (a `map_grad`'s, or a copy for
# the module's own backward to keep), so ``h`` would keep its old value and ``other(h)``
# would read that, silently; a layer's perturbation on a new tensor would reach the
# target through ``y`` alone. So where the module wrote its copy, the tap writes its
# result (the replaced derivative, the perturbation) back into ``h`` and hands on ``h``
# itself, as the module does: every reader of ``h`` then gets the module's value and the
# tap's derivative (``h``'s gradient node becomes the copy's, which leads to the tap's).
# Several such taps on one module in one call (guided backprop and a layer there) share
# one frame per run (`InPlaceFrames`): the first hands the module a copy, each hook runs
# in its order, and the last writes back. Whether the module wrote its copy is read from
# the copy's version counters, not from ``inplace=True``: dropout in eval mode, or a
# module whose ``inplace`` means something else, writes nothing, and writing ``h`` would
# then break a backward that keeps ``h`` (the ReLU's before it). Only modules that say
# ``inplace=True`` are watched (and under ``torch.compile``, where versions are symbols,
# taken at their word). A rule's Function that keeps the module's input keeps a copy
# (``h`` may be written after). A leaf that requires grad (the attributed input itself)
# cannot be written in place: there the module runs on the copy, as before (plain
# autograd refuses such a model outright: `saliency` raises). LRP's rule taps write back
# on their own (a rule's hook runs first and its pre-hook last, so it nests inside the
# frame, its result written back into the copy the frame handed). A map at the input of a
# module of several positional inputs hands each a copy: a block may write any of them
# through an in-place module inside it, so each later input whose copy was written takes
# what was written too.

# NOTE [compiled containers that write their input]
# A map at a module's input hands the module a new tensor, so where a module inside it
# writes its input in place (``Sequential(ReLU(inplace=True), ...)``), the copy is written
# and ``h`` would not be. Eagerly the copy's versions say so, for any module. While
# ``torch.compile`` traces, versions are symbols it cannot compare, so the model's in-place
# modules are taken at their word: each of them (any in the model: a container may call one
# it is handed, not only its own) gets an observer, a pre-hook after the model's own, which
# marks the mapped module's frame where the input it is handed is that module's copy (or a
# view of it), as does a frame's write-back into that copy (a container in a container,
# each with a map at its input: the inner one writes back into the outer one's copy);
# only a marked frame writes back. Writing back unmarked would send what other readers of
# ``h`` pass back through the map too, and not writing back a marked one would leave
# ``h`` unwritten: wrong numbers either way. A write by a plain op in the container's own forward
# (``x.relu_()``), or an in-place module's ``forward`` called directly (no hook runs), is
# seen eagerly only.


def writes_in_place(module: Any) -> bool:
    """Whether ``module`` says it writes its input in place (``inplace=True``, as torch's activations).

    Dropout says so, and writes nothing, in eval mode or with ``p=0``.
    """
    if getattr(module, "inplace", False) is not True:
        return False
    return not isinstance(module, torch.nn.modules.dropout._DropoutNd) or (module.training and module.p != 0)


def _versions(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s version counters at every functorch level (a write bumps the wrapper's under grad, the inner's under
    vmap); none while compiling, where they are symbols Dynamo cannot compare: a module that says so writes."""
    if torch.compiler.is_compiling():
        return ()
    versions = [t._version]
    while torch._C._functorch.is_batchedtensor(t) or torch._C._functorch.is_gradtrackingtensor(t):
        t = torch._C._functorch.get_unwrapped(t)
        versions.append(t._version)
    return tuple(versions)


class Handed(NamedTuple):
    """A module's input, the copy it was handed instead, and the copy's versions then."""

    original: torch.Tensor
    copy: torch.Tensor
    versions: tuple[int, ...]


def handed(original: Any, copy: Any) -> Handed | None:
    """What `written_back` needs of a module handed ``copy`` in place of ``original``; ``None`` where it is moot."""
    if (not isinstance(original, torch.Tensor) or not isinstance(copy, torch.Tensor) or copy is original
            or (original.is_leaf and original.requires_grad)):
        return None
    return Handed(original, copy, _versions(copy))


def written_back(run: Handed | None, value: Any, result: Any = None) -> Any:
    """The module's input holding ``value``, where the module wrote its copy in place; else ``value``.

    NOTE [replaced derivatives of in-place modules]. ``result`` given (what goes on, where the
    input takes another value), it is returned instead. Where ``value`` is not shaped as the
    input, the input takes what the module wrote.
    """
    handed_on = value if result is None else result
    if run is None or (run.versions and _versions(run.copy) == run.versions):
        return handed_on
    original = run.original
    if isinstance(value, torch.Tensor) and value.shape == original.shape:
        original.copy_(value)
        return original if handed_on is value else handed_on
    original.copy_(run.copy)
    return handed_on


PreHook = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]  # (with the keyword arguments: a tap's)
Hook = Callable[[Any, tuple[Any, ...], Any], Any]


class _Copy:
    """An input of a module whose taps write back, the copy it was last handed, the copy's versions then, and
    (compiled) whether an observer saw the copy written (NOTE [compiled containers that write their input])."""

    __slots__ = ("inner", "marked", "original", "versions")

    def __init__(self, original: torch.Tensor | None):
        self.original = original
        self.inner: torch.Tensor | None = None
        self.versions: tuple[int, ...] = ()
        self.marked = False

    def hand(self, copy: torch.Tensor) -> None:
        self.inner, self.versions = copy, _versions(copy)

    def mark(self, t: torch.Tensor) -> None:
        """``t`` is written in place: where it is the copy (or a view of it), the copy was written."""
        if self.inner is not None and (t is self.inner or t._base is self.inner):
            self.marked = True

    def run(self) -> Handed:
        assert self.original is not None and self.inner is not None  # (asked before)
        return Handed(self.original, self.inner, self.versions)


class _Frame:
    """One run of a module whose taps write back: its input and the copy it was last handed, whether the module
    handed that copy on as its output (an in-place activation does; a hook of the model's may replace it), and its
    later positional inputs and their copies (a block may write any of its inputs through an in-place module inside
    it)."""

    __slots__ = ("first", "later", "returned", "watched")

    def __init__(self, original: torch.Tensor | None, watched: bool, later: tuple[Any, ...]):
        self.first = _Copy(original)
        # (by position: none where nothing can be written back)
        self.later = [_Copy(t) if isinstance(t, torch.Tensor) and not (t.is_leaf and t.requires_grad) else None
                      for t in later] if later else []  # (most modules take one input: on every call)
        self.returned = False
        # (compiled, a mapped module's: written only where an observer marks a copy,
        # NOTE [compiled containers that write their input])
        self.watched = watched

    def hand(self, copy: Any, later: tuple[Any, ...]) -> None:
        if isinstance(copy, torch.Tensor):
            self.first.hand(copy)
        for slot, given in zip(self.later, later, strict=False) if self.later else ():
            if slot is not None and isinstance(given, torch.Tensor) and given is not slot.original:
                slot.hand(given)

    def mark(self, t: torch.Tensor) -> None:
        if self.watched:
            for slot in (self.first, *self.later):
                if slot is not None:
                    slot.mark(t)

    def writes(self) -> bool:
        """Whether its first input may take what the module wrote (eagerly, where the copy's versions say so; a
        module that writes its input is taken at its word, compiled)."""
        return self.first.original is not None and self.first.inner is not None and (
            self.first.marked or not self.watched)

    def later_writes(self) -> list[_Copy]:
        """The later inputs that may take what the module wrote: eagerly, where the copies' versions say so; compiled,
        where an observer saw it (these are written by no module's word)."""
        return [slot for slot in self.later if slot is not None and slot.inner is not None and (
            slot.versions or slot.marked)]

    def written_back(self, result: Any) -> Any:
        """``result``, or the input holding it where the module wrote its copy and returned it; where it returned
        another tensor (a container, a hook's value), the input takes what the module wrote, and ``result`` goes on.
        Each later input takes what the module wrote in its copy."""
        for slot in self.later_writes() if self.later else ():
            written_back(slot.run(), slot.inner)
        if not self.writes():
            return result
        return written_back(self.first.run(), result if self.returned else self.first.inner, result)


class InPlaceFrames:
    """The taps of one call that write back, per module (`tap_hooks`): the first hands the module a copy, the
    last writes back, after every tap's own hook ran, in their order."""

    __slots__ = ("open", "watching", "writers")

    def __init__(self) -> None:
        self.writers: dict[int, int] = {}
        self.open: dict[int, list[_Frame]] = {}  # (a stack per module: a module may run inside itself)
        # (compiled: a map's frame is watched, so the model's in-place modules get `observe` as a pre-hook, which the
        # compiled path puts in after their own: NOTE [compiled containers that write their input])
        self.watching = False

    def observe(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """An observed in-place module's pre-hook: its input is written (`written`)."""
        self.written(first_input(module, args, kwargs)[0])

    def written(self, t: Any) -> None:
        """Marks the open watched frames whose copy ``t`` is, or is a view of: ``t`` is written in place."""
        if not isinstance(t, torch.Tensor):
            return
        for stack in self.open.values():
            for frame in stack:
                frame.mark(t)

    def join(self, module: Any) -> int:
        """This tap's place among ``module``'s writing taps of the call."""
        index = self.writers.get(id(module), 0)
        self.writers[id(module)] = index + 1
        return index


def _writing_back(pre: PreHook | None, post: Hook | None, frames: InPlaceFrames, module: Any, watched: bool = False,
                  ) -> tuple[PreHook, Hook]:
    """A tap's hooks on ``module``, which writes its input in place, keeping the model as it is (`Tap.writes_back`).

    ``pre`` (the tap's at the module's input) or ``post`` (at its output). The first writing tap of the module
    hands it a copy (``pre``'s, or one of its own); the last writes back
    (NOTE [replaced derivatives of in-place modules]).
    """
    key, index = id(module), frames.join(module)

    def before(m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        new = None if pre is None else pre(m, args, kwargs)
        if index == 0:
            x, name = first_input(m, args, kwargs)  # (passed by position, or by name: NOTE [a module's input])
            if not isinstance(x, torch.Tensor) or (x.is_leaf and x.requires_grad):
                x = None  # (a leaf that requires grad is written as the module writes it: torch raises)
            elif pre is None:
                new = with_first_input(args, kwargs, name, x.clone())
            frames.open.setdefault(key, []).append(_Frame(x, watched, args[1:] if name is None else ()))
        if new is not None:
            given, name = first_input(m, *new)
            frames.open[key][-1].hand(given, new[0][1:] if name is None else ())
        return new

    def after(m: Any, args: tuple[Any, ...], output: Any) -> Any:
        if index == 0:  # (the first writing tap's hook: the output as the module and the model's hooks left it)
            frame = frames.open[key][-1]
            frame.returned = output is frame.first.inner
        new = None if post is None else post(m, args, output)
        if index != frames.writers[key] - 1:
            return new
        frame = frames.open[key].pop()
        if frames.watching:  # (compiled: a write-back writes what another frame may have handed as a copy)
            for slot in frame.later_writes():
                frames.written(slot.original)
            if frame.writes():
                frames.written(frame.first.original)
        return frame.written_back(output if new is None else new)

    return before, after


Hooks = list[tuple[str, Callable[..., Any]]]


def tap_hooks(kind: str, hook: Callable[..., Any], is_map: bool, frames: InPlaceFrames, module: Any) -> Hooks:
    """A writing tap's ``hook`` (of the hook dict ``kind``) on ``module``, and the hook it pairs with where the
    module writes its input, or may (NOTE [replaced derivatives of in-place modules]); `hook`'s pair first."""
    watched = False  # (compiled: NOTE [compiled containers that write their input])
    if not writes_in_place(module):
        if not (is_map and kind == "_forward_pre_hooks"):
            return [(kind, hook)]
        # (a map at any module's input: a container whose first child writes its input says nothing)
        watched = torch.compiler.is_compiling()
        frames.watching |= watched
    if kind == "_forward_hooks":
        before, after = _writing_back(None, hook, frames, module)
        return [(kind, after), ("_forward_pre_hooks", before)]
    before, after = _writing_back(hook, None, frames, module, watched)
    return [(kind, before), ("_forward_hooks", after)]
