"""In-place writes the write-back missed (NOTE [replaced derivatives of in-place modules]).

A container whose first child writes its input (guided backprop taps every submodule;
compiled: ``test_in_place_compiled.py``), a hook of the model's that replaces an in-place
module's output (deconvolution refuses it), and dropout that says ``inplace=True`` and
writes nothing, under torch.compile.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from attr_zoo import DropoutAfterReLU
from tensordict import TensorDict
from torch import nn
from zoo import same, snapshot

from tdhook_fn import call_with_taps, functional, map_grad, params
from tdhook_fn.attribution import deconvolution, guided_backprop, saliency

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _inputs() -> TensorDict:
    return TensorDict(x=torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)),
                      batch_size=[5])


def _close(a: TensorDict, b: TensorDict) -> None:
    for key in b.keys(True, True):
        torch.testing.assert_close(a[key], b[key], rtol=1e-12, atol=1e-12, msg=str(key))


def _pure(model: nn.Module) -> tuple[Callable, TensorDict]:
    return functional(model, in_keys=["x"], out_keys=["y"]), params(model)


class _Block(nn.Module):
    """``lin(relu(x))``; the twin also returns ``relu(x)``, which its model reads."""

    def __init__(self, inplace: bool):
        super().__init__()
        self.body = nn.Sequential(nn.ReLU(inplace=inplace), nn.Linear(6, 3))
        self.twin = not inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        r = self.body[0](x)
        return (self.body[1](r), r) if self.twin else self.body[1](r)


class _ContainerRereads(nn.Module):
    """``block(h)`` writes ``h`` (its first child is in place, the block says nothing); ``other`` reads ``h``."""

    def __init__(self, inplace: bool, sequential: bool = False):
        super().__init__()
        self.a, self.other = nn.Linear(4, 6), nn.Linear(6, 3)
        self.block: nn.Module = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(6, 3)) if sequential else _Block(inplace)
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.inplace:
            y = self.block(h)
            return y + self.other(h)
        y, r = self.block(h)
        return y + self.other(r)


def _container_twins() -> list[nn.Module]:
    torch.manual_seed(0)
    written, twin = _ContainerRereads(True).double(), _ContainerRereads(False).double()
    twin.load_state_dict(written.state_dict())
    return [written, twin]


@pytest.mark.parametrize("site", ("input", "output"))
def test_an_identity_map_grad_on_a_container_that_writes_its_input_is_the_gradient(site):
    """The container gets a copy (the map's) and writes it; ``other(h)`` read ``h`` unwritten."""
    torch.manual_seed(0)
    model = _ContainerRereads(True, sequential=True).double()
    (f, p), td, x = _pure(model), _inputs(), _inputs()["x"]
    tap = map_grad("block", lambda g: g, site=site)
    torch.testing.assert_close(call_with_taps(model, p, [tap], x)[0], model(x), rtol=0, atol=0)
    _close(saliency(f, p, td, target=1, taps=[tap]), saliency(f, p, td, target=1))


@pytest.mark.parametrize("skip", ((), (nn.Linear,)), ids=("every_module", "skipping_linear"))
def test_guided_backprop_through_a_container_that_writes_its_input(skip):
    written, twin = _container_twins()
    td = _inputs()
    before, x = snapshot(written), td["x"].clone()
    _close(guided_backprop(*_pure(written), td, target=1, classes_to_skip=skip),
           guided_backprop(*_pure(twin), td, target=1, classes_to_skip=skip))
    assert same(before, snapshot(written)) and torch.equal(td["x"], x)


def test_guided_backprop_through_a_container_under_vmap():
    written, twin = _container_twins()
    td = _inputs()
    f, p = _pure(written)
    _close(torch.func.vmap(lambda s: guided_backprop(f, p, s, target=1))(td),
           guided_backprop(*_pure(twin), td, target=1))


class _SubclassedReLU(nn.ReLU):
    """Deconvolution runs it (no stand-in)."""


class _HookedRereads(nn.Module):
    """A hook of the model's doubles the in-place ReLU's output; ``other`` reads the written ``h``, ``relu(h)``."""

    def __init__(self, inplace: bool, act: type[nn.Module] = nn.ReLU):
        super().__init__()
        self.a, self.act = nn.Linear(4, 6), act(inplace=inplace)
        self.head, self.other = nn.Linear(6, 3), nn.Linear(6, 3)
        self.act.register_forward_hook(lambda _m, _i, o: o * 2)
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        y = self.act(h)
        return self.head(y) + self.other(h if self.inplace else y / 2)


@pytest.mark.parametrize("site", ("input", "output"))
def test_a_hook_that_replaces_the_output_leaves_the_written_input_as_the_module_wrote_it(site):
    """The write-back wrote the hook's ``2 * relu(h)`` into ``h``."""
    torch.manual_seed(0)
    model = _HookedRereads(True).double()
    (f, p), td, x = _pure(model), _inputs(), _inputs()["x"]
    tap = map_grad("act", lambda g: g, site=site)
    torch.testing.assert_close(call_with_taps(model, p, [tap], x)[0], model(x), rtol=0, atol=0)
    _close(saliency(f, p, td, target=1, taps=[tap]), saliency(f, p, td, target=1))


@pytest.mark.parametrize("act", (nn.ReLU, _SubclassedReLU), ids=lambda a: a.__name__)
@pytest.mark.parametrize("name", ("guided_backprop", "map_grad_at_its_input"))
def test_a_hook_that_replaces_the_output_against_the_twin(name, act):
    torch.manual_seed(0)
    written, twin = _HookedRereads(True, act).double(), _HookedRereads(False, act).double()
    twin.load_state_dict(written.state_dict())
    td = _inputs()
    method = {"guided_backprop": lambda f, p: guided_backprop(f, p, td, target=1),
              "map_grad_at_its_input": lambda f, p: saliency(f, p, td, target=1, taps=[
                  map_grad("act", lambda g: 2 * g.clamp(min=0), site="input")])}[name]
    _close(method(*_pure(written)), method(*_pure(twin)))


@pytest.mark.parametrize("act", (nn.ReLU, _SubclassedReLU), ids=lambda a: a.__name__)
def test_deconvolution_of_an_in_place_relu_whose_output_a_hook_replaces_raises(act):
    """``h`` took the hook's ``2 * relu(h)``; what the ReLU wrote has no deconvnet rule to give ``h``'s readers."""
    torch.manual_seed(0)
    model = _HookedRereads(True, act).double()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"^deconvolution: ReLU module 'act' .* writes its input in place"):
        deconvolution(*_pure(model), _inputs(), target=1)
    assert same(before, snapshot(model))


