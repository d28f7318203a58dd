"""tdhook_fn.compat.attribution methods side by side with tdhook 0.1.3, over the zoo.

Every case runs on an MLP, a CNN (Conv2d, BatchNorm, Flatten), a two-input model and a
model with a ModuleList; batches ``[3]`` and ``[2, 3]``; float32 and float64.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import TensorDict
from test_compat_attr_api import CASES, GRID, OURS, REF, Case, assert_same, compare, oracle, run
from torch import nn

SALIENCY = [{}, {"absolute": True}, {"multiply_by_inputs": True}, {"absolute": True, "multiply_by_inputs": True}]


@pytest.mark.parametrize(("case", "batch", "dtype"), GRID)
def test_saliency(case: Case, batch: tuple[int, ...], dtype: torch.dtype) -> None:
    for options in SALIENCY:
        compare(lambda lib, o=options: lib.Saliency(**o), case, batch, dtype)
    compare(lambda lib: lib.Saliency(input_modules=[case.layer], multiply_by_inputs=True), case, batch, dtype)


@pytest.mark.parametrize(("case", "batch", "dtype"), GRID)
def test_guided_backpropagation(case: Case, batch: tuple[int, ...], dtype: torch.dtype) -> None:
    model = case.model()
    others = tuple({type(m) for name, m in model.named_modules() if name and not isinstance(m, nn.ReLU)})
    compare(lambda lib: lib.GuidedBackpropagation(), case, batch, dtype)
    compare(lambda lib: lib.GuidedBackpropagation(classes_to_skip=others, multiply_by_inputs=True), case, batch,
            dtype)
    compare(lambda lib: lib.GuidedBackpropagation(input_modules=[case.layer]), case, batch, dtype)


@pytest.mark.parametrize(("case", "batch", "dtype"), GRID)
def test_integrated_gradients(case: Case, batch: tuple[int, ...], dtype: torch.dtype) -> None:
    for multiply in (False, True):
        out = compare(lambda lib, m=multiply: lib.IntegratedGradients(
            n_steps=9, multiply_by_inputs=m, compute_convergence_delta=True), case, batch, dtype)
        assert out["convergence_delta"].shape == torch.Size(batch)
    compare(lambda lib: lib.IntegratedGradients(n_steps=6, input_modules=[case.layer]), case, batch, dtype)
    compare(lambda lib: lib.IntegratedGradients(n_steps=6, input_modules=[case.layer], multiply_by_inputs=True),
            case, batch, dtype)


@pytest.mark.parametrize("multiply", [False, True])
def test_integrated_gradients_delta_with_input_modules(multiply: bool) -> None:
    """tdhook 0.1.3 fails (its cache hooks fire again in the delta's forwards); our delta
    follows tdhook's formula: it sums every attribution, the module ones included."""
    case = CASES["cnn"]
    make = lambda lib, layers=(case.layer,): lib.IntegratedGradients(
        n_steps=8, input_modules=list(layers), multiply_by_inputs=multiply, compute_convergence_delta=True)
    with pytest.raises(RuntimeError, match="batch dimension mismatch"):
        run(REF, make, case.model(), case.data(), case.in_keys)
    ours = run(OURS, make, case.model(), case.data(), case.in_keys)
    plain = run(OURS, lambda lib: make(lib, ()), case.model(), case.data(), case.in_keys)
    layer = ours["attr", case.layer]
    torch.testing.assert_close(ours["convergence_delta"], plain["convergence_delta"] + layer.flatten(1).sum(-1))
    torch.testing.assert_close(ours["attr", "input"], plain["attr", "input"])
    layer_only = compare(lambda lib: lib.IntegratedGradients(n_steps=8, input_modules=[case.layer]), case)
    torch.testing.assert_close(layer, layer_only["attr", case.layer])


@pytest.mark.parametrize("method", ["riemann_left", "riemann_right", "riemann_middle", "riemann_trapezoid",
                                    "gausslegendre"])
@pytest.mark.parametrize("n_steps", [2, 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_integrated_gradients_methods(method: str, n_steps: int, dtype: torch.dtype) -> None:
    case = CASES["two_input"]
    compare(lambda lib: lib.IntegratedGradients(method=method, n_steps=n_steps, multiply_by_inputs=True,
                                                compute_convergence_delta=True), case, (2, 3), dtype)


def test_integrated_gradients_default_steps_and_completeness() -> None:
    case = CASES["cnn"]
    out = compare(lambda lib: lib.IntegratedGradients(multiply_by_inputs=True, compute_convergence_delta=True),
                  case, (3,), torch.float64)
    assert out["convergence_delta"].abs().max() < 1e-2  # ReLU kinks: not exact at 50 steps


def test_integrated_gradients_baseline_key() -> None:
    case = CASES["mlp"]
    td = case.data()
    td["zero"] = td.pop("baseline").apply(torch.zeros_like)
    out = compare(lambda lib: lib.IntegratedGradients(n_steps=5, baseline_key="zero", multiply_by_inputs=True),
                  case, td=td)
    assert ("zero", "input") in out.keys(True, True)


@pytest.mark.parametrize("batch", [(3,), (2, 3)])
def test_integrated_gradients_target_modules(batch: tuple[int, ...]) -> None:
    case = CASES["blocks"]

    def targets(t: TensorDict, extra: TensorDict) -> TensorDict:
        return TensorDict(hidden=t[case.target].sum(-1), out=t["output"][..., 0], batch_size=t.batch_size)

    compare(lambda lib: lib.IntegratedGradients(n_steps=5, target_modules=[case.target], init_attr_targets=targets,
                                                multiply_by_inputs=True), case, batch)
    compare(lambda lib: lib.IntegratedGradients(
        n_steps=5, target_modules=[case.target], use_outputs=False,
        init_attr_targets=lambda t, e: TensorDict(h=t[case.target][..., 1], batch_size=t.batch_size)), case, batch)
    # With the convergence delta tdhook 0.1.3 fails (its cache hooks fire again in the delta's
    # forwards); ours evaluates the delta's targets on the plain outputs, as tdhook's code does.
    def make(lib: Any, modules: tuple[str, ...] = (case.target,)) -> Any:
        return lib.IntegratedGradients(n_steps=5, target_modules=list(modules), multiply_by_inputs=True,
                                       compute_convergence_delta=True,
                                       init_attr_targets=lambda t, e: t.select("output"))

    with pytest.raises(RuntimeError, match="batch dimension mismatch"):
        run(REF, make, case.model(), case.data(batch), case.in_keys)
    ours = run(OURS, make, case.model(), case.data(batch), case.in_keys)
    plain = run(OURS, lambda lib: make(lib, ()), case.model(), case.data(batch), case.in_keys)
    assert_same(plain, ours)


GRAD_CAM_DIMS: list[tuple[Any, Any]] = [(None, None), ((-1,), None), (None, (-1,))]


@pytest.mark.parametrize(("case", "batch", "dtype"), GRID)
def test_grad_cam(case: Case, batch: tuple[int, ...], dtype: torch.dtype) -> None:
    td = case.data(batch, dtype)  # tdhook counts the activation's dims with all batch dims first
    for dims in [case.cam_dims, *GRAD_CAM_DIMS]:
        for absolute in (False, True):
            def make(lib: Any, d: Any = dims, a: bool = absolute) -> Any:
                return lib.GradCAM({case.cam: lib.DimsConfig(*d)}, absolute=a)

            if len(batch) == 1:
                compare(make, case, batch, dtype)
                continue
            if any(0 <= d < len(batch) for part in dims if part is not None for d in part):
                with pytest.raises(ValueError, match="batch dims"):  # tdhook would mix samples there
                    run(OURS, make, case.model(dtype), td, case.in_keys)
                continue
            assert_same(run(REF, make, case.model(dtype), td, case.in_keys),
                        run(OURS, make, case.model(dtype), td, case.in_keys))


def test_grad_cam_dims_count_every_batch_dim_as_tdhook() -> None:
    """On a [2, 3] TensorDict the activation's dims count its two batch dims first, as in tdhook."""
    case = CASES["cnn"]
    make = lambda lib: lib.GradCAM({"[0]": lib.DimsConfig((3, 4), (2,))})
    ref = run(REF, make, case.model(), case.data((2, 3)), case.in_keys)
    ours = run(OURS, make, case.model(), case.data((2, 3)), case.in_keys)
    assert_same(ref, ours)
    assert ours["attr", "[0]"].shape == torch.Size([2, 3, 5, 5])
    with pytest.raises(ValueError, match="batch dims"):  # dim 1 is a batch dim here: it would mix samples
        run(OURS, lambda lib: lib.GradCAM({"[0]": lib.DimsConfig((2, 3), (1,))}), case.model(),
            case.data((2, 3)), case.in_keys)


def test_tensordict_module_model() -> None:
    """A TensorDictModule model (no wrapping): every submodule, the inner nn.Module too, is guided."""
    from tensordict.nn import TensorDictModule

    case = CASES["mlp"]
    td = case.data()
    outs = []
    for lib in (REF, OURS):
        model = TensorDictModule(case.model(), ["input"], ["output"])
        with lib.GuidedBackpropagation(input_modules=["module[1]"]).prepare(model) as hooked:
            outs.append(hooked(td.clone()))
    assert_same(*outs)
    ref, ours = oracle(lambda lib: lib.Saliency(multiply_by_inputs=True), case, td)
    assert_same(ref, ours)


class Summed(nn.Module):
    """Adds its two inputs first: autograd hands both the same gradient tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x + y))


def test_inputs_sharing_one_gradient_get_their_own_maps() -> None:
    """tdhook scales a gradient shared by two inputs in place once per input (its maps are wrong, docs/compat.md);
    ours are the hand-computed ones: gradient times each input, and integrated gradients' completeness."""
    torch.manual_seed(0)
    model = Summed().double().eval()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(3, 4, generator=g, dtype=torch.float64)
    td = TensorDict(x=x, y=y, baseline=TensorDict(x=torch.zeros_like(x), y=torch.zeros_like(y), batch_size=[3]),
                    batch_size=[3])
    first = lambda targets, additional: TensorDict(output=targets["output"][..., 0], batch_size=targets.batch_size)
    saliency = run(OURS, lambda lib: lib.Saliency(multiply_by_inputs=True, init_attr_targets=first), model, td,
                   ["x", "y"])
    xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
    model(xs, ys)[:, 0].sum().backward()
    assert xs.grad is not None and ys.grad is not None
    torch.testing.assert_close(saliency["attr", "x"], xs.grad * x)
    torch.testing.assert_close(saliency["attr", "y"], ys.grad * y)
    ig = run(OURS, lambda lib: lib.IntegratedGradients(n_steps=200, multiply_by_inputs=True, init_attr_targets=first),
             model, td, ["x", "y"])
    with torch.no_grad():
        change = model(x, y)[:, 0] - model(torch.zeros_like(x), torch.zeros_like(y))[:, 0]
    torch.testing.assert_close(ig["attr", "x"].sum(-1) + ig["attr", "y"].sum(-1), change, rtol=1e-4, atol=1e-5)
