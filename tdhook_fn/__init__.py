"""tdhook_fn: interpretability for PyTorch models as pure functions over ``torch.func``.

The core: `params` (a model's tensors as a TensorDict), `call` (run a model
with given params, never touching it), `functional` (a pure ``f(params, td) -> td``),
`pure` (both at once: ``f, params = pure(model)``), submodule paths, taps and
targets. Methods live in `tdhook_fn.attribution` and `tdhook_fn.weights`;
`tdhook_fn.compat` exposes tdhook's API on top.
"""

from ._functional import Functional, call, call_with_taps, functional, pure
from ._params import params
from ._paths import PathError, parse_path, path_to_name, resolve_path
from ._taps import Tap, capture, intervene, map_grad, perturb
from ._targets import Target, as_target, label

__all__ = [
    "Functional",
    "PathError",
    "Tap",
    "Target",
    "as_target",
    "call",
    "call_with_taps",
    "capture",
    "functional",
    "intervene",
    "label",
    "map_grad",
    "params",
    "parse_path",
    "path_to_name",
    "perturb",
    "pure",
    "resolve_path",
]

__version__ = "0.1.0"
