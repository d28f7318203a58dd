"""``TaskVectors`` with the public API of ``tdhook.weights.task_vectors`` (tdhook 0.1.3).

Differences from tdhook 0.1.3 are listed in ``docs/compat.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from tensordict import TensorDictBase
from torch import nn

from tdhook_fn import params as params_of
from tdhook_fn._types import Replace
from tdhook_fn.compat.contexts import HookingContext, HookingContextFactory
from tdhook_fn.compat.modules import HookedModule
from tdhook_fn.compat.modules._scope import replacing
from tdhook_fn.compat.weights._running_weights import running_weights
from tdhook_fn.weights import apply_vectors, best_alpha, forget_vector, task_vector

__all__ = ["TaskVectors", "TaskVectorsContext", "TaskVectorsModule"]


class TaskVectorsContext(HookingContext):
    """The context of `TaskVectors` (its arguments by keyword after `HookingContext`'s): finds the best alpha."""

    def __init__(
        self,
        *args: Any,
        alphas: Iterable[float],
        get_test_accuracy: Callable[[nn.Module], float],
        get_control_adequacy: Callable[[nn.Module], bool],
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.alphas = alphas
        self.get_test_accuracy = get_test_accuracy
        self.get_control_adequacy = get_control_adequacy

    def compute_alpha(self, vector: TensorDictBase) -> float:
        """The alpha of highest test accuracy among those with adequate control (ties: the earliest), as tdhook.

        Raises:
            RuntimeError: outside the context, or no alpha is adequate.
        """
        hooked = self._hooked_module
        if hooked is None or not self._in_context:
            raise RuntimeError("Cannot compute alpha outside of context")
        if not isinstance(hooked, TaskVectorsModule):
            raise TypeError(f"compute_alpha needs a TaskVectorsModule, the context made a {type(hooked).__name__}")
        adequate: list[float] = []
        scores: list[float] = []
        for alpha in self.alphas:
            with hooked.with_applied_vectors(vector, alpha=alpha) as module:
                if self.get_control_adequacy(module):
                    adequate.append(alpha)
                    scores.append(self.get_test_accuracy(module))
        chosen = best_alpha(adequate, scores, [True] * len(adequate))
        return next(alpha for alpha in adequate if float(alpha) == chosen)  # the alpha as given


class TaskVectorsModule(HookedModule):
    """The hooked module of `TaskVectors`; the weights the model runs with on entry are the base of every vector
    (over another context's hooked module, its weights: pruned, or a block's applied vectors, as tdhook reads them
    from the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        target = self.module  # tdhook's vectors are keyed from the module the wrappers hold
        if not isinstance(target, nn.Module):
            raise TypeError(f"TaskVectors needs an nn.Module to take weights from, got {type(target).__name__}")
        self._target = target
        self._weights = running_weights(self.td_module, target, detach=True)

    def get_task_vector(self, finetuned_module: nn.Module) -> TensorDictBase:
        """``params(finetuned_module) - params(model)``; ValueError when their keys or shapes differ."""
        return task_vector(self._weights, params_of(finetuned_module))

    def get_forget_vector(self, finetuned_module: nn.Module) -> TensorDictBase:
        """``params(model) - params(finetuned_module)``, the negated task vector."""
        return forget_vector(self._weights, params_of(finetuned_module))

    def get_weights(self, *vectors: TensorDictBase, alpha: float | None = None) -> TensorDictBase:
        """``params(model) + alpha * sum(vectors)``.

        Args:
            *vectors (TensorDict): keyed like the model's params.
            alpha (float | None): the scaling. Default: the context's
                `TaskVectorsContext.compute_alpha` of ``sum(vectors)``.

        Raises:
            RuntimeError: ``alpha`` is ``None`` and the module was not made by
                `TaskVectors` (or no alpha is adequate).
        """
        if alpha is None:
            context = self.hooking_context
            if context is None or not isinstance(context, TaskVectorsContext):
                raise RuntimeError("Module was not prepared with TaskVectors")
            alpha = context.compute_alpha(self._sum(vectors))
        return apply_vectors(self._weights, *vectors, alpha=alpha)

    def _sum(self, vectors: tuple[TensorDictBase, ...]) -> TensorDictBase:
        if not vectors:
            return cast(TensorDictBase, self._weights.apply(torch.zeros_like))
        return cast(TensorDictBase, sum(vectors[1:], vectors[0]))

    @contextmanager
    def with_applied_vectors(self, *vectors: TensorDictBase, alpha: float | None = None) -> Iterator[TaskVectorsModule]:
        """Yield this module, whose calls run the model with `get_weights` meanwhile (NOTE [one scope])."""
        weights = self.get_weights(*vectors, alpha=alpha)
        tensors = (*self._target.named_parameters(), *self._target.named_buffers())
        values = [(tensor, weights.get(tuple(name.split(".")), None)) for name, tensor in tensors]
        applied = [(tensor, _constant(value)) for tensor, value in values if value is not None]
        with replacing(*applied):
            yield self


def _constant(value: torch.Tensor) -> Replace:
    return lambda _: value


class TaskVectors(HookingContextFactory):
    """Task vectors (Ilharco et al. 2022), as tdhook's ``TaskVectors``.

    Args:
        alphas (Iterable[float]): the scalings tried by ``compute_alpha``.
        get_test_accuracy (Callable[[nn.Module], float]): score of a module on the task.
        get_control_adequacy (Callable[[nn.Module], bool]): whether a module is still
            acceptable on the control task.

    Examples:
        >>> import copy, torch
        >>> net = torch.nn.Linear(2, 1)
        >>> tuned = copy.deepcopy(net)
        >>> with torch.no_grad():
        ...     _ = tuned.bias.add_(1.0)
        >>> factory = TaskVectors([0.5, 1.0], lambda m: 0.0, lambda m: True)
        >>> with factory.prepare(net) as hooked:
        ...     vector = hooked.get_task_vector(tuned)
        ...     torch.equal(hooked.get_weights(vector, alpha=1.0)["bias"], tuned.bias.detach())
        True
    """

    _hooking_context_class = TaskVectorsContext
    _hooked_module_class = TaskVectorsModule

    def __init__(
        self,
        alphas: Iterable[float],
        get_test_accuracy: Callable[[nn.Module], float],
        get_control_adequacy: Callable[[nn.Module], bool],
    ) -> None:
        super().__init__()
        self._hooking_context_kwargs.update(
            alphas=alphas, get_test_accuracy=get_test_accuracy, get_control_adequacy=get_control_adequacy
        )
