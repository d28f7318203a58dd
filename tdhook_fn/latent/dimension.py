"""Intrinsic dimension of activations, every layer (or seed, or checkpoint) in one batched op.

Each estimator takes points ``x`` of shape ``(..., N, D)``: the leading dims are batch
dims (one cloud of ``N`` points in ``D`` dimensions each, say one per layer), computed
together in one ``topk`` over one batched distance matrix, no Python loop; each works
under `torch.vmap` and keeps float64.

- `two_nn`: one dimension per cloud from the ratio of the two nearest neighbour
  distances (Facco et al. 2017).
- `local_knn`: a dimension per point from the k-th and 2k-th neighbour distances
  (Farahmand et al. 2007).
- `local_pca`: a dimension per point from the PCA spectrum of its neighbourhood; the
  default criterion holds on noisy data.
- `ca_pca`: local PCA calibrated for curvature (Gilbert and O'Neill 2023).
- `spectrum_dimension`: the dimension a PCA spectrum shows, by `local_pca`'s criteria.

Points closer than ``eps`` to each other are duplicates and are not neighbours (as in
tdhook 0.1.3); a point left with too few neighbours gets ``nan``, as documented on each.

Examples:
    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> layers = torch.randn(4, 1000, 3, generator=g) @ torch.randn(3, 32, generator=g)  # 4 "layers", rank 3
    >>> two_nn(layers).round()
    tensor([3., 3., 3., 3.])
    >>> local_pca(layers, 20).median(dim=-1).values
    tensor([3., 3., 3., 3.])
"""

from ._ca_pca import ca_pca
from ._local_knn import local_knn
from ._local_pca import local_pca, spectrum_dimension
from ._twonn import two_nn

__all__ = ["ca_pca", "local_knn", "local_pca", "spectrum_dimension", "two_nn"]
