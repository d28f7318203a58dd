"""``tdhook.latent.representation_similarity`` (tdhook 0.1.3): CKA and information imbalance.

Both estimators are TensorDict modules reading two keys and computing through
`tdhook_fn.latent.similarity`.
"""

from .cka import CkaEstimator
from .information_imbalance import InformationImbalanceEstimator

__all__ = ["CkaEstimator", "InformationImbalanceEstimator"]
