"""Targets: what an attribution differentiates."""

# NOTE [one target rule]
# A target is a callable ``outputs_td -> TensorDict`` of target values, as tdhook's
# ``init_attr_targets``; every target value is a tensor whose leading dimensions are the
# batch. Shortcuts: an ``int`` ``i`` selects ``output[..., i]`` of the single output; a tuple
# of ints selects ``output[..., (i, j, ...)]`` (several targets along the last dimension,
# summed or attributed one by one by the methods); `label` selects, per sample, the
# class stored under another key of the TensorDict.

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from ._functional import fresh_tensordict
from ._types import NestedKey

__all__ = ["Target", "as_target", "autograd_off_note", "check_target", "label", "values_readable"]

Target = int | tuple[int, ...] | torch.Tensor | Callable[[TensorDictBase], TensorDictBase | torch.Tensor]


def autograd_off_note() -> str:
    """Why a target or metric has no gradient when autograd is off: ``""`` where it is on.

    Under ``torch.inference_mode()`` no op records a graph, whatever the methods enable
    inside, so every target is without gradient; ``torch.no_grad()`` is fine (the methods
    enable grad for their own forward).
    """
    if not torch.is_inference_mode_enabled():
        return ""
    return ("; autograd is off: torch.inference_mode() is active, so nothing computed in it has a gradient. Call it "
            "outside torch.inference_mode() (torch.no_grad() around it is fine)")


def _single_output(td: TensorDictBase) -> tuple[NestedKey, Any]:
    items = list(td.items(include_nested=True, leaves_only=True))
    if len(items) != 1:
        keys = [k for k, _ in items]
        raise ValueError(
            f"an int or tuple target needs a single output, got {keys}; pass a callable target"
        )
    return items[0]


def _only_output(td: TensorDictBase, outputs: Sequence[NestedKey] | None) -> tuple[NestedKey, Any]:
    """The single output among ``outputs`` (all of ``td``'s entries if None); one named output is read directly."""
    if outputs is not None and len(outputs) == 1:
        name = outputs[0]  # (a plain TensorDict's own dict read for a one-name key: `get` costs a few calls)
        value = td.__dict__["_tensordict"].get(name) if type(td) is TensorDict and type(name) is str else td.get(
            name, None)
        if isinstance(value, torch.Tensor):
            return outputs[0], value
    return _single_output(td if outputs is None else td.select(*outputs))


def _select(index: int | list[int], outputs: Sequence[NestedKey] | None) -> Callable[[TensorDictBase], TensorDictBase]:
    def select(td: TensorDictBase) -> TensorDictBase:
        key, value = _only_output(td, outputs)
        classes = value.shape[-1] if value.dim() else 0
        for i in [index] if isinstance(index, int) else index:  # (a loop, not a comprehension: on every call)
            if not -classes <= i < classes:
                raise IndexError(f"target {index!r}: class {i} is out of range for output {key!r}, which has "
                                 f"{classes} classes on its last dim (valid: {-classes} to {classes - 1})")
        picked = value.select(-1, index) if isinstance(index, int) else value[..., index]  # (select: a cheaper call)
        extra = picked.dim() - len(td.batch_size) - (0 if isinstance(index, int) else 1)
        if extra != 0:
            raise ValueError(
                f"target {index!r} reads output {key!r} of shape {tuple(value.shape)} as [*batch, classes], but the "
                f"batch is {list(td.batch_size)}: one value per sample would have shape "
                f"{[*td.batch_size, *([] if isinstance(index, int) else [len(index)])]}, not {list(picked.shape)}. "
                "If the inputs hold a batch, give their TensorDict that batch_size (TensorDict(..., "
                "batch_size=[len(x)])); to read a multi-dim output (tokens, pixels), pass a callable target"
            )
        return fresh_tensordict({key: picked}, td.batch_size)  # (a column of an entry of td)

    return select


def _is_index_tensor(index: torch.Tensor) -> bool:
    return not (index.is_floating_point() or index.is_complex() or index.dtype == torch.bool)


