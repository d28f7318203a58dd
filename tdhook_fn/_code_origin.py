"""Whether a function is the user's own code or an installed library's: NOTE [user code]."""

# NOTE [user code]
# A submodule path may call a method only where the user wrote it (NOTE [path calls] in
# ``_path_calls.py``). A function is *library code* when, after ``functools.wraps``
# wrappers are unwrapped (``torch.no_grad`` on a user method leaves it the user's), either
#
# - its module's top-level package is torch, tensordict, transformers, tdhook or tdhook_fn
#   (also from a source checkout, where no ``site-packages`` is in the path), or
# - its source file (for generated or frozen code such as ``<string>``, its module's file)
#   lies in a ``site-packages`` or ``dist-packages`` directory, or under the interpreter's
#   standard library or installation directories (``sysconfig``), or
# - it has no source file and its module is a standard library module (frozen or built in).
#
# Files decide, not module names: a user's own ``test.py`` or ``code.py`` is user code
# although the standard library has modules of those names. Code of ``__main__`` without a
# file (a REPL, ``python -c``) is user code.
#
# Everything else is user code: scripts, notebooks, the user's packages in a source tree or
# an editable install, and this project's tests. A user package installed into
# ``site-packages`` counts as a library: its methods cannot be called from a path.

from __future__ import annotations

import functools
import inspect
import os
import site
import sys
import sysconfig
from typing import Any

__all__ = ["library_of"]

_LIBRARY_PACKAGES = frozenset({"torch", "tensordict", "transformers", "tdhook", "tdhook_fn"})
_PACKAGE_DIRS = frozenset({"site-packages", "dist-packages"})


@functools.cache
def _install_roots() -> tuple[str, ...]:
    """The standard library's and the installations' directories, each ending in a separator."""
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    roots.update(site.getsitepackages() if hasattr(site, "getsitepackages") else ())
    return tuple(sorted({os.path.join(os.path.realpath(root), "") for root in roots}))


def _installed_file(filename: str) -> bool:
    real = os.path.realpath(filename)
    return bool(_PACKAGE_DIRS.intersection(real.split(os.sep))) or real.startswith(_install_roots())


def library_of(func: Any) -> str | None:
    """The module of the library that defines ``func`` (see NOTE [user code]); ``None`` for user code.

    >>> import pathlib, torch
    >>> library_of(pathlib.Path.unlink), library_of(torch.nn.Module.train)
    ('pathlib', 'torch.nn.modules.module')
    """
    try:
        inner = inspect.unwrap(func)
    except ValueError:  # a cycle of __wrapped__
        inner = func
    module = getattr(inner, "__module__", None) or ""
    top = module.partition(".")[0]
    if top in _LIBRARY_PACKAGES:
        return module
    code = getattr(inner, "__code__", None)
    filename = getattr(code, "co_filename", "") or ""
    if filename.startswith("<") and module != "__main__":  # generated or frozen code: where its module lives
        filename = getattr(sys.modules.get(module), "__file__", None) or ""
    if filename and not filename.startswith("<"):
        return (module or filename) if _installed_file(filename) else None
    # no source file: a frozen or built-in standard library module, or the user's REPL
    return module if top in sys.stdlib_module_names else None
