"""Tiny seeded models for the attribution tests, with what captum needs to run them.

Each entry is an :class:`Entry`: the model (eval mode), how to build inputs for any batch
shape, a ``Functional`` over it, and the layer paths the tests attribute (with the module
captum needs for the same layer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from _tolerance import assert_close_ulps
from tensordict import TensorDict
from torch import nn

import tdhook_fn

T = TypeVar("T")

DTYPES = (torch.float32, torch.float64)


class TwoInput(nn.Module):
    """``head(relu(a(x) + b(y)))``: captum takes ``(x, y)``, tdhook_fn keys ``x`` and ``y``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(3, 6)
        self.act = nn.ReLU()
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.a(x) + self.b(y)))


class TransformerHead(nn.Module):
    """One ``TransformerEncoderLayer`` (batch first, no dropout), mean over tokens, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))


@dataclass
class Entry:
    name: str
    model: nn.Module
    in_keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]  # one sample's shape per input key
    n_classes: int
    layers: dict[str, nn.Module] = field(default_factory=dict)  # path -> module (for captum)
    conv_layers: dict[str, nn.Module] = field(default_factory=dict)  # path -> module with [C, *spatial] output
    dtype: torch.dtype = torch.float32

    @property
    def f(self) -> tdhook_fn.Functional:
        return tdhook_fn.functional(self.model, list(self.in_keys), ["output"])

    @property
    def params(self) -> TensorDict:
        return tdhook_fn.params(self.model)

    def tensors(self, batch: tuple[int, ...], seed: int = 1) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return tuple(torch.randn(*batch, *s, generator=g, dtype=torch.float64).to(self.dtype) for s in self.shapes)

    def inputs(self, batch: tuple[int, ...], seed: int = 1) -> TensorDict:
        return TensorDict(dict(zip(self.in_keys, self.tensors(batch, seed))), batch_size=list(batch))

    def baselines(self, batch: tuple[int, ...], seed: int = 2) -> TensorDict:
        td = self.inputs(batch, seed)
        return td.apply(lambda t: 0.3 * t)

    def non_relu_classes(self) -> tuple[type[nn.Module], ...]:
        return tuple({type(m) for name, m in self.model.named_modules() if name and not isinstance(m, nn.ReLU)})


def _mlp() -> tuple[nn.Module, dict[str, nn.Module]]:
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))
    return m, {"[0]": m[0], "[3]": m[3]}


def _conv1d() -> tuple[nn.Module, dict[str, nn.Module]]:
    m = nn.Sequential(
        nn.Conv1d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv1d(3, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4, 3)
    )
    return m, {"[0]": m[0], "[2]": m[2]}


def _cnn() -> tuple[nn.Module, dict[str, nn.Module]]:
    m = nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 3 * 3, 4)
    )
    return m, {"[0]": m[0], "[3]": m[3]}


def build(name: str, dtype: torch.dtype = torch.float32) -> Entry:
    """A fresh, seeded model of the zoo in ``dtype``."""
    torch.manual_seed(0)
    if name == "mlp":
        model, layers = _mlp()
        entry = Entry(name, model, ("input",), ((4,),), 3, layers)
    elif name == "conv1d":
        model, layers = _conv1d()
        entry = Entry(name, model, ("input",), ((2, 6),), 3, layers, layers)
    elif name == "cnn":
        model, layers = _cnn()
        entry = Entry(name, model, ("input",), ((1, 5, 5),), 4, layers, layers)
    elif name == "two_input":
        model = TwoInput()
        entry = Entry(name, model, ("x", "y"), ((4,), (3,)), 3, {"a": model.a, "act": model.act})
    elif name == "transformer":
        model = TransformerHead()
        layers = {"encoder.linear1": model.encoder.linear1, "encoder": model.encoder}
        entry = Entry(name, model, ("input",), ((3, 8),), 3, layers)
    else:
        raise KeyError(name)
    entry.model.to(dtype).eval()
    entry.dtype = dtype
    return entry


NAMES = ("mlp", "conv1d", "cnn", "two_input", "transformer")
CONV_NAMES = ("conv1d", "cnn")


def as_captum(entry: Entry, td: TensorDict) -> tuple[torch.Tensor, ...]:
    """The inputs of ``td`` as captum's flat-batch tuple (``[]`` -> batch of one, ``[2, 3]`` -> ``[6]``).

    Copies: captum sets ``requires_grad`` on the tensors it is given.
    """
    out = []
    for key in entry.in_keys:
        t = td.get(key)
        n = len(td.batch_size)
        out.append((t.reshape(-1, *t.shape[n:]) if n else t.unsqueeze(0)).clone())
    return tuple(out)


def captum_inputs(entry: Entry, td: TensorDict) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """:func:`as_captum`, a bare tensor for single-input models."""
    flat = as_captum(entry, td)
    return flat if len(flat) > 1 else flat[0]


def as_tuple(x: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def from_captum(t: torch.Tensor, batch: tuple[int, ...], lead: int = 0) -> torch.Tensor:
    """Undo :func:`as_captum` on a result with ``lead`` dims before the flat batch."""
    return t.reshape(torch.Size([*t.shape[:lead], *batch, *t.shape[lead + 1 :]]))


def assert_same(ours: torch.Tensor, theirs: torch.Tensor, *, exact: bool, integrated: bool = False) -> None:
    """Bitwise equal when ``exact``; otherwise close.

    ``exact`` is for comparisons that hold by construction: both sides run the same ops on
    the same shapes, so the same kernels on any CPU (ours flattens the batch to captum's
    flat batch, and a one-hot cotangent is the gradient captum's target selection feeds
    back, exactly). Comparisons across batch shapes (chunks, ``vmap``) use
    ``_tolerance.assert_close_ulps`` instead.

    float64 integrated gradients: captum rounds the step weights to float32, which moves each
    weighted gradient by up to 6e-8 relative; where the steps cancel, the error is relative
    to the map's scale, not to the element, hence ``atol = 1e-7 * max |map|``. Everything
    else agrees to a few ulps (measured: under one for the transformer's maps and for
    float32 integrated gradients, where captum sums the steps at once and we fold them in
    order).
    """
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    assert ours.dtype == theirs.dtype, (ours.dtype, theirs.dtype)
    if exact:
        assert torch.equal(ours, theirs), f"max |diff| {(ours - theirs).abs().max().item():.3e}"
    elif integrated and ours.dtype == torch.float64:
        torch.testing.assert_close(ours, theirs, rtol=1e-7, atol=1e-7 * theirs.abs().max().item() + 1e-12)
    else:
        assert_close_ulps(ours, theirs)


def one_thread() -> Iterator[None]:
    """Generator body of an autouse fixture: one intra-op thread for the test.

    The models are tiny, so nothing is lost, and a second OpenMP thread spinning on a
    core that another process holds slows these tests down five-fold.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def on_general_path(model: nn.Module, call: Callable[[], T]) -> T:
    """``call()`` with the model off the chain walks (DeepLift's, LRP's): a forward hook on its first module, which
    changes nothing, sends the call the general way."""
    handle = next(iter(model.children())).register_forward_hook(lambda _m, _a, out: out)
    try:
        return call()
    finally:
        handle.remove()


def plain_walks(monkeypatch: Any) -> list[bool]:
    """Whether each engine call of a test took the plain-gradient walk (NOTE [plain gradients on a chain]), in
    order: a spy on the engine's ``plain_gradients``."""
    from tdhook_fn.attribution import _engine

    taken: list[bool] = []
    own = _engine.plain_gradients

    def spy(*args: Any, **kwargs: Any) -> Any:
        result = own(*args, **kwargs)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(_engine, "plain_gradients", spy)
    return taken


class DropoutAfterReLU(nn.Module):
    """``relu_(h)`` (``inplace``), then ``Dropout(inplace=True)``, which writes nothing in eval mode; the model reads
    ``h`` again, its twin (not ``inplace``) the ReLU's output: what a write-back into ``h`` would break (the ReLU's
    backward keeps ``h``). NOTE [replaced derivatives of in-place modules]"""

    def __init__(self, inplace: bool):
        super().__init__()
        self.a, self.act, self.drop, self.head = nn.Linear(4, 6), nn.ReLU(inplace=inplace), nn.Dropout(
            0.5, inplace=inplace), nn.Linear(6, 3)
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        y = self.act(h)
        return self.head(self.drop(y)) + (h if self.inplace else y)[..., :3]
