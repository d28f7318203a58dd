"""DeepLift's rescale rule (Shrikumar et al. 2017) as LRP-style rules: modified VJPs of nonlinearities."""

# NOTE [deeplift as lrp rules]
# DeepLift runs the model once on the inputs and their references stacked along the batch
# (``n`` input rows first, then the reference rows: ``n`` of them, or one shared by all
# when every sample has the same reference). Each nonlinearity then sees both, and its
# backward hands ``g * dy / dx`` to the input rows (``dx``, ``dy``: input minus reference
# at the module's input and output), or its plain gradient where ``|dx| < eps`` (captum's
# fallback); linear modules keep their own backward, which is already ``dy / dx``. That
# is an LRP rule in the sense of `tdhook_fn.attribution.lrp`: the rule sees the module's
# input and output (NOTE [lrp as modified vjps]), so DeepLift runs on LRP's walk, the
# chain walk included.
#
# Captum pulls the target back through the references' rows as well, and its max-pool and
# softmax rules read that gradient. Where the model is a chain of per-sample linear maps
# and these nonlinearities (`needs_reference_gradients` says no), the references'
# gradient equals the inputs' (the same multipliers and weights act on both), except
# where a nonlinearity above fell back to its plain gradient at ``0 < |dx| < eps``; the
# target then reads the input rows only, the references carry no gradient, and one
# shared reference row suffices. Elsewhere (attention: ``a @ v`` sends each row a
# gradient of its own) the target reads both, as in captum, and the rules hand on both.
# Captum's softmax rule subtracts the mean of the multiplied gradient over the whole
# batch; here over each sample's pair of rows, so that a map does not depend on the
# other samples of the batch (equal to captum one sample at a time).

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._lrp.module_call import ModuleCall
from ._lrp.rules import Relevances

__all__ = ["EPS", "RESCALED", "Rescale", "RescaleMaxPool", "RescaleSoftmax", "below_eps", "needs_reference_gradients",
           "rescale_rules"]

EPS = 1e-10  # (captum's default eps: the rules', the methods' and their tensor paths')

# NOTE [eps in half precision]
# In float16, captum's eps (1e-10) rounds to 0 when compared with a float16 tensor, so
# ``|dx| < eps`` is false even where dx is 0 (a ReLU's output at two negative inputs, as
# a max pooling after it sees), and 0 / 0 puts NaN in the map. The sizes are compared
# in float32 instead (every float16 and bfloat16 value is exact there): the plain
# gradient is taken where ``|dx| < eps``, as in float32.
_HALVES = (torch.float16, torch.bfloat16)


def below_eps(size: torch.Tensor, eps: float) -> torch.Tensor:
    """Where ``size < eps``, compared in float32 at least (NOTE [eps in half precision])."""
    return (size.float() if size.dtype in _HALVES else size) < eps


