"""Deconvolution (Zeiler and Fergus 2014): gradients whose ReLUs pass back the positive part of what arrives."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from .._functional import Functional
from .._model_plans import global_hooks, hooked, plan_for
from .._taps import Tap
from .._targets import Target
from .._types import NestedKey
from ._engine import Cotangents, gradients, input_keys_of
from ._gradient_chain import Guide, gradient_step, tensor_gradients, walked_gradients
from ._guided_backprop import guide_taps, module_paths
from ._inputs import accepts_tensors_via

__all__ = ["deconvolution", "relu_paths", "relu_rule_taps"]

# NOTE [deconvolution as taps]
# A ReLU's own backward masks the gradient by where its input was positive; the
# deconvnet ignores that mask and passes back the positive part of the gradient that
# arrives. Two taps per ReLU module put that VJP in place without touching the
# module: an intervention at its input keeps the input, one at its output puts a
# Function between the output and what reads it: the module's output forward, ``relu``
# of the gradient straight to the kept input backward. As captum's backward hook, only
# the backward changes: a subclass of ``nn.ReLU`` with a forward of its own (a shift, a
# leak), or a hook of the model's that changes the module's input or output, keeps its
# values. The module runs on a detached input, so its own backward reaches its
# parameters only (captum's hook replaces the gradient of the inputs alone). A plain
# ``nn.ReLU`` that nothing else sees runs on a stand-in instead
# (NOTE [a stand-in for the replaced ReLU]) and its output is ``relu`` of the kept
# input, by `_RectifiedGrad`. (Guided backprop keeps the module's backward:
# NOTE [guided backprop as taps].) Plain taps and autograd.Functions, so it runs under
# vmap, grad and torch.compile(fullgraph=True) alike.


class _RectifiedGrad(torch.autograd.Function):
    """``relu`` forward; ``relu`` of the arriving gradient backward."""

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


class _PlainRectifiedGrad(torch.autograd.Function):
    """`_RectifiedGrad` in the plain style (NOTE [plain-style Function outside transforms])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.relu(grad)


class _Rerouted(torch.autograd.Function):
    """``out`` (a copy) forward; ``relu`` of the arriving gradient to ``x``, and the gradient itself to ``out``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.clone()  # (a copy: what reads it may write it in place)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.relu(grad), grad


class _PlainRerouted(torch.autograd.Function):
    """`_Rerouted` in the plain style (NOTE [plain-style Function outside transforms])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.relu(grad), grad


# (torch declares Function.apply untyped: each apply's signature, stated once)
_rectified_grad: Callable[[torch.Tensor], torch.Tensor] = _RectifiedGrad.apply
_plain_rectified_grad: Callable[[torch.Tensor], torch.Tensor] = _PlainRectifiedGrad.apply
_rerouted_grad: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _Rerouted.apply
_plain_rerouted_grad: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _PlainRerouted.apply


def _rectified(x: torch.Tensor) -> torch.Tensor:
    """``relu(x)`` with ``relu`` of the gradient backward (NOTE [deconvolution as taps])."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        # through a view, as `mapped_gradient` (a Function on a torch.func.grad primal under torch.compile)
        return _rectified_grad(x.view_as(x))
    return _plain_rectified_grad(x)


def _rerouted(site: _ReLUSite, x: torch.Tensor, out: Any) -> torch.Tensor:
    """``out`` forward, ``relu`` of its gradient to ``x`` backward (NOTE [deconvolution as taps])."""
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        got = f"shape {list(out.shape)}" if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"
        raise ValueError(f"deconvolution: ReLU module {site.path!r} ({site.kind}) returns {got} from an input of shape "
                         f"{list(x.shape)}; the deconvnet passes relu(gradient at its output) back to its input, "
                         "which needs one output tensor shaped as the input (captum fails here too): give the module "
                         "a forward that keeps the shape, or make it a subclass of nn.Module rather than nn.ReLU")
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return _rerouted_grad(x.view_as(x), out)
    return _plain_rerouted_grad(x, out)


# NOTE [a stand-in for the replaced ReLU]
# For a plain ``nn.ReLU`` the output is ``relu`` of the kept input, so the module's own
# result is not needed: it is handed a one-element stand-in to run on instead of its
# input (no ReLU forward wasted, and an ``inplace=True`` ReLU writes the stand-in, not the
# kept input). Only where nothing else sees that ReLU's input or output: no hook of the
# model's on the module (a hooked model gets no cached plan, so this is checked at every
# call), no global module hook, no tap of ``f``'s. Elsewhere the module runs on the
# detached input and its output is kept (NOTE [deconvolution as taps]).


def _deconv_taps(site: _ReLUSite, stand_in: bool) -> list[Tap]:
    """The deconvnet's backward at the ReLU ``site`` (NOTE [deconvolution as taps])."""
    # this call's own stack (a module may run more than once in a forward): each input, and what the module got
    inputs: list[tuple[torch.Tensor, torch.Tensor]] = []
    inplace = site.inplace

    def keep(x: torch.Tensor) -> torch.Tensor:
        if stand_in:  # NOTE [a stand-in for the replaced ReLU]
            held = x.new_zeros(())
        else:
            held = x.detach()  # (its own backward reaches the module's parameters only)
            held = held.clone() if inplace else held
        inputs.append((x, held))
        return held

    def replace(output: Any) -> torch.Tensor:
        x, held = inputs.pop()
        if stand_in:
            return _rectified(x)
        if inplace and (site.hooked or not site.exact) and output is not held:  # (not another tap's value)
            raise ValueError(f"deconvolution: ReLU module {site.path!r} ({site.kind}) writes its input in place "
                             "(inplace=True) and hands on another tensor (a forward hook of the model's replaced its "
                             "output, or its forward returns another): what reads the written input would miss the "
                             "deconvnet's rule; build the module with inplace=False")
        return _rerouted(site, x, output)

    # (the key given: no capture reads it, and deriving it costs as much as the tap; an in-place ReLU's input is
    # written back after: NOTE [replaced derivatives of in-place modules])
    return [Tap(site.path, "intervene", keep, "input", site.path, writes_back=True),
            Tap(site.path, "intervene", replace, "output", site.path, replaces_derivative=True, writes_back=True)]