def values_readable(t: Any) -> bool:
    """Whether ``t``'s values can be read in Python: not batched by ``vmap``, not traced by ``torch.compile``."""
    if torch.compiler.is_compiling():
        return False
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):  # grad and vjp levels wrap too: those can be read
        if functorch.is_batchedtensor(t):
            return False
        t = functorch.get_unwrapped(t)
    return True


def _select_per_sample(index: torch.Tensor,
                       outputs: Sequence[NestedKey] | None) -> Callable[[TensorDictBase], TensorDictBase]:
    """``output[..., index[b]]`` per sample ``b``; ``index`` fills the trailing batch dims."""
    # NOTE [tensor targets]
    # The methods check at entry that ``index`` has the inputs' batch shape (or none). Here
    # it may fill only the *trailing* batch dims, because integrated gradients runs the
    # model on path points with a batch ``[n_steps, *B]``: every path point of a sample
    # uses that sample's class. The range is checked where the values can be read; under
    # ``vmap`` and ``torch.compile`` it is left to ``gather``.

    def select(td: TensorDictBase) -> TensorDictBase:
        key, value = _only_output(td, outputs)
        batch = td.batch_size
        if index.dim() > len(batch) or index.shape != batch[len(batch) - index.dim():]:
            raise ValueError(
                f"target: a tensor of class indices needs one index per sample, shape {list(batch)} (the inputs' "
                f"batch), got shape {list(index.shape)}"
            )
        if value.dim() != len(batch) + 1:
            raise ValueError(
                f"target: class indices read output {key!r} of shape {tuple(value.shape)} as [*batch, classes], "
                f"but the batch is {list(batch)}; to read a multi-dim output (tokens, pixels), pass a callable target"
            )
        classes = value.shape[-1]
        picked_index = index.to(value.device, torch.long)  # (uint8 compared with -classes would wrap around)
        negative = True
        if values_readable(picked_index) and picked_index.numel():  # one pass for the range: this runs on every call
            bounds = torch.aminmax(picked_index)
            low, high = int(bounds.min), int(bounds.max)
            if low < -classes or high >= classes:
                bad = low if low < -classes else high
                raise IndexError(f"target: class index {bad} is out of range for output {key!r} with {classes} "
                                 f"classes (valid: {-classes} to {classes - 1})")
            negative = low < 0
        if negative:
            picked_index = torch.where(picked_index < 0, picked_index + classes, picked_index)
        picked_index = picked_index.expand(batch)
        picked = value.gather(-1, picked_index.unsqueeze(-1)).squeeze(-1)
        return fresh_tensordict({key: picked}, batch)  # (a column of an entry of td)

    return select


def check_target(target: Any, batch_size: Sequence[int], caller: str = "attribution") -> None:
    """Raise unless ``target`` is a valid target for inputs with ``batch_size``.

    A tensor target must hold integer class indices, either one for all samples (0-d) or
    one per sample (shape ``batch_size``).

    Raises:
        TypeError: not a target, or a tensor that does not hold integers.
        ValueError: a tensor of class indices without the inputs' batch shape.
    """
    as_target(target)
    if isinstance(target, torch.Tensor) and target.dim() and target.shape != torch.Size(batch_size):
        raise ValueError(
            f"{caller}: target holds {list(target.shape)} class indices, but the inputs have batch shape "
            f"{list(batch_size)}: give one index per sample (e.g. target=model(x).argmax(-1)), or an int for all"
        )


