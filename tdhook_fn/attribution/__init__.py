"""Gradient attribution as pure functions: ``method(f, params, inputs, ..., *, target)``.

Every method runs ``f`` once under one VJP,
works for one sample or any batch size, under ``vmap``, and composes with ``grad``
with respect to params.
"""

from ._activation_maximisation import activation_maximisation, pgd_step
from ._baselines import SUPPORTED_METHODS, quadrature
from ._convergence import convergence_delta
from ._deconvolution import deconvolution, relu_paths
from ._deeplift import deeplift, layer_deeplift
from ._deeplift_shap import deeplift_shap
from ._feature_ablation import feature_ablation
from ._feature_permutation import feature_permutation
from ._grad_cam import DimsConfig, grad_cam
from ._gradient_shap import gradient_shap
from ._guided_backprop import guided_backprop, module_paths
from ._guided_grad_cam import guided_grad_cam
from ._integrated_gradients import integrated_gradients
from ._internal_influence import internal_influence
from ._kernel_shap import kernel_shap, shapley_kernel_samples
from ._layer_conductance import layer_conductance
from ._lime import lime
from ._lrp.composites import EpsilonPlus, RuleMapper, Rules
from ._lrp.method import lrp, rule_taps
from ._lrp.rules import (
    AHQKV,
    AlphaBeta,
    Epsilon,
    Flat,
    Ignore,
    LayerNorm,
    ModuleCall,
    Pass,
    PseudoIdentity,
    Rule,
    SoftmaxEpsilon,
    Stop,
    Uniform,
    UniformEpsilon,
    WSquare,
    ZPlus,
    stabilize,
)
from ._neuron_conductance import neuron_conductance
from ._occlusion import occlusion
from ._saliency import saliency
from ._shapley_value_sampling import shapley_value_sampling
from ._smoothgrad import smoothgrad

__all__ = [
    "AHQKV",
    "SUPPORTED_METHODS",
    "AlphaBeta",
    "DimsConfig",
    "Epsilon",
    "EpsilonPlus",
    "Flat",
    "Ignore",
    "LayerNorm",
    "ModuleCall",
    "Pass",
    "PseudoIdentity",
    "Rule",
    "RuleMapper",
    "Rules",
    "SoftmaxEpsilon",
    "Stop",
    "Uniform",
    "UniformEpsilon",
    "WSquare",
    "ZPlus",
    "activation_maximisation",
    "convergence_delta",
    "deconvolution",
    "deeplift",
    "deeplift_shap",
    "feature_ablation",
    "feature_permutation",
    "grad_cam",
    "gradient_shap",
    "guided_backprop",
    "guided_grad_cam",
    "integrated_gradients",
    "internal_influence",
    "kernel_shap",
    "layer_conductance",
    "layer_deeplift",
    "lime",
    "lrp",
    "module_paths",
    "neuron_conductance",
    "occlusion",
    "pgd_step",
    "quadrature",
    "relu_paths",
    "rule_taps",
    "saliency",
    "shapley_kernel_samples",
    "shapley_value_sampling",
    "smoothgrad",
    "stabilize",
]
