"""Probing with the public API of ``tdhook.latent.probing`` (tdhook 0.1.3).

`Probing` hands the activations of the modules whose name matches a pattern to probes
(anything with ``step(activation, **items)``), read through the hooked module's virtual
hooks: the model never carries a hook. `ProbeManager` and `BilinearProbeManager` make
one probe per module (or module pair) and collect their metrics. The estimators fit
through pure functions of `tdhook_fn.latent`: `MeanDifferenceClassifier` in closed
form, `LinearEstimator`, `BilinearEstimator` and `LowRankBilinearEstimator` by the
same minibatch Adam as tdhook's, without its data loader (``BilinearEstimator`` and
``TorchEstimator`` live in ``.estimators``, as in tdhook).
"""

from .context import Probing
from .estimators import LinearEstimator, LowRankBilinearEstimator, MeanDifferenceClassifier
from .managers import BilinearProbe, BilinearProbeManager, Probe, ProbeManager

__all__ = [
    "BilinearProbe",
    "BilinearProbeManager",
    "LinearEstimator",
    "LowRankBilinearEstimator",
    "MeanDifferenceClassifier",
    "Probe",
    "ProbeManager",
    "Probing",
]
