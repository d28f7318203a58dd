"""Metrics of explanations as pure functions: infidelity and max-sensitivity (Yeh et al. 2019).

Both equal captum's ``captum.metrics`` given the same perturbations, and evaluate all
perturbations of a chunk in one batched call (NOTE [metric samples] in
``tdhook_fn.attribution._metric_samples``). The perturbation functions are user code
and own their randomness: `uniform_perturbation` and `normal_perturbation` take a
``generator``.
"""

from ._infidelity import infidelity
from ._metric_samples import normal_perturbation, uniform_perturbation
from ._sensitivity import sensitivity_max

__all__ = ["infidelity", "normal_perturbation", "sensitivity_max", "uniform_perturbation"]
