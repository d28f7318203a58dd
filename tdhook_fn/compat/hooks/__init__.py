"""Hook helpers with the public API of ``tdhook.hooks`` from tdhook 0.1.3.

Names, signatures, defaults, error types and runtime behaviour follow tdhook, with one
deliberate exception: submodule paths are never evaluated. ``resolve_submodule_path``
walks them with `tdhook_fn.resolve_path` (which never evaluates a path), so a
malformed or malicious path, or one calling anything but ``get_submodule``,
``get_parameter``, ``get_buffer`` and the methods the user's own module classes define
(such as ``"train(False)"`` or ``"checkpoint.unlink()"``), raises
`tdhook_fn.PathError` (a ``ValueError``) before any call in it runs.
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
