"""Weight methods with the public API of ``tdhook.weights`` (tdhook 0.1.3).

Every number comes from `tdhook_fn.weights`; none of these classes writes the user's
model (see ``docs/compat.md``).
"""

from .adapters import Adapters
from .pruning import Pruning
from .task_vectors import TaskVectors

__all__ = ["Adapters", "Pruning", "TaskVectors"]