@pytest.mark.parametrize("site", ("input", "output"))
def test_compiled_map_grad_on_eval_dropout_that_says_inplace(site):
    """Compiled, the module was taken at its word and ``h`` written: the ReLU's backward raised."""
    torch.manual_seed(0)
    written, twin = DropoutAfterReLU(True).double().eval(), DropoutAfterReLU(False).double().eval()
    twin.load_state_dict(written.state_dict())
    td = _inputs()

    def method(f: Callable, p: TensorDict, td: TensorDict) -> TensorDict:
        return saliency(f, p, td, target=1, taps=[map_grad("drop", lambda g: 2 * g.clamp(min=0), site=site)])

    f, p = _pure(written)
    compiled = torch.compile(lambda p, td: method(f, p, td), fullgraph=True, backend="eager")
    _close(compiled(p, td), method(*_pure(twin), td))


class _Two(nn.Module):
    """A block of two inputs whose in-place ReLU writes the second; the twin returns what the ReLU returned too."""

    def __init__(self, twin: bool):
        super().__init__()
        self.act, self.lin, self.twin = nn.ReLU(inplace=not twin), nn.Linear(6, 3), twin

    def forward(self, h: torch.Tensor, z: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        r = self.act(z)
        return (self.lin(h + r), r) if self.twin else self.lin(h + r)


class _SecondInputRereads(nn.Module):
    """``block(h, z) + other(z)``: the block writes ``z``, which ``other`` reads (the twin: what the ReLU returned)."""

    def __init__(self, twin: bool):
        super().__init__()
        self.a, self.b, self.other, self.block = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3), _Two(twin)
        self.twin = twin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, z = self.a(x), self.b(x)
        if self.twin:
            y, r = self.block(h, z)
            return y + self.other(r)
        return self.block(h, z) + self.other(z)


def _second_input_twins() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    written, twin = _SecondInputRereads(False).double(), _SecondInputRereads(True).double()
    twin.load_state_dict(written.state_dict())
    return written, twin


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_map_at_a_block_that_writes_its_second_input(compiled):
    """The map hands each input a copy; the block wrote the second one's, so ``z`` takes it (``other(z)`` read ``z``
    unwritten: an identity map moved saliency by 0.375, guided backprop was 0.206 off the twin)."""
    written, twin = _second_input_twins()
    td = _inputs()
    (f, p), (ft, pt) = _pure(written), _pure(twin)
    identity, scaled = map_grad("block", lambda g: g, site="input"), map_grad("block", lambda g: -3 * g, site="input")
    calls = {
        "identity": lambda f, p, s: saliency(f, p, s, target=1, taps=[identity]),
        "scaled": lambda f, p, s: saliency(f, p, s, target=1, taps=[scaled]),
        "guided": lambda f, p, s: guided_backprop(f, p, s, target=1),
    }
    expected = {"identity": saliency(ft, pt, td, target=1), "scaled": calls["scaled"](ft, pt, td),
                "guided": calls["guided"](ft, pt, td)}
    before = snapshot(written)
    for name, call in calls.items():
        if compiled:
            torch._dynamo.reset()
            got = torch.compile(lambda s, call=call: call(f, p, s), fullgraph=True, backend="eager")(td)
        else:
            got = call(f, p, td)
        _close(got, expected[name])
    assert same(before, snapshot(written))
