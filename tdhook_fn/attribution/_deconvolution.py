"""Deconvolution (Zeiler and Fergus 2014): gradients whose ReLUs pass back the positive part of what arrives."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from .._functional import Functional, NestedKey
from .._taps import Tap
from .._targets import Target
from ._cotangents import Cotangents
from ._guided_backprop import module_paths
from ._inputs import accepts_tensors
from ._saliency import saliency

__all__ = ["deconvolution", "relu_paths"]

# NOTE [deconvolution as taps]
# A ReLU's own backward masks the gradient by where its input was positive; the
# deconvnet ignores that mask and passes back the positive part of the gradient that
# arrives. Two taps per ReLU module put that VJP in place without touching the
# module: an intervention at its input keeps the input (and hands an ``inplace=True``
# ReLU a copy to write), one at its output replaces the output by `_PositiveGradReLU` of
# that input: the same values, ``relu`` of the gradient on the way back, the module's own
# backward left out of the graph. Plain taps and an autograd.Function, so it runs under
# vmap, grad and torch.compile(fullgraph=True) alike.


class _PositiveGradReLU(torch.autograd.Function):
    """``relu`` forward; ``relu`` of the arriving gradient backward (no mask)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.relu(grad)


def _deconv_taps(path: str, relu: nn.Module) -> list[Tap]:
    """The deconvnet's backward at the ReLU ``relu`` at ``path`` (NOTE [deconvolution as taps])."""
    inplace = getattr(relu, "inplace", False) is True
    inputs: list[torch.Tensor] = []  # this call's own stack: a module may run more than once in a forward

    def keep(x: torch.Tensor) -> torch.Tensor:
        inputs.append(x)
        return x.clone() if inplace else x

    def replace(_output: torch.Tensor) -> torch.Tensor:
        x = inputs.pop()
        out: torch.Tensor = _PositiveGradReLU.apply(x.view_as(x))  # type: ignore[no-untyped-call]  # (see _map_grad)
        return out

    return [Tap(path, "intervene", keep, "input"), Tap(path, "intervene", replace, "output")]


def relu_paths(model: nn.Module) -> list[str]:
    """Paths of the ``nn.ReLU`` submodules of ``model`` (instances of subclasses too), as captum hooks them.

    Args:
        model (nn.Module): the model whose ReLU modules are listed.

    Examples:
        >>> relu_paths(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1)))
        ['1']
    """
    return [path for path, _ in _relus(model)]


def _relus(model: nn.Module) -> list[tuple[str, nn.Module]]:
    modules = [module for name, module in model.named_modules() if name]  # module_paths' order
    return [(path, m) for path, m in zip(module_paths(model), modules, strict=True) if isinstance(m, nn.ReLU)]


@accepts_tensors
def deconvolution(
    f: Callable[[TensorDictBase, TensorDictBase], TensorDictBase],
    params: TensorDictBase,
    inputs: TensorDictBase,
    *,
    target: Target,
    per_target: bool = False,
    input_keys: NestedKey | Sequence[NestedKey] | None = None,
    cotangents: Cotangents | None = None,
) -> TensorDict:
    """The gradient with every ``nn.ReLU`` module's backward replaced by ``relu(gradient at its output)``.

    As captum's ``Deconvolution``, only ``nn.ReLU`` modules change (a functional
    ``torch.relu`` in a forward keeps its gradient); the model is not touched.

    Args:
        f (Functional): pure function of a model (`tdhook_fn.functional`).
        params (TensorDict): parameters for ``f`` (constants here).
        inputs (TensorDict | Tensor): inputs, any batch size ``[*B]``, as in `saliency`.
        target (int | tuple[int, ...] | Tensor | Callable): what is attributed, as in `saliency`.
        per_target (bool): one map per target along a new leading dim ``T``. Default: ``False``.
        input_keys (Sequence | None): which inputs, as in `saliency`. Default: ``f.in_keys``.
        cotangents (Callable | None): the gradients fed back from the targets, as in `saliency`.

    Returns:
        TensorDict: keyed like the inputs, ``[*B]`` or ``[T, *B]``; a tensor for a tensor ``inputs``.

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
        >>> x = TensorDict(input=torch.randn(5, 3), batch_size=[5])
        >>> deconvolution(f, p, x, target=1)["input"].shape
        torch.Size([5, 3])
    """
    if not isinstance(f, Functional):
        raise TypeError("deconvolution needs f to be a tdhook_fn.Functional (it taps the model's ReLU modules); "
                        "build it with tdhook_fn.functional(model) or tdhook_fn.pure(model)")
    # NOTE [deconvolution as taps]; unchecked (NOTE [taps that never fire]): an unused ReLU is fine here
    taps = [tap for path, relu in _relus(f.model) for tap in _deconv_taps(path, relu)]
    return saliency(f, params, inputs, target=target, per_target=per_target, input_keys=input_keys, taps=taps,
                    cotangents=cotangents)

