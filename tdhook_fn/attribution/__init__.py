"""Gradient attribution as pure functions: ``method(f, params, inputs, ..., *, target)``.

Every method runs ``f`` once under one VJP,
works for one sample or any batch size, under ``vmap``, and composes with ``grad``
with respect to params.
"""

from ._activation_maximisation import activation_maximisation, pgd_step
from ._convergence import convergence_delta
from ._grad_cam import DimsConfig, grad_cam
from ._guided_backprop import guided_backprop, module_paths
from ._integrated_gradients import integrated_gradients
from ._internal_influence import internal_influence
from ._layer_conductance import layer_conductance
from ._lrp import lrp, rule_taps
from ._lrp_composites import EpsilonPlus, RuleMapper, Rules
from ._lrp_rules import (
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
from ._quadrature import SUPPORTED_METHODS, quadrature
from ._saliency import saliency

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
    "grad_cam",
    "guided_backprop",
    "integrated_gradients",
    "internal_influence",
    "layer_conductance",
    "lrp",
    "module_paths",
    "neuron_conductance",
    "pgd_step",
    "quadrature",
    "rule_taps",
    "saliency",
    "stabilize",
]
