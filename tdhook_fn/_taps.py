"""Taps: read, replace or re-route the gradient of an activation during one call.

A tap names a submodule by path and a site, its ``"output"`` or its ``"input"`` (the
first positional argument of its forward; ``fn`` sees all of them when there are
several). Taps are given to `tdhook_fn.call_with_taps` or to a
`tdhook_fn.Functional`, and exist only for that call, on the call's private
shadow of the model (see NOTE [shadow modules]), so other calls, in this thread or
others, never see them.
"""

# NOTE [layer gradients]
# The gradient of a target with respect to an activation is the gradient with respect to
# an additive zero perturbation of it: ``perturb(path, delta)`` with ``delta = zeros``
# turns layer attribution into a plain ``torch.func.grad`` with respect to ``delta``,
# under any transform.

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import optree
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._in_place import InPlaceFrames, tap_hooks
from ._mapped_gradient import mapped_gradient
from ._module_input import input_name, keyword_input_error, with_first_input
from ._paths import path_to_name

__all__ = [
    "Captured",
    "Handles",
    "Side",
    "Tap",
    "attaches_itself",
    "capture",
    "intervene",
    "kept",
    "map_grad",
    "perturb",
    "register_hook",
]

Side = Literal["output", "input"]  # which side of a module a tap reads or writes
Captured = dict[str, Any]


