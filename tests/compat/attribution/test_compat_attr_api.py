"""tdhook_fn.compat.attribution: public surface against tdhook 0.1.3, and the shared harness.

The other ``test_compat_attr_*`` files import the harness (zoo cases, ``oracle``,
``assert_same``) from here.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import pytest
import tdhook.attribution
import tdhook.attribution.grad_cam
import tdhook.attribution.gradient_helpers
import tdhook.attribution.gradient_helpers.helpers
import torch
from tensordict import TensorDict
from torch import nn
from zoo import Blocks, TwoInput, cnn, mlp

import tdhook_fn.compat.attribution
import tdhook_fn.compat.attribution.grad_cam
import tdhook_fn.compat.attribution.gradient_helpers
import tdhook_fn.compat.attribution.gradient_helpers.helpers


def _lib(attribution: Any, grad_cam: Any, helpers: Any, gradient_helpers: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        Saliency=attribution.Saliency,
        IntegratedGradients=attribution.IntegratedGradients,
        GradCAM=attribution.GradCAM,
        GuidedBackpropagation=attribution.GuidedBackpropagation,
        DimsConfig=grad_cam.DimsConfig,
        GradientAttribution=gradient_helpers.GradientAttribution,
        GradientAttributionWithBaseline=gradient_helpers.GradientAttributionWithBaseline,
        helpers=helpers,
    )


REF = _lib(tdhook.attribution, tdhook.attribution.grad_cam, tdhook.attribution.gradient_helpers.helpers,
           tdhook.attribution.gradient_helpers)
OURS = _lib(tdhook_fn.compat.attribution, tdhook_fn.compat.attribution.grad_cam,
            tdhook_fn.compat.attribution.gradient_helpers.helpers, tdhook_fn.compat.attribution.gradient_helpers)
INTERNAL = ("_register_in", "_mod_in", "_mod_out", "_cache_in", "_cache_out")  # tdhook's pipeline entries
BATCHES = [(3,), (2, 3)]
DTYPES = [torch.float32, torch.float64]


@dataclass
class Case:
    """A zoo model with its keys, one sample's input shapes and paths to attribute."""

    name: str
    build: Callable[[], nn.Module]
    in_keys: list[str]
    shapes: list[tuple[int, ...]]
    layer: str  # an input_modules path
    target: str  # a target_modules path
    cam: str  # a Grad-CAM path
    cam_dims: tuple[tuple[int, ...] | None, tuple[int, ...] | None]  # tdhook dims (with the batch dim)

    def model(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        torch.manual_seed(0)
        return self.build().eval().to(dtype)

    def data(self, batch: tuple[int, ...] = (3,), dtype: torch.dtype = torch.float32, seed: int = 1,
             baseline: bool = True) -> TensorDict:
        g = torch.Generator().manual_seed(seed)
        values = {k: torch.randn(*batch, *s, generator=g, dtype=torch.float64).to(dtype)
                  for k, s in zip(self.in_keys, self.shapes)}
        td = TensorDict(values, batch_size=list(batch))
        if baseline:
            td["baseline"] = td.select(*self.in_keys).apply(lambda t: 0.25 * t.flip(-1))
        return td


CASES = {
    "mlp": Case("mlp", mlp, ["input"], [(4,)], "[1]", "[0]", "[1]", ((1,), (1,))),
    "cnn": Case("cnn", cnn, ["input"], [(1, 5, 5)], "[2]", "[1]", "[2]", ((2, 3), (1,))),
    "two_input": Case("two_input", TwoInput, ["x", "y"], [(4,), (3,)], "a", "b", "a", ((-1,), None)),
    "blocks": Case("blocks", Blocks, ["input"], [(4,)], "layers[1]", "layers[0]", "layers[1]", (None, (-1,))),
}
ZOO = pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
GRID = [pytest.param(c, b, d, id=f"{c.name}-{'x'.join(map(str, b))}-{str(d)[6:]}")
        for c in CASES.values() for b in BATCHES for d in DTYPES]


def run(lib: Any, make: Callable[[Any], Any], model: nn.Module, td: TensorDict, in_keys: list[str]) -> TensorDict:
    """``make(lib)`` prepared on ``model`` and called on a copy of ``td``."""
    with make(lib).prepare(model, in_keys=in_keys) as hooked:
        return hooked(td.clone())  # type: ignore[no-any-return]


def oracle(make: Callable[[Any], Any], case: Case, td: TensorDict, dtype: torch.dtype = torch.float32,
           ) -> tuple[TensorDict, TensorDict]:
    """(tdhook's output, ours) for the same factory, model and inputs, each on its own model copy."""
    model = case.model(dtype)
    return run(REF, make, copy.deepcopy(model), td, case.in_keys), run(OURS, make, model, td, case.in_keys)


def documented(td: TensorDict) -> set[Any]:
    return {k for k in td.keys(True, True) if not (isinstance(k, tuple) and k[0] in INTERNAL)}


def assert_same(ref: TensorDict, ours: TensorDict) -> None:
    """Same documented keys, shapes and values (float64: rtol 1e-7)."""
    assert documented(ref) == set(ours.keys(True, True))
    assert ours.batch_size == ref.batch_size
    for key in documented(ref):
        expected, actual = ref.get(key), ours.get(key)
        assert actual.shape == expected.shape, key
        tol = {"rtol": 1e-7, "atol": 1e-7} if expected.dtype == torch.float64 else {}
        torch.testing.assert_close(actual, expected, **tol, msg=lambda m, k=key: f"{k}: {m}")


def compare(make: Callable[[Any], Any], case: Case, batch: tuple[int, ...] = (3,),
            dtype: torch.dtype = torch.float32, td: TensorDict | None = None) -> TensorDict:
    ref, ours = oracle(make, case, case.data(batch, dtype) if td is None else td, dtype)
    assert_same(ref, ours)
    return ours


# -- public surface ------------------------------------------------------------------------


def test_exports() -> None:
    assert sorted(tdhook_fn.compat.attribution.__all__) == [
        "ActivationMaximisation", "GradCAM", "GuidedBackpropagation", "IntegratedGradients", "LRP", "Saliency",
        "lrp_helpers"]
    for name in ("activation_maximisation", "saliency", "integrated_gradients", "grad_cam", "guided_backpropagation",
                 "gradient_helpers", "gradient_helpers.common", "gradient_helpers.helpers"):
        ours = importlib.import_module(f"tdhook_fn.compat.attribution.{name}")
        ref = importlib.import_module(f"tdhook.attribution.{name}")
        assert ours.__name__.endswith(name) and ref is not None


def _parameters(cls: type) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(cls.__init__).parameters.values()]


