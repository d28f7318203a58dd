"""Weight methods as parameter arithmetic: task vectors, pruning masks, adapters.

Every function takes and returns params TensorDicts (see `tdhook_fn.params`);
none of them changes a model or copies its weights beyond the results.
"""

from ._adapters import Adapted, Adapter, adapter_params, with_adapters
from ._pruning import apply_masks, default_skip, global_unstructured_masks, ln_structured_mask, pruning_scores
from ._sweep import sweep_alphas
from ._task_vectors import apply_vectors, best_alpha, forget_vector, task_vector

__all__ = [
    "Adapted",
    "Adapter",
    "adapter_params",
    "apply_masks",
    "apply_vectors",
    "best_alpha",
    "default_skip",
    "forget_vector",
    "global_unstructured_masks",
    "ln_structured_mask",
    "pruning_scores",
    "sweep_alphas",
    "task_vector",
    "with_adapters",
]
