"""Surrogate-model attribution as pure functions: KernelSHAP and LIME.

Both fit a weighted linear model of the target on interpretable samples (which
features of the input are kept, the rest set to a baseline), equal to captum's
``KernelShap`` and ``Lime`` given the same samples. Every perturbed input of a call runs
through the model in one batched forward (``chunk_size`` per input sample at a time),
and the linear models of every sample and target are fitted in one batched solve.
"""

from ._kernel_shap import kernel_shap, shapley_kernel_samples
from ._lime import lime

__all__ = ["kernel_shap", "lime", "shapley_kernel_samples"]
