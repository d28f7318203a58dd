"""Hooked modules with the public API of ``tdhook.modules`` from tdhook 0.1.3.

No torch hook is ever registered on the user's model: ``set``, ``get``, ``stop`` and
their variants record virtual hooks (NOTE [virtual hooks]), attached to the private
shadow each call runs on. Differences from tdhook 0.1.3 are listed in ``docs/compat.md``.

Hand-off to method classes. A factory's ``_prepare_module(module, ...)`` receives a
`RoutedModule`: the model, routed. At call time (inside the prepared module's
forward, while the hooked module runs) ``module.functional()`` is the model as a pure
`tdhook_fn.Functional` ``f(params, td)`` whose taps are the virtual hooks
registered at that moment, ``module.params()`` its live parameters (``params(detach=True)``
a detached snapshot), and ``module.model`` the user's model that hook keys and ``f``'s
paths are relative to. A method that runs the model with other weights gives them to the
hooked module's calls, never to the model, as replacements of the model's tensors:
``module.replacing([(parameter, fn), ...])`` (NOTE [one scope]).

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tdhook_fn.compat.contexts import HookingContextFactory
    >>> class Doubled(HookingContextFactory):
    ...     def _prepare_module(self, module, in_keys, out_keys, extra_relative_path):
    ...         def doubled(td):
    ...             f, params = module.functional(), module.params()
    ...             td["doubled"] = 2 * f(params, td)["output"]
    ...             return td
    ...         return FunctionModule(doubled, in_keys, [*out_keys, "doubled"])
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    >>> with Doubled().prepare(model) as hooked:
    ...     handle = hooked.set("[0]", torch.ones(1, 2))
    ...     hooked(TensorDict(input=torch.zeros(1, 3), batch_size=[1]))["doubled"]
    tensor([[2., 2.]])
"""

from tdhook_fn.compat.hooks import (
    DIRECTION_TO_TYPE,
    CacheProxy,
    EarlyStoppingException,
    HookDirection,
    HookFactory,
    MutableWeakRef,
    TensorDictRef,
    register_hook_to_module,
    resolve_submodule_path,
)

from ._hooked import HookedModule
from ._pgd import PGDModule
from ._routed import RoutedModule
from ._run import HookedModuleRun
from ._scope import Replacement, replacing
from ._virtual import VirtualHookHandle, VirtualHooks
from ._wrappers import (
    FunctionModule,
    IntermediateKeysCleaner,
    ModuleCall,
    ModuleCallWithCache,
    flatten_select_reshape_call,
    get_best_device,
)

__all__ = [
    "DIRECTION_TO_TYPE",
    "CacheProxy",
    "EarlyStoppingException",
    "FunctionModule",
    "HookDirection",
    "HookFactory",
    "HookedModule",
    "HookedModuleRun",
    "IntermediateKeysCleaner",
    "ModuleCall",
    "ModuleCallWithCache",
    "MutableWeakRef",
    "PGDModule",
    "Replacement",
    "RoutedModule",
    "TensorDictRef",
    "VirtualHookHandle",
    "VirtualHooks",
    "flatten_select_reshape_call",
    "get_best_device",
    "register_hook_to_module",
    "replacing",
    "resolve_submodule_path",
]
