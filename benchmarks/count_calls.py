"""Python calls (and distinct files) a compat integrated-gradients context call makes.

Counts every Python-level call whose code lives in a package's own files, with
``sys.setprofile``, for one ``hooked(td)`` after a warm-up call, and compares it with the
pure `tdhook_fn.attribution.integrated_gradients` on the same model and, where they
are installed, with tdhook 0.1.3's and captum's ``IntegratedGradients``.

Run: ``python -m benchmarks.count_calls``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

__all__ = ["compat_ig_call", "count_calls", "pure_ig_call"]


def count_calls(fn: Callable[[], Any], package_dir: str) -> tuple[int, set[str]]:
    """How many Python calls ``fn()`` makes into files under ``package_dir``, and those files."""
    package_dir = os.path.realpath(package_dir) + os.sep
    calls = 0
    files: set[str] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(package_dir):
                calls += 1
                files.add(name[len(package_dir):])

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls, files


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _td() -> TensorDict:
    x = torch.randn(2, 4)
    return TensorDict(input=x, baseline=TensorDict(input=torch.zeros_like(x), batch_size=[2]), batch_size=[2])


def compat_ig_call() -> tuple[int, set[str]]:
    """The compat call ``with IntegratedGradients().prepare(model) as h: h(td)``."""
    import tdhook_fn
    from tdhook_fn.compat.attribution import IntegratedGradients

    model = _model()

    def call() -> None:
        with IntegratedGradients(init_attr_targets=_first_class).prepare(model) as hooked:
            hooked(_td())

    call()  # warm-up: caches, first-time imports
    return count_calls(call, os.path.dirname(tdhook_fn.__file__))


def pure_ig_call() -> tuple[int, set[str]]:
    """The pure `integrated_gradients` call the compat one makes."""
    import tdhook_fn
    from tdhook_fn.attribution import integrated_gradients

    model = _model()
    f = tdhook_fn.functional(model)
    td = _td()

    def call() -> None:
        integrated_gradients(f, tdhook_fn.params(model), td.select("input"), td["baseline"],
                             target=_first_class, multiply_by_inputs=False)

    call()
    return count_calls(call, os.path.dirname(tdhook_fn.__file__))


def _first_class(outputs: TensorDict, additional: TensorDict | None = None) -> TensorDict:
    return outputs.apply(lambda value: value[..., 0])


def _oracle(module: str) -> tuple[int, set[str]] | None:
    try:
        package = __import__(module)
    except ImportError:
        return None
    model = _model()
    if module == "tdhook":
        from tdhook.attribution import IntegratedGradients as TdIG

        def call() -> None:
            with TdIG(init_attr_targets=_first_class).prepare(model) as hooked:
                hooked(_td())
    else:
        from captum.attr import IntegratedGradients as CaptumIG

        x = torch.randn(2, 4)

        def call() -> None:
            CaptumIG(model).attribute(x, torch.zeros_like(x), target=0)

    call()
    return count_calls(call, os.path.dirname(package.__file__))


def main() -> None:
    for name, result in (("compat IG context call", compat_ig_call()), ("pure integrated_gradients", pure_ig_call()),
                         ("tdhook 0.1.3", _oracle("tdhook")), ("captum", _oracle("captum"))):
        if result is None:
            print(f"{name}: not installed")
            continue
        calls, files = result
        print(f"{name}: {calls} calls across {len(files)} files")
        if "-v" in sys.argv:
            for file in sorted(files):
                print(f"    {file}")


if __name__ == "__main__":
    main()