@pytest.mark.parametrize("name", ["Saliency", "IntegratedGradients", "GradCAM", "GuidedBackpropagation",
                                  "GradientAttribution", "GradientAttributionWithBaseline"])
def test_constructor_parameters_and_defaults_match(name: str) -> None:
    assert _parameters(getattr(OURS, name)) == _parameters(getattr(REF, name))


def test_dims_config_fields_match() -> None:
    assert [(f.name, f.default) for f in fields(OURS.DimsConfig)] == [
        (f.name, f.default) for f in fields(REF.DimsConfig)]
    assert OURS.DimsConfig((2, 3), (1,)) == OURS.DimsConfig(weight_pooling_dims=(2, 3), feature_sum_dims=(1,))


def test_init_attr_targets_with_labels_is_static() -> None:
    assert isinstance(inspect.getattr_static(OURS.IntegratedGradients, "init_attr_targets_with_labels"),
                      staticmethod)
    assert list(inspect.signature(OURS.IntegratedGradients.init_attr_targets_with_labels).parameters) == list(
        inspect.signature(REF.IntegratedGradients.init_attr_targets_with_labels).parameters)


@pytest.mark.parametrize("method", ["riemann_left", "riemann_right", "riemann_middle", "riemann_trapezoid",
                                    "gausslegendre"])
def test_approximation_parameters_equal_tdhook(method: str) -> None:
    ours, ref = OURS.helpers.approximation_parameters(method), REF.helpers.approximation_parameters(method)
    for n in (2, 7, 50):
        assert ours[0](n) == ref[0](n)  # step sizes, exactly
        assert ours[1](n) == ref[1](n)  # alphas, exactly
    assert OURS.helpers.SUPPORTED_METHODS == REF.helpers.SUPPORTED_METHODS


def test_unknown_method_raises_value_error() -> None:
    for lib in (REF, OURS):
        with pytest.raises(ValueError, match="Invalid integral approximation method name: simpson"):
            lib.helpers.approximation_parameters("simpson")
        with pytest.raises(ValueError, match="simpson"):
            lib.IntegratedGradients(method="simpson")


def test_grad_cam_dims_convert_to_one_sample() -> None:
    from tdhook_fn.attribution import DimsConfig as PureDims

    assert OURS.DimsConfig((2, 3), (1,)).per_sample() == PureDims((1, 2), (0,))
    assert OURS.DimsConfig((-1,), None).per_sample() == PureDims((-1,), None)
    assert OURS.DimsConfig((3,), (2,)).per_sample(batch_dims=2) == PureDims((1,), (0,))
    with pytest.raises(ValueError, match="batch dims"):
        OURS.GradCAM({"[1]": OURS.DimsConfig((0, 1), None)})