@dataclass(frozen=True)
class Tap:
    """What to do with the activation at ``path``.

    Build taps with `capture`, `intervene`, `perturb` and
    `map_grad`. A subclass with ``kind="custom"`` overrides `attach` to register
    any hook on the call's private shadow module (the compat layer does).

    Attributes:
        path (str): submodule path (see `tdhook_fn.resolve_path`).
        kind (str): ``"capture"``, ``"intervene"``, ``"map_grad"`` or ``"custom"``.
        fn (Callable | None): applied to the value (``capture``, ``intervene``) or to the
            gradient flowing through it (``map_grad``).
        site (str): ``"output"`` or ``"input"`` of the submodule (its positional arguments; where
            a call passes none, the argument its forward's first parameter gets by name).
        key (str): where a capture is stored. Default: a name derived from the path.
        call (int | None): for a submodule that runs more than once in one forward, act
            only at its ``call``-th run (0 is the first). Default: ``None``, every run
            (a capture then keeps the last).
        must_run (bool): raise after the call when the forward never ran the submodule (or
            ran it ``call`` times or fewer), since the tap then did nothing. `capture`,
            `intervene`, `perturb` and `map_grad` set it. Default: ``False`` (the methods' own taps, which check
            their runs themselves or tap every submodule, such as guided backpropagation's).
        replaces_derivative (bool): the tap stands in for the module's derivative (a `map_grad`,
            a method's backward rule), so the attribution maps of a call using it are not
            differentiable (see the guided backpropagation page). Default: ``True`` for
            ``map_grad`` taps, else ``False``.
        writes_back (bool): on a module that writes its input in place (``inplace=True``), the
            module runs on a copy and what the tap hands on is written back into that input,
            which the model may read again: the tap acts on the activation every reader sees
            (a `map_grad`; a layer's perturbation, whose gradient is the layer's; see the
            concepts page). Default: ``True`` for ``map_grad`` taps, else ``False`` (an
            intervention replaces what the module returns, as a forward hook does).
    """

    path: str
    kind: Literal["capture", "intervene", "map_grad", "custom"]
    fn: Callable[[Any], Any] | None = None
    site: Side = "output"
    key: str = field(default="")
    call: int | None = None
    must_run: bool = False
    replaces_derivative: bool = False
    writes_back: bool = False

    def __post_init__(self) -> None:
        if self.kind == "map_grad":
            object.__setattr__(self, "replaces_derivative", True)
            object.__setattr__(self, "writes_back", True)
        if self.site not in ("output", "input"):
            raise ValueError(f"tap site must be 'output' or 'input', got {self.site!r}")
        if self.call is not None and (isinstance(self.call, bool) or not isinstance(self.call, int) or self.call < 0):
            raise ValueError(f"tap call must be None or an int >= 0, got {self.call!r}")
        if not self.key:
            object.__setattr__(self, "key", path_to_name(self.path) or "root")

    def attach(self, module: nn.Module, captured: Captured) -> RemovableHandle:
        """Register this tap on ``module`` (a private shadow) for one call.

        Args:
            module (nn.Module): the shadow of the submodule at ``path``.
            captured (dict): this call's captures; store values under ``key``.

        Returns:
            RemovableHandle: removed when the call ends, also when it raises.
        """
        handles = [register_hook(module, kind, hook) for kind, hook in self.hooks(captured, module, InPlaceFrames())]
        return handles[0] if len(handles) == 1 else cast(RemovableHandle, Handles(*handles))

    def hooks(self, captured: Captured, module: nn.Module,
              frames: InPlaceFrames) -> list[tuple[str, Callable[..., Any]]]:
        """`hook` for ``module``, and where it writes back, a second one.

        (NOTE [replaced derivatives of in-place modules])

        Args:
            frames (InPlaceFrames): the call's taps that write back, shared by all its taps.

        Returns:
            list[tuple[str, Callable]]: `hook`'s pair first.
        """
        kind, hook = self.hook(captured)
        return tap_hooks(kind, hook, self.kind == "map_grad", frames, module) if self.writes_back else [(kind, hook)]

    def hook(self, captured: Captured) -> tuple[str, Callable[..., Any]]:
        """This tap's forward hook and the module hook dict it belongs in.

        Returns:
            tuple[str, Callable]: ``"_forward_hooks"`` or ``"_forward_pre_hooks"`` (a hook
            that takes the keyword arguments too: NOTE [a module's input]), and the hook (the
            first of `hooks`, which a call registers, or, compiled, puts in the dict itself).
        """
        transform = self._transform(captured)
        if self.call is not None:
            transform = _at_run(transform, self.call)
        if self.site == "output":
            def output_hook(_m: nn.Module, _args: Any, output: Any) -> Any:
                return transform(output)

            return "_forward_hooks", output_hook

        path = self.path

        def input_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if not args and kwargs:  # (its input passed by name: NOTE [a module's input])
                name = input_name(module, kwargs)
                if name is None:
                    raise keyword_input_error(path, kwargs)
                new = transform(kwargs[name])
                return None if new is None else with_first_input(args, kwargs, name, new)
            if len(args) != 1:  # fn sees (and returns) all positional arguments
                new = transform(args)
                return None if new is None else (tuple(new), kwargs)
            new = transform(args[0])
            return None if new is None else ((new,), kwargs)

        return "_forward_pre_hooks", input_hook

    def _transform(self, captured: Captured) -> Callable[[Any], Any]:
        fn, key = self.fn, self.key
        if self.kind == "capture":
            def store(value: Any) -> None:
                captured[key] = kept(value if fn is None else fn(value))

            return store
        if self.kind == "intervene":
            assert fn is not None
            return fn
        if self.kind == "custom":
            raise NotImplementedError("a custom tap overrides attach")
        assert fn is not None

        def mapped(value: Any) -> Any:
            if isinstance(value, torch.Tensor):  # (the common case, one tensor: no tree walk)
                return mapped_gradient(value, fn)
            return optree.tree_map(lambda t: mapped_gradient(t, fn), value)

        return mapped


def attaches_itself(tap: Tap) -> bool:
    """Whether ``tap`` attaches itself (a custom tap, or a subclass's own ``attach``): then it is handed the
    shadow module, which it may read (its class, say); the built-in kinds hand their functions values only."""
    return type(tap).attach is not Tap.attach


def kept(value: Any) -> Any:
    """``value`` with its tensors copied, to keep what a tap read.

    A later module or op may write the activation in place (``ReLU(inplace=True)`` after a
    conv, ``out += identity`` in a ResNet block); a reference would then show the written
    values, silently. Under ``torch.compile`` the copies that nothing writes are free.
    """
    if type(value) is torch.Tensor:  # (the common capture, one tensor: no tree to walk, on every call)
        return value.clone()
    return optree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, value, none_is_leaf=True)


def _at_run(transform: Callable[[Any], Any], index: int) -> Callable[[Any], Any]:
    """``transform`` applied at the ``index``-th run of the module in this call only."""
    runs = 0

    def at_run(value: Any) -> Any:
        nonlocal runs
        runs += 1
        return transform(value) if runs == index + 1 else None

    return at_run


