"""Reading and editing the internals of a model as pure functions: caching, patching, steering.

Every method takes a `tdhook_fn.Functional` ``f``, its params and inputs with any
batch size, and never touches the model. A `Site` names where (a path, a tuple
element, a selection within one sample); `sites` expands a regex over module names.

- `cache`: activations at sites.
- `patch`: outputs with activations replaced (from a cache of a clean run, or
  ``fn(current, source)``).
- `patching_sweep`: the metric with each site patched in turn, all runs batched.
- `attribution_patching`: every patching effect to first order, one backward.
- `steer` and `activation_addition`: steering vectors, several scales at once.

Pure statistics of cached activations, every layer (or pair of layers) in one batched op,
live in three submodules: `tdhook_fn.latent.probing` (linear and bilinear probes),
`tdhook_fn.latent.dimension` (intrinsic dimension) and `tdhook_fn.latent.similarity`
(CKA, information imbalance).
"""

from . import dimension, probing, similarity
from ._attribution_patching import attribution_patching
from ._cache import cache
from ._patch import patch, patching_sweep
from ._sites import Site, sites
from ._steer import activation_addition, steer

__all__ = [
    "Site",
    "activation_addition",
    "attribution_patching",
    "cache",
    "dimension",
    "patch",
    "patching_sweep",
    "probing",
    "similarity",
    "sites",
    "steer",
]
