"""Sites: where in a model the latent methods read and edit activations."""

# NOTE [sites]
# A site is a submodule path plus, optionally, a selection of its activation:
#
# - ``element``: a module returning a tuple (attention modules of Hugging Face models
#   return ``(output, weights)``) is read and edited at one element, ``0`` by default;
#   the other elements pass through unchanged.
# - ``index``: a selection *within one sample* (the batch dim is never indexed): ints,
#   slices and at most one list of ints, one per dim after the batch dim, as in
#   ``activation[:, 3]`` for token position 3 of a ``[N, L, D]`` residual stream, or
#   ``(slice(None), [0, 5])`` for features 0 and 5 at every position. Edits write the
#   selection back out of place (``select_scatter``, ``slice_scatter``, ``index_copy``),
#   so they compose with ``vmap`` and ``grad``.
# - ``site``: the module's ``"output"`` (default) or its first ``"input"``, a positional
#   argument (a module called with keyword arguments only has none: read a submodule).
# - ``call``: the run of a module that runs more than once in one forward (``0`` the
#   first; negative counts from the end: ``-1`` is the last run, as hook libraries that
#   overwrite their cache see it). Without it such a module is an error.
#
# `sites` expands a regex over module names (as tdhook's ``key_pattern``) to sites.
# A site's ``key`` names its entry in results: its path as a name, the selection, then
# ``:input``, ``#element`` and ``@call`` where those are not the defaults
# (``"transformer.h.0.attn[:][0]:input@1"``).

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from .._paths import path_to_name
from .._taps import Tap, kept

__all__ = ["Index", "Site", "as_indices", "as_sites", "sites"]

Index = tuple[int | slice | Sequence[int], ...]


@dataclass(frozen=True)
class Site:
    """A place to read or edit an activation: a module's output or input, and a selection within it.

    Attributes:
        path (str): submodule path (`tdhook_fn.resolve_path`).
        index (tuple): selection within one sample; ``()`` is the whole activation.
        element (int): the element of a tuple output. Default: 0.
        site (str): ``"output"`` or ``"input"``. Default: ``"output"``.
        call (int | None): the run of a module that runs several times (``-1`` the last).
            Default: ``None``, the module must run once.
        key (str): the name of its entry in results. Default: from path and index.
    """

    path: str
    index: Index = ()
    element: int = 0
    site: Literal["output", "input"] = "output"
    call: int | None = None
    key: str = field(default="")

    def __post_init__(self) -> None:
        if not isinstance(self.path, str):
            raise TypeError(f"Site: path must be a str, got {type(self.path).__name__}")
        index = self.index if isinstance(self.index, tuple) else (self.index,)
        for part in index:
            ok = isinstance(part, slice) or (isinstance(part, int) and not isinstance(part, bool)) or (
                isinstance(part, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in part))
            if not ok:
                raise TypeError(f"Site {self.path!r}: index parts must be ints, slices or lists of ints, got {part!r}")
        object.__setattr__(self, "index", tuple(list(p) if isinstance(p, tuple) else p for p in index))
        if sum(isinstance(p, list) for p in self.index) > 1:
            raise ValueError(f"Site {self.path!r}: index {self.index!r} has more than one list; two lists are "
                             "ambiguous (indexing pairs them up, a block would take every combination): use one "
                             "list and slices, or one site per entry")
        if self.site not in ("output", "input"):
            raise ValueError(f"Site {self.path!r}: site must be 'output' or 'input', got {self.site!r}")
        if self.call is not None and (isinstance(self.call, bool) or not isinstance(self.call, int)):
            raise TypeError(f"Site {self.path!r}: call must be None or an int, got {self.call!r}")
        if not self.key:
            name = path_to_name(self.path) or "root"
            name += "".join(f"[{_show(p)}]" for p in self.index)
            name += ":input" if self.site == "input" else ""
            name += f"#{self.element}" if self.element else ""
            name += f"@{self.call}" if self.call is not None else ""
            object.__setattr__(self, "key", name)

    def read(self, value: Any) -> torch.Tensor:
        """The selected part of a module's output (or input) ``value``, batch dim first."""
        tensor = self.element_of(value)
        self.check_index(tensor)
        return tensor[(slice(None), *as_indices(self.index))] if self.index else tensor

    def write(self, value: Any, new: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        """``value`` with its selected part replaced by ``new(selected part)``, out of place."""
        tensor = self.element_of(value)
        self.check_index(tensor)
        return self.with_element(value, _put(tensor, 1, self.index, new))

    def with_element(self, value: Any, tensor: torch.Tensor) -> Any:
        """``value`` with the site's element (the value itself unless a tuple) replaced by ``tensor``."""
        if isinstance(value, tuple):
            at = self.element % len(value)  # element_of checked the range; -1 is the last
            return (*value[:at], tensor, *value[at + 1 :])
        return tensor

    def reader(self, store: Callable[[torch.Tensor], None]) -> Tap:
        """A tap handing the selected activation to ``store`` (for one call)."""
        def read(value: Any) -> Any:
            store(kept(self.read(value)))  # a copy: later modules may write the activation in place
            return None

        return Tap(self.path, "intervene", read, self.site, call=self._tap_call())

    def editor(self, new: Callable[[torch.Tensor], torch.Tensor]) -> Tap:
        """A tap replacing the selected activation by ``new(selected)``."""
        if self.call is not None and self.call < 0:
            raise ValueError(f"site {self.key!r}: an edit needs the run counted from the first (call={self.call}); "
                             "the latent methods resolve it with a probe forward (see resolve_runs)")
        return Tap(self.path, "intervene", lambda value: self.write(value, new), self.site, call=self.call)

    def check_index(self, tensor: torch.Tensor) -> None:
        """Raise ``IndexError`` naming the site unless its ``index`` fits ``tensor`` (batch dim first)."""
        dims = tensor.shape[1:]
        if len(self.index) > len(dims) or not all(map(_fits, self.index, dims)):
            raise IndexError(f"site {self.key!r}: index {self.index!r} does not fit the activation there, "
                             f"{tuple(dims)} per sample ({tuple(tensor.shape)} with the batch flattened); give "
                             "one int, slice or list of ints per dim after the batch dim, each within its size")

    def _tap_call(self) -> int | None:
        """The run a reading tap fires at: every run for a negative ``call`` (picked afterwards)."""
        return None if self.call is None or self.call < 0 else self.call

    def element_of(self, value: Any) -> torch.Tensor:
        """The tensor the site reads in a module's output (or input) ``value``."""
        if isinstance(value, tuple):
            if self.site == "input" and not value:  # the tap hands over the arguments (NOTE [a module's input])
                module = f"module {self.path!r}" if self.path else "model itself (the root module)"
                raise ValueError(f"site {self.key!r}: the {module} is called without arguments, so it has no "
                                 "input to read; read the output of a module that runs before it")
            if not -len(value) <= self.element < len(value):
                raise ValueError(f"site {self.key!r}: element {self.element} of a tuple of {len(value)}")
            value = value[self.element]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"site {self.key!r}: the activation is a {type(value).__name__}, not a tensor; pick a "
                            "tuple element with element= or another module")
        return value


