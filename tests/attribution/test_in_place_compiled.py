"""Compiled maps at the input of a container that writes its input through an in-place module inside it.

NOTE [compiled containers that write their input]: while torch.compile traces, versions
cannot be compared, so the in-place modules in a mapped container say whether it was
written. Each compiled map equals the eager one, which equals the twin model's (the same
model reading what the in-place module wrote, no in-place write).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from zoo import same, snapshot

from tdhook_fn import functional, map_grad, params
from tdhook_fn.attribution import guided_backprop, saliency

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

X = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _compiled(fn: Callable[[TensorDict], TensorDict], td: TensorDict) -> TensorDict:
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="eager")(td)


def _close(a: TensorDict, b: TensorDict) -> None:
    torch.testing.assert_close(a["x"], b["x"], rtol=1e-12, atol=1e-12)


class _Viewed(nn.Module):
    """An in-place ReLU on a view of its input, which writes the input through its base; the twin returns what the
    ReLU returned too."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.act, self.lin = nn.ReLU(inplace=inplace), nn.Linear(6, 3)
        self.twin = not inplace

    def forward(self, h: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        r = self.act(h.view(h.shape[0], 2, 3)).flatten(1)
        return (self.lin(r), r) if self.twin else self.lin(r)


class _Chain(nn.Module):
    """The twin of a container whose first module writes its input: ``rest(first(h))``, and ``first(h)``."""

    def __init__(self, first: nn.Module, rest: nn.Module) -> None:
        super().__init__()
        self.first, self.rest = first, rest

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.first(h)
        return self.rest(r), r


class _InnerWrites(nn.Module):
    """An in-place ReLU that writes a tensor the block makes, never the block's input (a ResNet block's way)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act, self.out = nn.Linear(6, 6), nn.ReLU(inplace=True), nn.Linear(6, 3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.lin(h)))


# each block written (``True``: its input written in place) and as its twin, parameters in the same order
BLOCKS: dict[str, Callable[[bool], nn.Module]] = {
    "sequential": lambda written: (nn.Sequential(nn.ReLU(inplace=True), nn.Linear(6, 3)) if written
                                   else _Chain(nn.ReLU(), nn.Linear(6, 3))),
    "nested": lambda written: (nn.Sequential(nn.Sequential(nn.ReLU(inplace=True)), nn.Linear(6, 3)) if written
                               else _Chain(nn.Sequential(nn.ReLU()), nn.Linear(6, 3))),
    "view": lambda written: _Viewed(inplace=written),
    "inner_writes": lambda written: _InnerWrites(),
}


class Rereads(nn.Module):
    """``block(h) + other(h)``; in the twin ``other`` reads what the block's ReLU returned, which the written ``h``
    holds."""

    def __init__(self, kind: str, written: bool):
        super().__init__()
        self.a, self.other = nn.Linear(4, 6), nn.Linear(6, 3)
        self.block = BLOCKS[kind](written)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        out = self.block(h)
        if isinstance(out, tuple):
            y, r = out
            return y + self.other(r)
        return out + self.other(h)


def _twins(kind: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    written, twin = Rereads(kind, True).double(), Rereads(kind, False).double()
    with torch.no_grad():
        for mine, theirs in zip(written.parameters(), twin.parameters(), strict=True):
            theirs.copy_(mine)
    return written, twin


def _pure(model: nn.Module):
    return functional(model, in_keys=["x"], out_keys=["y"]), params(model)


@pytest.mark.parametrize("kind", list(BLOCKS))
@pytest.mark.parametrize("skip", ((), (nn.Linear,)), ids=("every_module", "skipping_linear"))
def test_compiled_guided_backprop_through_a_container_is_the_twin_s(kind, skip):
    written, twin = _twins(kind)
    td = TensorDict(x=X, batch_size=[5])
    (f, p), before = _pure(written), snapshot(written)
    compiled = _compiled(lambda s: guided_backprop(f, p, s, target=1, classes_to_skip=skip), td)
    eager = guided_backprop(f, p, td, target=1, classes_to_skip=skip)
    _close(compiled, eager)
    _close(eager, guided_backprop(*_pure(twin), td, target=1, classes_to_skip=skip))
    assert same(before, snapshot(written))


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_compiled_map_at_a_container_s_input_is_the_eager_one(kind):
    written, twin = _twins(kind)
    td = TensorDict(x=X, batch_size=[5])
    tap = map_grad("block", lambda g: -3 * g, site="input")
    f, p = _pure(written)
    compiled = _compiled(lambda s: saliency(f, p, s, target=1, taps=[tap]), td)
    eager = saliency(f, p, td, target=1, taps=[tap])
    _close(compiled, eager)
    ft, pt = _pure(twin)
    _close(eager, saliency(ft, pt, td, target=1, taps=[tap]))


def test_an_identity_map_keeps_the_gradient_compiled():
    """Where the container writes ``h`` the identity map is the gradient, and where it does not, too."""
    for kind in BLOCKS:
        written, _ = _twins(kind)
        td = TensorDict(x=X, batch_size=[5])
        f, p = _pure(written)
        tap = map_grad("block", lambda g: g, site="input")
        _close(_compiled(lambda s: saliency(f, p, s, target=1, taps=[tap]), td), saliency(f, p, td, target=1))


class _Handed(nn.Module):
    """A container handed the in-place module it calls (not its own submodule)."""

    def __init__(self, twin: bool):
        super().__init__()
        self.lin, self.twin = nn.Linear(6, 3), twin

    def forward(self, h: torch.Tensor, act: nn.Module) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        r = act(h)
        return (self.lin(r), r) if self.twin else self.lin(r)


class _HandsItsReLU(nn.Module):
    def __init__(self, twin: bool):
        super().__init__()
        self.a, self.other, self.block = nn.Linear(4, 6), nn.Linear(6, 3), _Handed(twin)
        self.act, self.twin = nn.ReLU(inplace=not twin), twin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.twin:
            y, r = self.block(h, self.act)
            return y + self.other(r)
        return self.block(h, self.act) + self.other(h)


@pytest.mark.parametrize("method", ["map_grad", "guided_backprop"])
def test_compiled_container_calling_an_in_place_module_it_is_handed(method):
    """The in-place module is the root's, not the container's: it is observed all the same."""
    torch.manual_seed(0)
    written, twin = _HandsItsReLU(False).double(), _HandsItsReLU(True).double()
    twin.load_state_dict(written.state_dict())
    td = TensorDict(x=X, batch_size=[5])
    tap = map_grad("block", lambda g: -3 * g, site="input")

    def run(f, p, s):
        return saliency(f, p, s, target=1, taps=[tap]) if method == "map_grad" else guided_backprop(f, p, s, target=1)

    f, p = _pure(written)
    eager = run(f, p, td)
    _close(_compiled(lambda s: run(f, p, s), td), eager)
    _close(eager, run(*_pure(twin), td))