def capture(
    path: str, *, site: Side = "output", key: str = "", fn: Callable[[Any], Any] | None = None,
    call: int | None = None,
) -> Tap:
    """Read the activation at ``path``: its value (or ``fn(value)``) is returned under ``key``.

    Args:
        path (str): submodule path (see `tdhook_fn.resolve_path`).
        site (str): ``"output"`` or ``"input"`` of the submodule. Default: ``"output"``.
        key (str): where the value is stored. Default: a name derived from the path
            (`tdhook_fn.path_to_name`).
        fn (Callable | None): applied to the value before it is stored. Default: ``None``, the value.
        call (int | None): for a submodule that runs more than once in one forward, read only its
            ``call``-th run (0 is the first). Default: ``None``, every run (the last is kept).

    Examples:
        >>> import torch, tdhook_fn
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU())
        >>> out, seen = tdhook_fn.call_with_taps(net, tdhook_fn.params(net), [capture("[0]")],
        ...                                      torch.ones(2))
        >>> seen["0"].shape
        torch.Size([3])
    """
    return Tap(path, "capture", fn, site, key, call, must_run=True)


def intervene(path: str, fn: Callable[[Any], Any], *, site: Side = "output", call: int | None = None) -> Tap:
    """Replace the activation at ``path`` by ``fn(activation)`` (at every run, or at run ``call``).

    Args:
        path (str): submodule path (see `tdhook_fn.resolve_path`).
        fn (Callable): ``activation -> new activation``.
        site (str): ``"output"`` or ``"input"`` of the submodule. Default: ``"output"``.
        call (int | None): for a submodule that runs more than once in one forward, act only at
            its ``call``-th run (0 is the first). Default: ``None``, every run.
    """
    return Tap(path, "intervene", fn, site, call=call, must_run=True)


def perturb(path: str, delta: torch.Tensor, *, site: Side = "output", call: int | None = None) -> Tap:
    """Add ``delta`` to the activation at ``path`` (a zero ``delta`` makes its gradient the layer's).

    Args:
        path (str): submodule path (see `tdhook_fn.resolve_path`).
        delta (Tensor): added to the activation (broadcast to its shape).
        site (str): ``"output"`` or ``"input"`` of the submodule. Default: ``"output"``.
        call (int | None): for a submodule that runs more than once in one forward, act only at
            its ``call``-th run (0 is the first). Default: ``None``, every run.
    """
    return Tap(path, "intervene", lambda value: value + delta, site, call=call, must_run=True)


def map_grad(path: str, fn: Callable[[torch.Tensor], torch.Tensor], *, site: Side = "output") -> Tap:
    """Replace the gradient flowing through the activation at ``path`` by ``fn(gradient)``.

    With ``site="output"`` this changes the gradient arriving at the module's output
    (tdhook's ``bwd_pre`` direction); with ``site="input"`` the gradient leaving the module
    through its input (tdhook's ``bwd``). The forward value is unchanged. ``fn`` must be a
    pure tensor function (it runs under ``vmap`` inside transforms). A first derivative
    through it is the modified one; a second is not the derivative of the modified
    gradient (``fn`` stands in on the value path too), so the attribution methods refuse
    to differentiate maps computed with it.

    Args:
        path (str): submodule path (see `tdhook_fn.resolve_path`).
        fn (Callable[[Tensor], Tensor]): ``gradient -> new gradient``, a pure tensor function.
        site (str): ``"output"`` or ``"input"`` of the submodule. Default: ``"output"``.
    """
    return Tap(path, "map_grad", fn, site, must_run=True)


class Handles:
    """Several hook handles removed as one."""

    def __init__(self, *handles: RemovableHandle):
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def register_hook(module: nn.Module, kind: str, hook: Callable[..., Any]) -> RemovableHandle:
    """``hook`` registered on ``module`` in the hook dict ``kind`` (`Tap.hook`'s)."""
    if kind == "_forward_hooks":
        return module.register_forward_hook(hook)
    return module.register_forward_pre_hook(hook, with_kwargs=True)  # (every tap's: NOTE [a module's input])