def _halves(call: ModuleCall, n: int, rows: int,
            what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module's input and output at the inputs' rows and at the references' rows (``rows`` in all)."""
    if len(call.inputs) != 1:
        raise ValueError(f"deeplift: the rescale rule at {call.path!r} ({what}) takes one input, the module got "
                         f"{len(call.inputs)}")
    x, y = call.inputs[0], call.output
    if x.dim() == 0 or y.dim() == 0 or x.shape[0] != rows or y.shape[0] != rows:
        raise ValueError(f"deeplift: module {call.path!r} ({what}) needs the batch as its input's and output's first "
                         f"dim (inputs and references stacked there: {rows} rows), got shapes {tuple(x.shape)} and "
                         f"{tuple(y.shape)}; move the batch to the first dim around this module")
    return x[:n], x[n:], y[:n], y[n:]


def _rows(at_inputs: torch.Tensor, at_references: torch.Tensor | None, reference: torch.Tensor) -> torch.Tensor:
    """The gradient of the stacked rows: zeros at the references' where they carry none.

    See NOTE [deeplift as lrp rules].
    """
    return torch.cat([at_inputs, at_inputs.new_zeros(reference.shape) if at_references is None else at_references])


def _ratio(dy: torch.Tensor, dx: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """``dy / dx``, with ``dx`` replaced by 1 where it is too small: no inf or nan where it is not used."""
    return dy / torch.where(flat, torch.ones_like(dx), dx)


def _softplus(state: dict[str, Any], x: torch.Tensor, _y: torch.Tensor) -> torch.Tensor:
    z = (x * state["beta"]).exp()
    return torch.where(x * state["beta"] > state["threshold"], 1.0, z / (z + 1))


# each derivative from the module's state, its input and its output, in closed form: a module's own vjp inside
# the rules' backward does not compose with vmap (functorch asserts); the numbers (settings) they read
_DERIVATIVES: dict[type[nn.Module], tuple[Callable[[dict[str, Any], torch.Tensor, torch.Tensor], torch.Tensor],
                                          tuple[str, ...]]] = {
    nn.ReLU: (lambda _s, _x, y: (y > 0).to(y.dtype), ()),
    nn.Sigmoid: (lambda _s, _x, y: y * (1 - y), ()),
    nn.Tanh: (lambda _s, _x, y: 1 - y * y, ()),
    # from the output (an in-place module's input is its output): y > 0 where x > 0, and ELU's alpha e^x is y + alpha
    nn.LeakyReLU: (lambda s, _x, y: torch.full_like(y, s["negative_slope"]).masked_fill_(y > 0, 1.0),
                   ("negative_slope",)),
    nn.ELU: (lambda s, _x, y: torch.where(y > 0, 1.0, y + s["alpha"]), ("alpha",)),
    nn.Softplus: (_softplus, ("beta", "threshold")),  # (no in-place form: its input is its own)
}


@dataclass(frozen=True)
class _RescaleRule:
    """What every rescale rule knows: where the inputs' rows end, and how it treats a small ``|dx|``.

    Args:
        n (int): the number of input rows leading the stacked batch.
        rows (int): the number of rows of the stacked batch (inputs and references).
        eps (float): below this ``|dx|`` the plain gradient is used. Default: ``1e-10``, as captum.
        carried (bool): the references' rows carry a gradient of their own. Default: ``False``.
    """

    n: int
    rows: int
    eps: float = EPS
    carried: bool = False

    def _differences(self, call: ModuleCall, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                               torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x, x_ref, y, y_ref`` (as `_halves`), ``dx = x - x_ref``, and where ``|dx| < eps``."""
        x, x_ref, y, y_ref = _halves(call, self.n, self.rows, what)
        dx = x - x_ref
        return x, x_ref, y, y_ref, dx, below_eps(dx.abs(), self.eps)

    def _rescaled(self, call: ModuleCall, grad: torch.Tensor, what: str, plain: Callable[[], torch.Tensor],
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The references' input, and ``g * dy / dx`` at the inputs' rows and (if carried) the references'.

        ``plain()`` is the module's plain gradient of all rows, taken where ``|dx| < eps``.
        """
        _, x_ref, y, y_ref, dx, flat = self._differences(call, what)
        ratio = _ratio(y - y_ref, dx, flat)
        at = plain()
        at_inputs = torch.where(flat, at[: self.n], grad[: self.n] * ratio)
        at_references = torch.where(flat, at[self.n :], grad[self.n :] * ratio) if self.carried else None
        return x_ref, at_inputs, at_references


@dataclass(frozen=True)
class Rescale(_RescaleRule):
    """The rescale rule at an elementwise nonlinearity: ``g * dy / dx``, the plain gradient where ``|dx| < eps``.

    Fields as `_RescaleRule`.
    """

    def relevance(self, call: ModuleCall, grad: torch.Tensor) -> Relevances:
        derivative, settings = _DERIVATIVES.get(call.template.cls, (None, ()))
        state = call.template.state
        if not all(type(state.get(name)) in (int, float) for name in settings):
            derivative = None  # (a setting that is not a number: the module's own vjp)

        def plain() -> torch.Tensor:
            if derivative is None:
                return call.vjp(call.inputs, grad)[0]
            return grad * derivative(state, call.inputs[0], call.output)

        x_ref, at_inputs, at_references = self._rescaled(call, grad, "an elementwise nonlinearity", plain)
        return [_rows(at_inputs, at_references, x_ref)]


@dataclass(frozen=True)
class RescaleSoftmax(_RescaleRule):
    """The rescale rule at a softmax, centred per sample as captum's (NOTE [deeplift as lrp rules]).

    Fields as `_RescaleRule`.
    """

    def relevance(self, call: ModuleCall, grad: torch.Tensor) -> Relevances:
        x_ref, at_inputs, at_references = self._rescaled(call, grad, "a softmax",
                                                          lambda: call.vjp(call.inputs, grad)[0])
        per_sample = (-1, *[1] * (x_ref.dim() - 1))
        if at_references is None:  # the references' part is the inputs' (NOTE [deeplift as lrp rules])
            mean = at_inputs.flatten(1).mean(1)
            return [_rows(at_inputs - mean.reshape(per_sample), None, x_ref)]
        mean = (at_inputs.flatten(1).mean(1) + at_references.flatten(1).mean(1)) / 2
        mean = mean.reshape(per_sample)
        return [_rows(at_inputs - mean, at_references - mean, x_ref)]


_POOLS: dict[type[nn.Module], tuple[int, Callable[..., Any]]] = {
    nn.MaxPool1d: (1, F.max_pool1d), nn.MaxPool2d: (2, F.max_pool2d), nn.MaxPool3d: (3, F.max_pool3d),
}


@dataclass(frozen=True)
class RescaleMaxPool(_RescaleRule):
    """Captum's rescale rule at max pooling: each window's change sent to where the maxima of input and reference are.

    Fields as `_RescaleRule`.
    """

    def relevance(self, call: ModuleCall, grad: torch.Tensor) -> Relevances:
        x, x_ref, y, y_ref, dx, flat = self._differences(call, "a max pooling")
        dims, pool = _POOLS[call.template.cls]
        state = call.template.state
        if state.get("return_indices"):
            raise ValueError(f"deeplift: max pooling {call.path!r} returns indices; the rescale rule needs one tensor")
        indices = pool(call.inputs[0], state["kernel_size"], state["stride"], state["padding"], state["dilation"],
                       ceil_mode=state["ceil_mode"], return_indices=True)[1]
        at_x, at_ref = indices[: self.n], indices[self.n :].expand_as(y)
        g = grad[: self.n]
        g_ref = grad[self.n :] if self.carried else g
        top = torch.maximum(y, y_ref)

        def unpool(values: torch.Tensor, where: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            plane = values.new_zeros(like.shape).flatten(-dims)
            return plane.scatter_add_(-1, where.flatten(-dims), values.flatten(-dims)).view(like.shape)

        moved = _ratio(unpool(g * (top - y_ref), at_x, x) + unpool(g_ref * (y - top), at_ref, x), dx, flat)
        at_inputs = torch.where(flat, unpool(g, at_x, x), moved)
        at_references = torch.where(flat, unpool(g_ref, at_ref, x), moved) if self.carried else None
        return [_rows(at_inputs, at_references, x_ref)]


RESCALED: dict[type[nn.Module], type[_RescaleRule]] = {
    nn.ReLU: Rescale, nn.ELU: Rescale, nn.LeakyReLU: Rescale, nn.Sigmoid: Rescale, nn.Tanh: Rescale,
    nn.Softplus: Rescale, nn.Softmax: RescaleSoftmax,
    nn.MaxPool1d: RescaleMaxPool, nn.MaxPool2d: RescaleMaxPool, nn.MaxPool3d: RescaleMaxPool,
}

# modules that act on each sample linearly (in eval mode), or are rescaled: a chain of them sends
# the references' rows the inputs' gradient (NOTE [deeplift as lrp rules])
_PER_SAMPLE_LINEAR = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Flatten, nn.Unflatten, nn.Identity, nn.Dropout,
                      nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def needs_reference_gradients(model: nn.Module) -> bool:
    """Whether the references' rows must carry their own gradient (NOTE [deeplift as lrp rules]).

    No for a model without softmax or max pooling (no rule reads it), and for an
    ``nn.Sequential`` chain of per-sample linear modules and rescaled ones.
    """
    readers = (RescaleSoftmax, RescaleMaxPool)
    if not any(RESCALED.get(type(m)) in readers for m in model.modules()):
        return False
    for module in model.modules():
        if isinstance(module, nn.Sequential) and "forward" not in module.__dict__:
            continue
        if module._modules or not (type(module) in RESCALED or isinstance(module, _PER_SAMPLE_LINEAR)):
            return True
        if "forward" in module.__dict__ or (isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training):
            return True
    return False


def rescale_rules(n: int, rows: int, eps: float, carried: bool) -> Callable[[str, nn.Module], Any]:
    """The rule mapper of DeepLift: captum's nonlinearities (by exact class) get the rescale rule, others none."""
    made = {cls: rule(n, rows, eps, carried) for cls, rule in RESCALED.items()}

    def mapper(_name: str, module: nn.Module) -> Any:
        return made.get(type(module))

    return mapper
