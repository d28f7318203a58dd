"""Attribution contexts with the API of ``tdhook.attribution`` (tdhook 0.1.3).

Each class is a `HookingContextFactory` whose numbers come from `tdhook_fn.attribution`
(see ``gradient_helpers.common``); differences from tdhook 0.1.3 are listed in ``docs/compat.md``.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    >>> td = TensorDict(input=torch.randn(5, 3), batch_size=[5])
    >>> with Saliency(input_modules=["[1]"]).prepare(model) as hooked:
    ...     out = hooked(td)
    >>> out["attr", "input"].shape, out["attr", "[1]"].shape
    (torch.Size([5, 3]), torch.Size([5, 4]))
"""

from . import lrp_helpers
from .activation_maximisation import ActivationMaximisation
from .grad_cam import GradCAM
from .guided_backpropagation import GuidedBackpropagation
from .integrated_gradients import IntegratedGradients
from .lrp import LRP
from .saliency import Saliency

__all__ = [
    "LRP", "ActivationMaximisation", "GradCAM", "GuidedBackpropagation", "IntegratedGradients", "Saliency",
    "lrp_helpers",
]
