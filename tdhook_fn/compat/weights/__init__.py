"""Weight methods with the public API of ``tdhook.weights`` from tdhook 0.1.3.

Every number comes from the pure functions of `tdhook_fn.weights`; these classes only
give them tdhook's context-manager shape. `Pruning` prunes the user's model in place
while its context is open and restores it bit for bit on exit; `TaskVectors` and
`Adapters` never change the model (see the NOTEs in their modules).
"""

from .adapters import Adapters
from .pruning import Pruning
from .task_vectors import TaskVectors

__all__ = ["Adapters", "Pruning", "TaskVectors"]