def _show(part: Any) -> str:
    if isinstance(part, slice):
        return ":".join("" if v is None else str(v) for v in (part.start, part.stop)) + (
            f":{part.step}" if part.step is not None else "")
    return str(part)


def _fits(part: int | slice | Sequence[int], size: int) -> bool:
    """Whether an index part selects within a dim of ``size`` (a slice always does)."""
    if isinstance(part, slice):
        return True
    return all(-size <= i < size for i in ([part] if isinstance(part, int) else part))


def as_indices(index: Index) -> tuple[Any, ...]:
    """``index`` for tensor indexing (lists become index tensors)."""
    return tuple(torch.tensor(p) if isinstance(p, list) else p for p in index)


def _put(t: torch.Tensor, dim: int, index: Index, new: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``t`` with ``t[..., index]`` (from ``dim`` on) replaced by ``new`` of it, without writing ``t``."""
    if not index:
        return new(t)
    part, rest = index[0], index[1:]
    if isinstance(part, int):
        inner = _put(t.select(dim, part), dim, rest, new)
        return t.select_scatter(inner, dim, part)
    if isinstance(part, slice):
        start, stop, step = part.indices(t.shape[dim])
        inner = _put(t[(slice(None),) * dim + (part,)], dim + 1, rest, new)
        return t.slice_scatter(inner, dim, start, stop, step)
    size = t.shape[dim]  # Site.check_index checked the range
    idx = torch.tensor([i % size for i in part], device=t.device)  # negative entries count from the end
    inner = _put(t.index_select(dim, idx), dim + 1, rest, new)
    return t.index_copy(dim, idx, inner)


def sites(model: nn.Module, pattern: str, **options: Any) -> list[Site]:
    """Sites at every submodule whose name matches the regex ``pattern`` (``re.fullmatch``).

    Args:
        model (nn.Module): the model whose ``named_modules`` are matched.
        pattern (str): e.g. ``r"transformer\\.h\\.\\d+"`` for every GPT-2 block.
        **options: `Site` fields for all of them (``index``, ``element``, ...).

    Raises:
        ValueError: nothing matches (the error lists some names).

    Examples:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> [s.path for s in sites(net, r"\\d+")]
        ['0', '1', '2']
    """
    regex = re.compile(pattern)
    found = [Site(name, **options) for name, _ in model.named_modules() if name and regex.fullmatch(name)]
    if not found:
        names = [name for name, _ in model.named_modules() if name][:12]
        raise ValueError(f"sites: no module name matches {pattern!r} (names: {names} ...)")
    return found


def as_sites(value: Site | str | Sequence[Site | str], what: str) -> list[Site]:
    """Sites from a site, a path, or a sequence of them; the keys must be distinct."""
    items = [value] if isinstance(value, (Site, str)) else list(value)
    out = [item if isinstance(item, Site) else Site(item) if isinstance(item, str) else _bad(item, what)
           for item in items]
    if not out:
        raise ValueError(f"{what}: no sites given")
    keys = [s.key for s in out]
    if len(set(keys)) != len(keys):
        raise ValueError(f"{what}: two sites share a key: {sorted(k for k in keys if keys.count(k) > 1)}")
    return out


def _bad(item: Any, what: str) -> Site:
    raise TypeError(f"{what}: a site is a Site or a path string, got {type(item).__name__}")
