"""Taps attached to a call's shadow modules for one call, and the checks on them: keys, and taps that never ran."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from ._in_place import InPlaceFrames
from ._taps import Captured, Tap, attaches_itself, register_hook

__all__ = ["attached", "check_tap_keys"]


# NOTE [taps that never fire]
# A tap on a submodule that the forward never calls does nothing: an intervention changes
# nothing, a capture reads nothing, and the results look plausible. So each call counts how
# often the hook of each ``must_run`` tap ran, and after the forward raises for a tap whose
# submodule never ran (or ran fewer times than its ``call`` needs), naming its
# path, as the latent methods refuse a site that never ran. A submodule skipped in some
# branch of the forward is refused too on the calls that skip it: tap one that runs on
# every call, or build the taps per call. Two captures under one key would keep one
# silently, and a capture keyed like an output of the function would replace that output
# (``check_tap_keys``). Not counted under ``torch.compile``: the traced path adds no hooks.


def check_tap_keys(taps: Sequence[Tap], reserved: Collection[Any] = (), where: str = "taps") -> None:
    """Raise where two captures share a key, or a capture's key is ``reserved`` (the outputs' keys).

    Args:
        taps (Sequence[Tap]): the taps of one call.
        reserved (Collection): keys the captures may not take (a function's ``out_keys``).
            Default: none.
        where (str): what the taps belong to, for the message. Default: ``"taps"``.

    Raises:
        ValueError: naming the key and the paths of the captures.
    """
    owners: dict[str, list[str]] = {}
    for tap in taps:
        if tap.kind == "capture":
            owners.setdefault(tap.key, []).append(tap.path)
    taken = {key[0] if isinstance(key, tuple) and key else key for key in reserved}  # (a nested key: its first part)
    for key, paths in owners.items():
        if key in taken:
            raise ValueError(f"{where}: capture({paths[0]!r}) stores under key {key!r}, which holds an output of the "
                             f"function (out_keys {list(reserved)}): it would replace that output; give the capture "
                             "another key (capture(path, key=...))")
        if len(paths) > 1:
            raise ValueError(f"{where}: {len(paths)} captures store under one key {key!r} (paths {paths}); one would "
                             "replace the other: give each its own key (capture(path, key=...))")


def attached(taps: Sequence[Tap], modules: Sequence[nn.Module], captured: Captured) -> _Attached:
    """``taps`` attached to their shadow ``modules`` for one call (a context manager).

    Everything registered is removed on the way out, also when the call raises; when it
    returns, a ``must_run`` tap whose submodule did not run (at its ``call``) raises
    (NOTE [taps that never fire]).

    Raises:
        ValueError: two captures share a key, or a ``must_run`` tap never fired (its path named).
    """
    return _Attached(taps, modules, captured)


class _Attached:
    """What `attached` returns: a class, not a generator, as it runs on every call."""

    __slots__ = ("captured", "handles", "modules", "runs", "taps")

    def __init__(self, taps: Sequence[Tap], modules: Sequence[nn.Module], captured: Captured):
        self.taps, self.modules, self.captured = taps, modules, captured
        self.handles: list[RemovableHandle] = []
        self.runs: list[list[int]] = []

    def __enter__(self) -> None:
        if not self.taps:
            return
        check_tap_keys(self.taps)
        frames = InPlaceFrames()  # (the call's: taps on one module that write back share it)
        try:
            for tap, module in zip(self.taps, self.modules, strict=True):
                # a must_run tap counts its hook's runs; a subclass's own attach is left as it is
                if attaches_itself(tap):
                    self.handles.append(tap.attach(module, self.captured))
                    continue
                (kind, hook), *more = tap.hooks(self.captured, module, frames)
                if tap.must_run:
                    self.runs.append(count := [0])
                    hook = _counted(hook, count)
                self.handles.append(register_hook(module, kind, hook))
                self.handles += [register_hook(module, kind, hook) for kind, hook in more]
        except BaseException:
            self._remove()
            raise

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: Any) -> None:
        self._remove()
        if kind is not None or not self.runs:
            return
        counts = iter(self.runs)
        for tap in self.taps:
            if tap.must_run and not attaches_itself(tap):
                _check_fired(tap, next(counts)[0])

    def _remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _counted(hook: Callable[..., Any], count: list[int]) -> Callable[..., Any]:
    def counted(*args: Any) -> Any:
        count[0] += 1
        return hook(*args)

    return counted


def _check_fired(tap: Tap, runs: int) -> None:
    what = f"{tap.kind}({tap.path!r}{'' if tap.site == 'output' else ', site=' + repr(tap.site)})"
    if runs == 0:
        raise ValueError(f"{what} never ran: the forward never called module {tap.path!r}, so the tap did nothing; "
                         "tap a module the forward calls (a module skipped in some branch of the forward is "
                         "refused on the calls that skip it: tap it only on the calls that run it)")
    if tap.call is not None and runs <= tap.call:
        times = "once" if runs == 1 else f"{runs} times"
        raise ValueError(f"{what} acts at call={tap.call}, but the forward ran module {tap.path!r} {times}, so the "
                         f"tap did nothing; give a call below {runs}")
