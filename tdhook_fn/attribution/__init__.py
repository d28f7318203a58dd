"""Gradient attribution as pure functions: ``method(f, params, inputs, ..., *, target)``.

Every method runs ``f`` once under ``torch.func.vjp`` (see NOTE [attribution engine]),
works for one sample or any batch size, under ``vmap``, and composes with ``grad``
with respect to params.
"""

from ._grad_cam import DimsConfig, grad_cam
from ._guided_backprop import guided_backprop, module_paths
from ._integrated_gradients import integrated_gradients
from ._quadrature import SUPPORTED_METHODS, quadrature
from ._saliency import saliency

__all__ = [
    "SUPPORTED_METHODS",
    "DimsConfig",
    "grad_cam",
    "guided_backprop",
    "integrated_gradients",
    "module_paths",
    "quadrature",
    "saliency",
]