class _ReLUSite(NamedTuple):
    path: str
    kind: str  # its class, for messages
    exact: bool  # an nn.ReLU itself (no subclass, no instance forward): its output is relu of its input
    hooked: bool  # hooks of the model's own on the module
    inplace: bool
    guided: bool  # one guided Grad-CAM guides: no instance of another class of module in the model


def _relu_plan(model: nn.Module) -> tuple[_ReLUSite, ...]:
    """The model's ReLU modules, as the taps need them (built once per model: NOTE [plans per model])."""
    others = tuple({type(m) for m in model.modules() if not isinstance(m, nn.ReLU)})
    return tuple(_ReLUSite(path, type(relu).__qualname__, type(relu) is nn.ReLU and "forward" not in vars(relu),
                           hooked(relu), getattr(relu, "inplace", False) is True, not isinstance(relu, others))
                 for path, relu in _relus(model))


def relu_rule_taps(f: Functional, *, guided: bool, guide: Guide | None = None) -> list[Tap]:
    """Taps giving ``f.model``'s ReLU modules the deconvnet's backward, or (``guided``) guided backprop's.

    Guided: the ReLUs that guided Grad-CAM guides (those of no other module class found in the
    model), with `guided_backprop`'s taps (NOTE [guided backprop as taps]).
    Unchecked taps (NOTE [taps that never fire]): an unused ReLU is fine.

    Args:
        f (Functional): the function whose model's ReLUs are tapped.
        guided (bool): guided backprop's backward (``relu`` of the ReLU's own), else the deconvnet's.
        guide (Guide | None): with ``guided``, switches the backward between passes. Default: always guided.

    Returns:
        list[Tap]: the taps, for one call.
    """
    model = f.model
    # NOTE [plans per model] (Dynamo traces no cache: compiled, the plan is built, once per compile)
    plan = _relu_plan(model) if torch.compiler.is_compiling() else plan_for(model, "relu sites",
                                                                              lambda: _relu_plan(model))
    if guided:
        return guide_taps((site.path for site in plan if site.guided), guide)
    free = not f.taps and not global_hooks()  # (f's taps: any, since one path has several spellings)
    return [tap for site in plan for tap in _deconv_taps(site, free and site.exact and not site.hooked)]


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


_DECONVNET_STEP = gradient_step(lambda _y: torch.relu)  # (a ReLU passes back relu of what arrives)


@accepts_tensors_via(tensor_gradients("deconvolution", _DECONVNET_STEP))
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
    if cotangents is None and input_keys is None:  # NOTE [gradient rules on a chain]
        walked = walked_gradients("deconvolution", f, params, inputs, target, per_target, lambda _plan: _DECONVNET_STEP)
        if walked is not None:
            return walked
    taps = relu_rule_taps(f, guided=False)  # NOTE [deconvolution as taps]
    keys = input_keys_of(f, inputs, input_keys)  # (the engine itself: its errors name deconvolution, not saliency)
    return gradients(f, params, inputs, target, input_keys=keys, taps=taps, per_target=per_target,
                     cotangents=cotangents, caller="deconvolution").grads

