"""Latent methods with the public API of ``tdhook.latent`` (tdhook 0.1.3).

Differences from tdhook 0.1.3 are listed in ``docs/compat.md``.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> with ActivationCaching("[0-9]").prepare(model) as hooked:
    ...     _ = hooked(TensorDict(input=torch.randn(5, 3), batch_size=[5]))
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
