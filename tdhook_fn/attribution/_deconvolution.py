"""Deconvolution (Zeiler and Fergus 2014): gradients whose ReLUs pass back the positive part of what arrives."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from .._functional import Functional, NestedKey
from .._taps import Tap
from .._targets import Target
from ._engine import Cotangents
from ._guided_backprop import module_paths
from ._inputs import accepts_tensors
from ._lrp import rule_taps
from ._lrp_rules import Pass
from ._saliency import saliency

__all__ = ["deconvolution", "relu_paths"]

# NOTE [deconvolution as taps]
# A ReLU's own backward masks the gradient by where its input was positive; the
# deconvnet ignores that mask and passes back the positive part of the gradient that
# arrives. Two taps per ReLU build that VJP without touching the module: LRP's `Pass`
# rule (the gradient at the output goes to the input as it is, the module's backward
# bypassed; an ``inplace=True`` ReLU is given a copy) and, outside it, a ``map_grad`` at
# the output applying ``relu`` (the Pass rule's hook is prepended, so it runs first).


def relu_paths(model: nn.Module) -> list[str]:
    """Paths of the ``nn.ReLU`` submodules of ``model`` (instances of subclasses too), as captum hooks them.

    Args:
        model (nn.Module): the model whose ReLU modules are listed.

    Examples:
        >>> relu_paths(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1)))
        ['1']
    """
    modules = [module for name, module in model.named_modules() if name]
    return [path for path, module in zip(module_paths(model), modules, strict=True) if isinstance(module, nn.ReLU)]


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
    paths = relu_paths(f.model)  # NOTE [deconvolution as taps]
    passes = rule_taps(f, dict.fromkeys(paths, Pass()), warn_on_missing_rule=False) if paths else []
    # unchecked taps (NOTE [taps that never fire]): a ReLU the forward never calls is fine here
    positive = [Tap(path, "map_grad", torch.relu, "output") for path in paths]
    return saliency(f, params, inputs, target=target, per_target=per_target, input_keys=input_keys,
                    taps=[*passes, *positive], cotangents=cotangents)

