"""``ActivationMaximisation`` (``tdhook.attribution.activation_maximisation``): gradient ascent on the inputs.

Differences from tdhook 0.1.3 are listed in ``docs/compat.md``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tensordict import NestedKey, TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import nn

from tdhook_fn import resolve_path
from tdhook_fn._paths import PathError
from tdhook_fn.attribution import activation_maximisation
from tdhook_fn.compat.modules import RoutedModule
from tdhook_fn.compat.modules._scope import module_path

from .gradient_helpers import GradientAttribution
from .gradient_helpers.common import Attributing, AttributionCall, UserFn, inherited, make_target

__all__ = ["ActivationMaximisation"]


class ActivationMaximisation(GradientAttribution):
    """Activation maximisation (Mahendran & Vedaldi 2015): inputs that excite modules most.

    Computed by `tdhook_fn.attribution.activation_maximisation` (``alpha``, ``n_steps``,
    ``min_value`` and ``max_value`` are its arguments), the final inputs under ``(attribution_key,
    in_key)``. The other arguments are those of `GradientAttribution` (``init_attr_targets`` sees the
    module activations by path).

    Args:
        modules_to_maximise (list[str]): paths from the context's ``TensorDictModule``
            (``"module[2]"`` for a plain model).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> td = TensorDict(input=torch.randn(5, 3), batch_size=[5])
        >>> with ActivationMaximisation(["module[2]"], n_steps=3, max_value=1.0).prepare(model) as hooked:
        ...     out = hooked(td)
        >>> out["attr", "input"].shape, bool(out["attr", "input"].max() <= 1.0)
        (torch.Size([5, 3]), True)
    """

    _targets_of_its_own = True  # the modules to maximise

    def __init__(
        self,
        modules_to_maximise: list[str],
        alpha: float = 0.1,
        n_steps: int = 10,
        min_value: float = -math.inf,
        max_value: float = math.inf,
        init_attr_targets: UserFn | None = None,
        init_attr_grads: UserFn | None = None,
        additional_init_keys: list[NestedKey] | None = None,
        attribution_key: Any = "attr",
        clean_intermediate_keys: bool = True,
    ) -> None:
        super().__init__(use_inputs=True, use_outputs=False, **inherited(
            locals(), "modules_to_maximise", "alpha", "n_steps", "min_value", "max_value"))
        if isinstance(modules_to_maximise, str):
            raise TypeError(f"ActivationMaximisation: modules_to_maximise must be a list of paths; write "
                            f"[{modules_to_maximise!r}]")
        self._modules_to_maximise = list(modules_to_maximise)
        if not self._modules_to_maximise:
            raise ValueError("ActivationMaximisation: modules_to_maximise is empty; name at least one module whose "
                             "activation to maximise (e.g. ['module[2]'] for layer [2] of a plain model)")
        self._alpha = alpha
        self._n_steps = n_steps
        self._min_value = min_value
        self._max_value = max_value
        self._hooked_module_kwargs["relative_path"] = "td_module.module[1]._td_module"

    def _model_paths(self, module: RoutedModule) -> dict[str, str]:
        """``modules_to_maximise`` path -> the same module's path from the model."""
        root = module.td_module
        model = module.model
        paths: dict[str, str] = {}
        hint = ("paths start at the context's TensorDictModule, as in tdhook 0.1.3 ('module[2]' is layer [2] of a "
                "plain model)")
        for path in self._modules_to_maximise:
            try:
                found = resolve_path(root, path)
            except PathError as e:
                raise PathError(f"ActivationMaximisation: {e}; {hint}") from e
            inside = module_path(model, found) if isinstance(found, nn.Module) else None
            if inside is None:
                raise ValueError(f"ActivationMaximisation: {path!r} is not a module of the model; {hint}")
            if inside in paths.values():
                raise ValueError(f"ActivationMaximisation: {path!r} names a module already in modules_to_maximise")
            paths[path] = inside
        return paths

    def _prepare_module(
        self, module: RoutedModule, in_keys: list[NestedKey], out_keys: list[NestedKey], extra_relative_path: str
    ) -> TensorDictModuleBase:
        self._model_paths(module)
        return super()._prepare_module(module, in_keys, out_keys, extra_relative_path)

    def _call(self, prepared: Attributing, td: TensorDict) -> AttributionCall:
        """The shared call, whose targets are the modules to maximise under the paths as written."""
        call = super()._call(prepared, td)
        paths = self._model_paths(prepared._routed)
        out_keys = prepared._context_keys[1]
        additional = td.select(*self._additional_init_keys)
        target = make_target(out_keys, list(paths), False, self._init_attr_targets, additional, None,
                             {inside: path for path, inside in paths.items()})
        return dataclasses.replace(call, target=target, target_layers=tuple(paths.values()))

    def _attribute(self, call: AttributionCall, td: TensorDict) -> TensorDictBase:
        return activation_maximisation(
            call.f, call.params, call.inputs, alpha=self._alpha, n_steps=self._n_steps, min_value=self._min_value,
            max_value=self._max_value, input_keys=call.input_keys, **call.options(),
        )
