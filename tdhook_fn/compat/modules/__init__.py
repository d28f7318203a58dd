"""Hooked modules with the public API of ``tdhook.modules`` from tdhook 0.1.3.

No torch hook is ever registered on the user's model (NOTE [virtual hooks]). A factory's
``_prepare_module`` receives a `RoutedModule`, which gives a method the model as a pure
function at call time. Differences from tdhook 0.1.3 are listed in ``docs/compat.md``.

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
from tdhook_fn.compat.hooks._registration import VirtualHookHandle, VirtualHooks

from ._hooked import HookedModule, RoutedModule
from ._pgd import PGDModule
from ._run import HookedModuleRun
from ._scope import Replacement, replacing
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
