"""``InfidelityMetric`` and ``SensitivityMetric`` with the API of ``tdhook.metrics`` from tdhook 0.1.3.

Same constructor arguments and call, ``metric(hooked_module, data) -> TensorDict`` of one
score per sample under each input key, for a hooked module of a gradient attribution
context and ``data`` it has already been called on (holding ``("attr", key)``). Every
number comes from `tdhook_fn.attribution.metrics`: the perturbations of a call run
through one batched forward instead of tdhook's loop of forwards. Differences from
tdhook 0.1.3 are listed in ``docs/compat.md`` (section ``compat.metrics``).

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tdhook_fn.compat.attribution import Saliency
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    >>> data = TensorDict(input=torch.randn(5, 3), batch_size=[5])
    >>> with Saliency().prepare(model) as hooked:
    ...     _ = hooked(data)
    ...     scores = InfidelityMetric(n_perturb_samples=4)(hooked, data)
    >>> scores["input"].shape
    torch.Size([5])
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
from tensordict import TensorDict, TensorDictBase

from tdhook_fn import Functional
from tdhook_fn.attribution.metrics import infidelity, normal_perturbation, sensitivity_max, uniform_perturbation
from tdhook_fn.compat.contexts import under
from tdhook_fn.compat.modules import HookedModule
from tdhook_fn.compat.modules._scope import entered

__all__ = ["InfidelityMetric", "SensitivityMetric"]

_ATTR = "attr"  # (tdhook reads the attributions there, whatever the context's attribution_key)
_NOISE_STD = 0.01  # tdhook's perturbation: randn * 0.01


_Model = tuple[Functional, TensorDictBase, list[Any], list[Any]]  # (f, params, in_keys, out_keys)


class _AttributionMetric:
    """The call both metrics share: check the module and the attributions, then `_score`."""

    _name: ClassVar[str]

    def __call__(self, module: HookedModule, original_data: TensorDict) -> TensorDict:
        """Score per sample of each input's attributions.

        Args:
            module (HookedModule): the hooked module of an open gradient attribution context.
            original_data (TensorDict): data the module has been called on: the inputs
                and their attributions under ``("attr", key)``.

        Returns:
            TensorDict: one score per sample under each input key, batch as the data.

        Raises:
            TypeError: ``module`` is not the hooked module of an open context.
            KeyError: the data hold no attributions of an input.
        """
        model = _hooked_model(self._name, module)
        given = TensorDict({k: _attributions(self._name, original_data, k) for k in model[2]},
                           batch_size=original_data.batch_size)
        return self._score(module, model, original_data, given)

    def _score(self, module: HookedModule, model: _Model, data: TensorDict, given: TensorDict) -> TensorDict:
        """The scores of ``given``, the attributions of ``data``'s inputs, one per key."""
        raise NotImplementedError


class InfidelityMetric(_AttributionMetric):
    """Infidelity of the attributions of each input: ``E[(I . attr - (F(x) - F(x - I)))^2]``.

    ``I = -0.01 * eps`` with standard normal ``eps`` drawn from torch's global generator
    (tdhook's perturbation, in the same order: key after key, sample after sample), and
    ``F`` the sum of the model's outputs over their non-batch dims; each input key is
    perturbed alone. Computed by `tdhook_fn.attribution.metrics.infidelity`.

    Args:
        n_perturb_samples (int): perturbations per sample. Default: ``10``.
    """

    _name = "InfidelityMetric"

    def __init__(self, n_perturb_samples: int = 10) -> None:
        self.n_perturb_samples = n_perturb_samples

    def _score(self, module: HookedModule, model: _Model, data: TensorDict, given: TensorDict) -> TensorDict:
        f, params, in_keys, out_keys = model
        inputs = data.exclude(_ATTR)
        result = TensorDict({}, batch_size=data.batch_size)
        for key in in_keys:
            perturb = functools.partial(normal_perturbation, std=_NOISE_STD, keys=[key])
            result.set(key, infidelity(f, params, perturb, inputs, given.select(key), target=_outputs(out_keys),
                                       n_perturb_samples=self.n_perturb_samples))
        return result


class SensitivityMetric(_AttributionMetric):
    """Relative change of the attributions under uniform noise in ``[-r, r]``, per input key.

    One perturbation of every input at once (float32 noise from torch's global
    generator, as tdhook draws it); the hooked module attributes the perturbed data and
    each key scores ``||attr(x') - attr(x)||_1 / ||attr(x)||_1`` (tdhook's ratio of mean
    absolute values). Computed by `tdhook_fn.attribution.metrics.sensitivity_max`
    with one sample and the L1 norm.

    Args:
        perturb_radius (float): half-width ``r`` of the noise. Default: ``0.02``.
    """

    _name = "SensitivityMetric"

    def __init__(self, perturb_radius: float = 0.02) -> None:
        self.perturb_radius = perturb_radius

    def _score(self, module: HookedModule, model: _Model, data: TensorDict, given: TensorDict) -> TensorDict:
        in_keys = model[2]

        def explain(td: TensorDictBase) -> TensorDictBase:
            attributed: TensorDictBase = module(td.clone(False)).get(_ATTR)
            return attributed.select(*in_keys)

        perturb = functools.partial(uniform_perturbation, keys=in_keys, dtype=torch.float32)
        scores = sensitivity_max(explain, data.exclude(_ATTR), perturb_func=perturb,
                                 perturb_radius=self.perturb_radius, n_perturb_samples=1, norm_ord=1,
                                 explanations=given, per_key=True)
        assert isinstance(scores, TensorDict)
        return scores


def _hooked_model(metric: str, module: Any) -> _Model:
    """``(f, params, in_keys, out_keys)`` of the model a hooked module runs, with its hooks now."""
    context: Any = getattr(module, "hooking_context", None)
    working = getattr(context, "_working", None)
    if not isinstance(module, HookedModule) or working is None or not getattr(context, "_in_context", False):
        raise TypeError(f"{metric}: module must be the hooked module of an open attribution context, e.g. "
                        f"`with Saliency().prepare(model) as hooked: ...; {metric}()(hooked, data)`; got "
                        f"{type(module).__name__}")
    with entered(hooks=module._virtual_hooks):  # (hooks set on the hooked module apply, as in its own calls)
        f, params = working.functional(), working.params(detach=True)
    return f, params, list(context._in_keys), list(context._out_keys)


def _attributions(metric: str, data: TensorDictBase, key: Any) -> torch.Tensor:
    value = data.get(under(_ATTR, [key])[0], None)
    if not isinstance(value, torch.Tensor):
        raise KeyError(f"{metric}: the data hold no attributions of input {key!r} under ('attr', {key!r}); call the "
                       "hooked module on the data first (hooked(data)), with the default attribution_key 'attr'")
    return value


def _outputs(out_keys: list[Any]) -> Any:
    """The target: every model output (summed per sample by the metric)."""
    return lambda seen: seen.select(*out_keys)
