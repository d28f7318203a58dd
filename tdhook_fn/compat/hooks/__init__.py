"""Hook helpers with the public API of ``tdhook.hooks`` from tdhook 0.1.3.

Submodule paths are never evaluated (`tdhook_fn.resolve_path`); differences from tdhook
0.1.3 are listed in ``docs/compat.md``.
"""

from ._caching import CacheProxy, EarlyStoppingException, HookFactory, MutableWeakRef, TensorDictRef
from ._registration import (
    DIRECTION_TO_PARAMS,
    DIRECTION_TO_RETURN,
    DIRECTION_TO_RETURN_INDEX,
    DIRECTION_TO_TYPE,
    HookDirection,
    MultiHookHandle,
    MultiHookManager,
    RemovableHandleProtocol,
    T,
    _check_hook_signature,
    merge_paths,
    register_hook_to_module,
    resolve_submodule_path,
    submodule_path_to_name,
)

__all__ = [
    "DIRECTION_TO_PARAMS",
    "DIRECTION_TO_RETURN",
    "DIRECTION_TO_RETURN_INDEX",
    "DIRECTION_TO_TYPE",
    "CacheProxy",
    "EarlyStoppingException",
    "HookDirection",
    "HookFactory",
    "MultiHookHandle",
    "MultiHookManager",
    "MutableWeakRef",
    "RemovableHandleProtocol",
    "T",
    "TensorDictRef",
    "_check_hook_signature",
    "merge_paths",
    "register_hook_to_module",
    "resolve_submodule_path",
    "submodule_path_to_name",
]
