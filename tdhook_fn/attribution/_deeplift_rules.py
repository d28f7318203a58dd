"""DeepLift's rescale rule (Shrikumar et al. 2017) as LRP-style rules: modified VJPs of nonlinearities.

# NOTE [deeplift as lrp rules]
DeepLift runs the model once on the inputs and their references stacked along the batch
(``n`` input rows first, then the reference rows: ``n`` of them, or one shared by all
when every sample has the same reference). Each nonlinearity then sees both, and its
backward hands ``g * dy / dx`` to the input rows (``dx``, ``dy``: input minus reference
at the module's input and output), or its plain gradient where ``|dx| < eps`` (captum's
fallback); linear modules keep their own backward, which is already ``dy / dx``. That
is an LRP rule in the sense of `tdhook_fn.attribution.lrp`: the rule sees the module's
input and output (NOTE [lrp as modified vjps]), so DeepLift runs on LRP's walk, the
chain walk included.

The target reads the input rows only, so the reference rows carry no gradient. Captum
also pulls the target back through the references: its max-pool and softmax rules
read that gradient, which differs from the inputs' only where a nonlinearity above fell
back to its plain gradient (``|dx| < eps``); the rules here take the inputs' gradient
for both, as the two agree everywhere else. Captum's softmax rule subtracts the mean of
the multiplied gradient over the whole batch; here over each sample, so that a map does
not depend on the other samples of the batch (equal to captum one sample at a time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._lrp_call import ModuleCall
from ._lrp_rules import Relevances

__all__ = ["RESCALED", "Rescale", "RescaleMaxPool", "RescaleSoftmax", "rescale_rules"]


def _halves(call: ModuleCall, n: int, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module's input and output at the inputs' rows and at the references' rows."""
    if len(call.inputs) != 1:
        raise ValueError(f"deeplift: the rescale rule at {call.path!r} ({what}) takes one input, the module got "
                         f"{len(call.inputs)}")
    x, y = call.inputs[0], call.output
    if x.dim() == 0 or y.dim() == 0 or x.shape[0] <= n or y.shape[0] != x.shape[0]:
        raise ValueError(f"deeplift: module {call.path!r} ({what}) needs the batch as its input's and output's first "
                         f"dim (inputs and references stacked there), got shapes {tuple(x.shape)} and "
                         f"{tuple(y.shape)}")
    return x[:n], x[n:], y[:n], y[n:]


