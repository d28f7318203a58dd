"""Latent methods with the public API of ``tdhook.latent`` from tdhook 0.1.3.

Also tdhook's probing, dimension estimation and representation similarity
(``probing``, ``dimension_estimation``, ``representation_similarity``), computing with
`tdhook_fn.latent.probing`, `tdhook_fn.latent.dimension` and `tdhook_fn.latent.similarity`.

`ActivationPatching` and `ActivationAddition` compute with
`tdhook_fn.latent.cache`, `patch` and
`activation_addition`; `ActivationCaching` and
`SteeringVectors` are tdhook's hooks, registered as virtual hooks (see NOTE
[caching is hooks] in ``activation_caching.py``). None of them registers a hook on the
model or changes it. The differences from tdhook 0.1.3 are listed in each module.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> td = TensorDict({"input": torch.randn(5, 3), ("patched", "input"): torch.randn(5, 3)}, batch_size=[5])
    >>> with ActivationPatching(["[2]"]).prepare(model) as hooked:
    ...     out = hooked(td)
    >>> torch.equal(out["patched", "output"], out["output"])  # the last module patched: the clean output
    True
    >>> with ActivationCaching("[0-9]").prepare(model) as hooked:
    ...     _ = hooked(td.select("input"))
    >>> sorted(hooked.hooking_context.cache.keys())
    ['0', '1', '2']
"""

from .activation_caching import ActivationCaching
from .activation_patching import ActivationPatching
from .dimension_estimation import LocalKnnDimensionEstimator, TwoNnDimensionEstimator
from .probing import (
    BilinearProbe,
    BilinearProbeManager,
    LinearEstimator,
    LowRankBilinearEstimator,
    MeanDifferenceClassifier,
    Probe,
    ProbeManager,
    Probing,
)
from .representation_similarity import CkaEstimator, InformationImbalanceEstimator
from .steering_vectors import ActivationAddition, SteeringVectors

__all__ = [
    "ActivationAddition",
    "ActivationCaching",
    "ActivationPatching",
    "BilinearProbe",
    "BilinearProbeManager",
    "CkaEstimator",
    "InformationImbalanceEstimator",
    "LinearEstimator",
    "LocalKnnDimensionEstimator",
    "LowRankBilinearEstimator",
    "MeanDifferenceClassifier",
    "Probe",
    "ProbeManager",
    "Probing",
    "SteeringVectors",
    "TwoNnDimensionEstimator",
]
