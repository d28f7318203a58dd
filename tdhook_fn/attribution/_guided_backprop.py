"""Guided backpropagation (Springenberg et al. 2014), as tdhook applies it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from .._functional import Functional
from .._model_plans import plan_for
from .._paths import name_to_path
from .._taps import Tap
from .._targets import Target
from .._types import GradFn, NestedKey
from ._engine import Cotangents, scaled
from ._gradient_chain import Guide, guided_backprop_step, walked_gradients
from ._inputs import accepts_tensors
from ._saliency import saliency

__all__ = ["guide_taps", "guided_backprop", "module_paths"]

# NOTE [guided backprop as taps]
# Guided backprop keeps a module's own backward and passes back ``relu`` of the gradient
# leaving it through its inputs: a `map_grad` tap at the module's input (a copy of each
# tensor argument forward, ``relu`` of its gradient backward). One rule for `guided_backprop`
# (every submodule not skipped, as tdhook) and for guided Grad-CAM (the ReLU modules, as
# captum), whose one forward pulls back twice (NOTE [attribution engine]): its taps carry
# a `Guide`, switched off for the plain pull back to the layer. Dynamo would trace the
# backward once, with the switch as it was, so a switched rule is not for torch.compile.


def guide_taps(paths: Iterable[str], guide: Guide | None = None) -> list[Tap]:
    """Guided backprop's taps at the inputs of the modules at ``paths`` (NOTE [guided backprop as taps]).

    Unchecked taps (NOTE [taps that never fire]): a module the forward never calls is fine.

    Args:
        paths (Iterable[str]): the modules' paths.
        guide (Guide | None): switches the taps' backward between passes. Default: ``None``, always guided.

    Returns:
        list[Tap]: the taps, for one call.
    """
    if guide is None:
        rule: Callable[[torch.Tensor], torch.Tensor] = torch.relu
    else:
        def rule(grad: torch.Tensor) -> torch.Tensor:  # (read at the backward: the pass's setting)
            return torch.relu(grad) if guide.on else grad

    # a `map_grad` at each module's input (the key given: no capture reads it, and deriving it costs as much as the tap)
    return [Tap(path, "map_grad", rule, "input", path) for path in paths]


def module_paths(model: nn.Module, classes_to_skip: tuple[type[nn.Module], ...] = ()) -> list[str]:
    """Paths of every submodule below the root, except instances of ``classes_to_skip``.

    Args:
        model (nn.Module): the model whose submodules are listed.
        classes_to_skip (tuple[type, ...]): module classes left out. Default: ``()``.

    Examples:
        >>> module_paths(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), (nn.Linear,))
        ['1']
    """
    return [name_to_path(name) for name, module in model.named_modules()
            if name and not isinstance(module, classes_to_skip)]


def _planned_paths(model: nn.Module, classes_to_skip: tuple[type[nn.Module], ...]) -> list[str]:
    """`module_paths`, built once per model and classes (NOTE [plans per model]; Dynamo traces no cache)."""
    if torch.compiler.is_compiling():
        return module_paths(model, classes_to_skip)
    return plan_for(model, ("guided paths", classes_to_skip), lambda: module_paths(model, classes_to_skip))


@accepts_tensors
def guided_backprop(
    f: Callable[[TensorDictBase, TensorDictBase], TensorDictBase],
    params: TensorDictBase,
    inputs: TensorDictBase,
    *,
    target: Target,
    classes_to_skip: tuple[type[nn.Module], ...] = (),
    multiply_by_inputs: bool = False,
    per_target: bool = False,
    layers: Sequence[str] = (),
    target_layers: Sequence[str] = (),
    use_inputs: bool = True,
    input_keys: NestedKey | Sequence[NestedKey] | None = None,
    grad_fns: Mapping[str, GradFn] | None = None,
    taps: Sequence[Tap] = (),
    cotangents: Cotangents | None = None,
    layer_calls: Mapping[str, int] | None = None,
) -> TensorDict:
    """Gradients with a ReLU applied to them wherever they leave a module through its inputs.

    As tdhook does, every submodule of ``f.model`` (not the root, not an instance of
    ``classes_to_skip``) passes back ``relu(grad_input)``. Skipping every class but
    ``nn.ReLU`` gives textbook guided backprop, equal to captum's ``GuidedBackprop``.

    Args:
        f (Functional): pure function of a model.
        params (TensorDict): parameters for ``f``, as in `saliency`.
        inputs (TensorDict | Tensor): inputs, any batch size ``[*B]``, as in `saliency`.
        target (int | tuple[int, ...] | Tensor | Callable): what is attributed, as in `saliency`.
        classes_to_skip (tuple[type, ...]): module classes left alone.
        multiply_by_inputs (bool): multiply by the inputs. Default: ``False``.
        per_target (bool): one map per target along a new leading dim ``T``, as in `saliency`.
            Default: ``False``.
        layers (Sequence[str]): paths whose activations are attributed too, as in `saliency` (token
            ids: ``layers=[<embedding>]`` with ``use_inputs=False``).
        target_layers (Sequence[str]): paths whose activations the target sees, as in `saliency`.
        use_inputs (bool): attribute the inputs, as in `saliency`. Default: ``True``.
        input_keys (Sequence | None): which inputs, as in `saliency`. Default: ``f.in_keys``.
        grad_fns (Mapping[str, Callable] | None): path -> function applied to the gradient at that
            module's output, as in `saliency`.
        taps (Sequence[Tap]): any further taps for the call, as in `saliency`.
        cotangents (Callable | None): the gradients fed back from the targets, as in `saliency`.
            Default: ones.
        layer_calls (Mapping[str, int] | None): the run to attribute of a layer whose module runs
            more than once, as in `saliency`.

    Returns:
        TensorDict: keyed like the inputs (and layer paths), ``[*B]`` or ``[T, *B]``; a
        tensor for a tensor ``inputs``.

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
        >>> x = TensorDict(input=torch.randn(5, 3), batch_size=[5])
        >>> guided_backprop(f, p, x, target=1)["input"].shape
        torch.Size([5, 3])
    """
    if not isinstance(f, Functional):
        raise TypeError("guided_backprop needs f to be a tdhook_fn.Functional (it taps every submodule)")
    if (use_inputs and not (layers or target_layers or grad_fns or taps or layer_calls) and input_keys is None
            and cotangents is None):  # NOTE [gradient rules on a chain]
        skip, model = tuple(classes_to_skip), f.model
        walked = walked_gradients("guided_backprop", f, params, inputs, target, per_target,
                                  lambda plan: guided_backprop_step(plan, model, skip))
        if walked is not None:
            if multiply_by_inputs:  # (no graph: NOTE [replaced derivatives are not differentiated])
                with torch.no_grad():
                    walked = scaled(walked, {key: inputs.get(key) for key in walked.keys()})
            return walked
    guides = guide_taps(_planned_paths(f.model, tuple(classes_to_skip)))  # NOTE [guided backprop as taps]
    return saliency(
        f, params, inputs, target=target, multiply_by_inputs=multiply_by_inputs, per_target=per_target,
        layers=layers, target_layers=target_layers, use_inputs=use_inputs, input_keys=input_keys, grad_fns=grad_fns,
        taps=[*guides, *taps], cotangents=cotangents, layer_calls=layer_calls,
    )