def _with_reference_rows(grad: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``grad`` of the input rows, and zeros for the reference rows (they are not attributed)."""
    return torch.cat([grad, grad.new_zeros(reference.shape)])


def _plain(call: ModuleCall, grad: torch.Tensor, n: int) -> torch.Tensor:
    """The module's own gradient at the input rows (captum's fallback where ``|dx| < eps``)."""
    return call.vjp(call.inputs, grad)[0][:n]


_DERIVATIVES: dict[type[nn.Module], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    nn.ReLU: lambda _x, y: (y > 0).to(y.dtype),
    nn.Sigmoid: lambda _x, y: y * (1 - y),
    nn.Tanh: lambda _x, y: 1 - y * y,
}


@dataclass(frozen=True)
class Rescale:
    """The rescale rule at an elementwise nonlinearity: ``g * dy / dx``, the plain gradient where ``|dx| < eps``.

    Args:
        n (int): the number of input rows leading the stacked batch.
        eps (float): below this ``|dx|`` the plain gradient is used. Default: ``1e-10``, as captum.
    """

    n: int
    eps: float = 1e-10

    def relevance(self, call: ModuleCall, grad: torch.Tensor) -> Relevances:
        x, x_ref, y, y_ref = _halves(call, self.n, "an elementwise nonlinearity")
        g = grad[: self.n]
        dx = x - x_ref
        flat = dx.abs() < self.eps
        derivative = _DERIVATIVES.get(call.template.cls)
        plain = g * derivative(x, y) if derivative is not None else _plain(call, grad, self.n)
        # dx is replaced where it is too small, so that no inf or nan is made where it is not used
        rescaled = g * (y - y_ref) / torch.where(flat, torch.ones_like(dx), dx)
        return [_with_reference_rows(torch.where(flat, plain, rescaled), x_ref)]


@dataclass(frozen=True)
class RescaleSoftmax:
    """The rescale rule at a softmax, made to sum to zero per sample as captum's (NOTE [deeplift as lrp rules]).

    Args:
        n (int): the number of input rows leading the stacked batch.
        eps (float): below this ``|dx|`` the plain gradient is used. Default: ``1e-10``, as captum.
    """

    n: int
    eps: float = 1e-10

    def relevance(self, call: ModuleCall, grad: torch.Tensor) -> Relevances:
        x, x_ref, y, y_ref = _halves(call, self.n, "a softmax")
        dx = x - x_ref
        flat = dx.abs() < self.eps
        rescaled = grad[: self.n] * (y - y_ref) / torch.where(flat, torch.ones_like(dx), dx)
        multiplied = torch.where(flat, _plain(call, grad, self.n), rescaled)
        mean = multiplied.flatten(1).mean(1).reshape((-1, *[1] * (dx.dim() - 1)))
        return [_with_reference_rows(multiplied - mean, x_ref)]


_POOLS: dict[type[nn.Module], tuple[int, Callable[..., Any]]] = {
    nn.MaxPool1d: (1, F.max_pool1d), nn.MaxPool2d: (2, F.max_pool2d), nn.MaxPool3d: (3, F.max_pool3d),
}


@dataclass(frozen=True)
class RescaleMaxPool:
    """Captum's rescale rule at max pooling: each window's change sent to where the maxima of input and reference are.

    Args:
        n (int): the number of input rows leading the stacked batch.
        eps (float): below this ``|dx|`` the plain gradient is used. Default: ``1e-10``, as captum.
    """

    n: int
    eps: float = 1e-10

    def relevance(self, call: ModuleCall, grad: torch.Tensor) -> Relevances:
        x, x_ref, y, y_ref = _halves(call, self.n, "a max pooling")
        dims, pool = _POOLS[call.template.cls]
        state = call.template.state
        if state.get("return_indices"):
            raise ValueError(f"deeplift: max pooling {call.path!r} returns indices; the rescale rule needs one tensor")
        indices = pool(call.inputs[0], state["kernel_size"], state["stride"], state["padding"], state["dilation"],
                       ceil_mode=state["ceil_mode"], return_indices=True)[1]
        at_x, at_ref = indices[: self.n], indices[self.n :].expand_as(y)
        g = grad[: self.n]
        top = torch.maximum(y, y_ref)

        def unpool(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
            plane = values.new_zeros(x.shape).flatten(-dims)
            return plane.scatter_add_(-1, where.flatten(-dims), values.flatten(-dims)).view(x.shape)

        dx = x - x_ref
        flat = dx.abs() < self.eps
        moved = unpool(g * (top - y_ref), at_x) + unpool(g * (y - top), at_ref)
        rescaled = moved / torch.where(flat, torch.ones_like(dx), dx)
        return [_with_reference_rows(torch.where(flat, unpool(g, at_x), rescaled), x_ref)]


RESCALED: dict[type[nn.Module], type[Rescale] | type[RescaleSoftmax] | type[RescaleMaxPool]] = {
    nn.ReLU: Rescale, nn.ELU: Rescale, nn.LeakyReLU: Rescale, nn.Sigmoid: Rescale, nn.Tanh: Rescale,
    nn.Softplus: Rescale, nn.Softmax: RescaleSoftmax,
    nn.MaxPool1d: RescaleMaxPool, nn.MaxPool2d: RescaleMaxPool, nn.MaxPool3d: RescaleMaxPool,
}


def rescale_rules(n: int, eps: float) -> Callable[[str, nn.Module], Any]:
    """The rule mapper of DeepLift: captum's nonlinearities (by exact class) get the rescale rule, others none."""
    made = {cls: rule(n, eps) for cls, rule in RESCALED.items()}

    def mapper(_name: str, module: nn.Module) -> Any:
        return made.get(type(module))

    return mapper
