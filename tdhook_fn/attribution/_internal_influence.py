"""Internal influence (Leino et al. 2018): a layer's gradients integrated while the inputs move."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tensordict import TensorDict, TensorDictBase

from .._functional import Functional
from .._targets import Target
from .._types import NestedKey, PureFn
from ._baselines import Baselines, in_dtypes, quadrature
from ._inputs import accepts_tensors
from ._path_checks import check_chunk_size, check_layer_paths, check_steps, checked_path_ends
from ._path_gradients import gradients_along_path

__all__ = ["internal_influence"]

_CALLER = "internal_influence"


@accepts_tensors
def internal_influence(
    f: PureFn,
    params: TensorDictBase,
    inputs: TensorDictBase,
    baselines: Baselines = 0.0,
    *,
    target: Target,
    layers: Sequence[str],
    n_steps: int = 50,
    method: str = "gausslegendre",
    per_target: bool = False,
    chunk_size: int | None = None,
    input_keys: NestedKey | Sequence[NestedKey] | None = None,
    layer_calls: Mapping[str, int] | None = None,
) -> TensorDict:
    """The gradient at each layer averaged along the path: captum's ``InternalInfluence``, batched.

    ``attr[y] = sum_k w_k * dF/dy(b + a_k (x - b))`` with the nodes ``a_k`` and weights
    ``w_k`` of ``method`` (captum's, see `quadrature`): the layer variant of
    `integrated_gradients` that interpolates the inputs and reads gradients at the layers
    (not multiplied by any difference). All points of a chunk go through ``f`` in one
    forward and one VJP.

    Args:
        f (Functional): pure ``f(params, td) -> td`` (a `tdhook_fn.Functional`: layers are
            read through taps).
        params (TensorDict): parameters for ``f`` (constants here).
        inputs (TensorDict | Tensor): inputs, any batch size ``[*B]``; or a tensor, batch
            first, for an ``f`` with one in_key (the one map is then a tensor).
        baselines (TensorDict | Tensor | float): the path's start, as in
            `integrated_gradients`. Default: ``0.0`` (captum's ``None``).
        target (int | tuple[int, ...] | Tensor | Callable): see `tdhook_fn.as_target`.
        layers (Sequence[str]): paths of the layers whose outputs are attributed.
        n_steps (int): number of path points. Default: 50.
        method (str): ``riemann_left|right|middle|trapezoid`` or ``gausslegendre``.
            Default: ``"gausslegendre"``.
        per_target (bool): one map per target on a new leading dim ``T``. Default: the sum.
        chunk_size (int | None): path points per forward; bounds memory.
        input_keys (Sequence | None): the inputs the baselines replace. Default: every
            input ``f`` reads.
        layer_calls (Mapping[str, int] | None): the run to attribute of a layer whose
            module runs more than once, as in `saliency`.

    Returns:
        TensorDict: one map per layer path, shaped like its activation (batch ``[*B]`` or
        ``[T, *B]``). For a tensor ``inputs`` and one layer, the map as a tensor.

    Raises:
        ValueError: no layers, unknown method, too few steps or a bad ``chunk_size``.
        TypeError: an input on the path is not floating point, or ``f`` is not a
            `tdhook_fn.Functional`.

    Examples:
        >>> import torch, tdhook_fn
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> f, p = tdhook_fn.pure(net)
        >>> x = TensorDict(input=torch.randn(5, 3), batch_size=[5])
        >>> attr = internal_influence(f, p, x, 0.0, target=1, layers=["[1]"])
        >>> torch.allclose(attr["[1]"], net[2].weight[1].expand(5, 4))  # the last layer is linear
        True
    """
    check_layer_paths(_CALLER, layers)
    check_steps(_CALLER, n_steps, least=1)
    check_chunk_size(_CALLER, chunk_size)
    alphas, steps = quadrature(method, n_steps)
    keys, base = checked_path_ends(_CALLER, f, params, inputs, baselines, target, input_keys)
    if not isinstance(f, Functional):
        raise TypeError(f"{_CALLER}: f must be a tdhook_fn.Functional (layers are read through taps); build it with "
                        "f, params = tdhook_fn.pure(model)")
    # integrated gradients read at the layers while the inputs move, without input maps: one mechanism
    total, dtypes = gradients_along_path(f, params, inputs, base, keys, target, layers=layers, alphas=alphas,
                                         weights=steps, per_target=per_target, chunk_size=chunk_size,
                                         layer_calls=layer_calls, caller=_CALLER)
    return in_dtypes(total, dtypes)  # half precision: summed in float32