def as_target(
    target: Target, *, outputs: Sequence[NestedKey] | None = None
) -> Callable[[TensorDictBase], TensorDictBase | torch.Tensor]:
    """The callable form of ``target``, the one rule every method follows.

    Args:
        target (int | tuple[int, ...] | Tensor | Callable): an index, several indices, an
            integer tensor of class indices with one per sample (shape ``[*B]``, or 0-d
            for all), or a callable ``outputs_td -> TensorDict`` (or a tensor).
        outputs (Sequence | None): the keys among which an index looks for the single
            output (methods pass the model's outputs, so extra keys such as labels do
            not count). Default: every key.

    Returns:
        Callable[[TensorDict], TensorDict]: the target values; for a tuple the last
        dimension holds one value per index. A callable ``target`` is returned as it is.

    Raises:
        TypeError: ``target`` is none of these, or a tensor of non-integer dtype.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> td = TensorDict(output=torch.arange(6.0).reshape(2, 3), batch_size=[2])
        >>> as_target((0, 2))(td)["output"]
        tensor([[0., 2.],
                [3., 5.]])
        >>> as_target(torch.tensor([2, 0]))(td)["output"]  # one class per sample
        tensor([2., 3.])
    """
    if isinstance(target, bool):
        raise TypeError("target must be an int, a tuple of ints, a tensor of class indices or a callable, not a bool")
    if isinstance(target, int):
        return _select(target, outputs)
    if isinstance(target, tuple):
        if not target or not all(isinstance(i, int) and not isinstance(i, bool) for i in target):
            raise TypeError(f"a tuple target must hold ints, got {target!r}")
        return _select(list(target), outputs)
    if isinstance(target, torch.Tensor):
        if not _is_index_tensor(target):
            raise TypeError(f"target: a tensor target holds integer class indices (one per sample), got "
                            f"{target.dtype}; convert whole numbers with .long(), or pass a callable target")
        return _select_per_sample(target, outputs)
    if callable(target):
        return target
    raise TypeError(
        f"target must be an int, a tuple of ints, a tensor of class indices or a callable, got {target!r}")


def label(key: NestedKey, output: NestedKey | None = None) -> Callable[[TensorDictBase], TensorDictBase]:
    """A target selecting, for each sample, the class index stored under ``key``.

    The TensorDict given to the target must hold ``key`` (integer labels, one per sample)
    and the output (``output``, or the single other entry).

    Args:
        key (NestedKey): the entry holding the integer labels.
        output (NestedKey | None): the output entry the labels index. Default: ``None``, the single
            entry other than ``key``.

    Raises:
        ValueError: a label is negative or not below the output's number of classes (the
            key, the bad labels and the number of classes named).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> td = TensorDict(output=torch.arange(6.0).reshape(2, 3), y=torch.tensor([2, 0]),
        ...                 batch_size=[2])
        >>> label("y")(td)["output"]
        tensor([2., 3.])
    """

    def select(td: TensorDictBase) -> TensorDictBase:
        labels: Any = td.get(key, None)
        if labels is None:
            raise KeyError(f"label({key!r}): the inputs have no {key!r} (keys: {list(td.keys(True, True))}); "
                           "put the labels in the input TensorDict under that key")
        if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex() \
                or labels.dtype == torch.bool:
            kind = labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__
            raise TypeError(f"label({key!r}): labels must be integer class indices, got {kind}; "
                            "convert them with .long() if they are whole numbers")
        if output is None:
            candidates = td.exclude(key)
            if len(list(candidates.keys(True, True))) != 1:
                names = [k for k in candidates.keys(True, True)]
                raise ValueError(f"label({key!r}): several candidate outputs {names}; name one with output=")
            out_key, value = _single_output(candidates)
        else:
            out_key, value = output, td.get(output)
        if labels.shape != value.shape[:-1]:
            raise ValueError(f"label({key!r}): labels have shape {tuple(labels.shape)}, but output {out_key!r} of "
                             f"shape {tuple(value.shape)} needs one label per sample: {tuple(value.shape[:-1])}")
        _check_labels(key, labels, value.shape[-1])
        picked = value.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
        return TensorDict({out_key: picked}, batch_size=td.batch_size)

    return select


def _check_labels(key: NestedKey, labels: torch.Tensor, classes: int) -> None:
    """Raise naming ``key`` and the bad values unless every label is a class index in ``[0, classes)``.

    Read where the values can be (NOTE [tensor targets]); under ``vmap`` and
    ``torch.compile`` the range is left to ``gather``.
    """
    if not values_readable(labels) or not labels.numel():
        return
    wrong = (labels < 0) | (labels >= classes)
    if bool(wrong.any()):
        bad = sorted({int(v) for v in labels[wrong].tolist()})
        raise ValueError(f"label({key!r}): labels {bad[:5]}{'...' if len(bad) > 5 else ''} are not class indices of "
                         f"the output, which has {classes} classes on its last dim (valid labels: 0 to {classes - 1})")
