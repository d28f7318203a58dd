"""What a probe for silent wrong numbers found: each case now gives the right map or raises."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn._probe import measuring
from tdhook_fn.attribution import DimsConfig, feature_ablation, grad_cam, integrated_gradients, occlusion, saliency


def mlp() -> tuple[tdhook_fn.Functional, TensorDict]:
    torch.manual_seed(0)
    return tdhook_fn.pure(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double())


def inputs(*batch: int) -> TensorDict:
    return TensorDict(input=torch.randn(*batch, 3, dtype=torch.float64), batch_size=batch)


def test_per_target_with_cotangents_is_refused() -> None:
    f, p = mlp()
    ones = lambda values: values.apply(torch.ones_like)
    with pytest.raises(ValueError, match="per_target and cotangents exclude each other"):
        saliency(f, p, inputs(5), target=(0, 1), per_target=True, cotangents=ones)
    with pytest.raises(ValueError, match="per_target and cotangents exclude each other"):
        integrated_gradients(f, p, inputs(5), 0.0, target=(0, 1), per_target=True, cotangents=ones)


@pytest.mark.parametrize("batch", [(), (3,)])
def test_per_target_refuses_targets_with_more_than_one_dim_per_sample(batch: tuple[int, ...]) -> None:
    f, p = mlp()
    square = lambda out: out["output"][..., :, None] * out["output"][..., None, :]
    with pytest.raises(ValueError, match=r"per_target needs target values shaped \[\*batch\] or \[\*batch, T\]"):
        saliency(f, p, inputs(*batch), target=square, per_target=True)


class Clamps(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp_(min=0)


def test_the_callers_inputs_are_never_written_by_in_place_modules() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Clamps(), nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(32, 3)).double()
    f, p = tdhook_fn.pure(model)
    x = torch.randn(2, 1, 4, 4, dtype=torch.float64)
    kept = x.clone()
    td = TensorDict(input=x, mask=x.clone(), batch_size=[2])
    first = grad_cam(f, p, td, target=0, layers={"[1]": DimsConfig((1, 2), (0,))})["[1]"]
    assert torch.equal(x, kept)
    torch.testing.assert_close(grad_cam(f, p, td, target=0, layers={"[1]": DimsConfig((1, 2), (0,))})["[1]"], first)
    saliency(f, p, td, target=0, layers=["[1]"], use_inputs=False)
    assert torch.equal(x, kept) and torch.equal(td["mask"], kept)


class HalvesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.mul_(0.5))


@pytest.mark.parametrize("method", ["feature_ablation", "occlusion"])
def test_the_first_perturbation_call_on_a_model_writes_no_input(method: str) -> None:
    """The first call sizes its chunks with a forward on one sample, which wrote the caller's first sample where
    the model writes its input in place (and gave that call wrong maps); the maps are w x / 2 from the first call."""
    torch.manual_seed(0)
    model = HalvesItsInput().double().eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    kept = x.clone()
    f, p = tdhook_fn.pure(model)  # (a new model: its first call)
    if method == "feature_ablation":
        maps = feature_ablation(f, p, x, 0.0, target=1)
    else:
        maps = occlusion(f, p, x, 0.0, target=1, sliding_window_shapes=(1,))
    assert torch.equal(x, kept)
    torch.testing.assert_close(maps, (model.linear.weight[1] * kept / 2).detach())


def test_probe_forwards_say_they_only_measure() -> None:
    """The forwards that size chunks and measure layers run under `measuring` (a custom tap with side effects, as
    compat's user hooks, may skip them); the method's own forwards do not."""
    torch.manual_seed(0)
    seen: list[bool] = []
    f, p = tdhook_fn.pure(nn.Sequential(nn.Linear(4, 3), nn.Tanh()).double())
    watched = f.with_taps(tdhook_fn.intervene("0", lambda value: seen.append(measuring()) or value))
    x = TensorDict(input=torch.randn(3, 4, dtype=torch.float64), batch_size=[3])
    feature_ablation(watched, p, x, 0.0, target=1)
    assert seen[0] and not any(seen[1:])  # the sizing probe, then the ablations
    seen.clear()
    saliency(watched, p, x, target=1, layers=["1"])  # the layer's spec probe on meta tensors, then the gradient
    assert seen[0] and not any(seen[1:]) and not measuring()


def test_a_batch_norm_without_running_statistics_is_refused_in_eval_mode() -> None:
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(4, track_running_stats=False)
    model = nn.Sequential(nn.Linear(3, 4), norm, nn.Linear(4, 2)).double().eval()
    f, p = tdhook_fn.pure(model)
    with pytest.raises(ValueError, match=r"\['1'\] are batch norms that normalise with the statistics of the batch"):
        integrated_gradients(f, p, inputs(5), 0.0, target=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_integrated_gradients_in_half_precision_sums_its_steps_in_float32(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    x = torch.randn(4, 8)
    exact = integrated_gradients(*tdhook_fn.pure(net.double()), TensorDict(input=x.double(), batch_size=[4]), 0.0,
                                 target=0, n_steps=300)["input"]
    half = integrated_gradients(*tdhook_fn.pure(net.to(dtype)), TensorDict(input=x.to(dtype), batch_size=[4]), 0.0,
                                target=0, n_steps=300, chunk_size=100)["input"]
    assert half.dtype == dtype
    assert float((half.double() - exact).norm() / exact.norm()) < 0.015  # was 0.13 in bf16, summed in bf16


class _Shared(nn.Module):
    """One block run twice."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.block(torch.tanh(self.block(torch.tanh(self.inp(x)))))))


def test_a_target_layer_that_runs_twice_is_refused() -> None:
    torch.manual_seed(0)
    f, p = tdhook_fn.pure(_Shared().double())
    target = lambda td: td["block"].sum(-1)
    with pytest.raises(ValueError, match=r"target layer 'block' ran 2 times in one forward"):
        saliency(f, p, inputs(5), target=target, target_layers=["block"])
    saliency(f, p, inputs(5), target=lambda td: td["inp"].sum(-1), target_layers=["inp"])


def test_token_ids_take_a_baseline_of_ids() -> None:
    torch.manual_seed(0)
    f, p = tdhook_fn.pure(nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2)).double())
    td = TensorDict(input=torch.randint(0, 10, (5, 3)), batch_size=[5])
    by_number = integrated_gradients(f, p, td, 3, target=0, layers=["[0]"], interpolate="layers")["[0]"]
    by_ids = integrated_gradients(f, p, td, torch.full((3,), 3), target=0, layers=["[0]"], interpolate="layers")
    torch.testing.assert_close(by_ids["[0]"], by_number)
    with pytest.raises(ValueError, match=r"the baseline 3.7 is not a whole number"):
        integrated_gradients(f, p, td, 3.7, target=0, layers=["[0]"], interpolate="layers")
    with pytest.raises(TypeError, match=r"token ids take a baseline of ids"):
        integrated_gradients(f, p, td, torch.full((3,), 3.0), target=0, layers=["[0]"], interpolate="layers")


def test_token_ids_refuse_a_tensordict_baseline_of_floats_naming_the_key() -> None:
    """It reached the embedding, whose own error names no key."""
    from tdhook_fn.attribution import feature_ablation

    torch.manual_seed(0)
    f, p = tdhook_fn.pure(nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2)).double())
    td = TensorDict(input=torch.randint(0, 10, (5, 3)), batch_size=[5])
    by_ids = feature_ablation(f, p, td, TensorDict(input=torch.full((5, 3), 2), batch_size=[5]), target=0)
    torch.testing.assert_close(by_ids, feature_ablation(f, p, td, 2, target=0))
    with pytest.raises(TypeError, match=r"feature_ablation: baselines is torch.float32 for input 'input', which is "
                                        r"torch.int64"):
        feature_ablation(f, p, td, TensorDict(input=torch.full((5, 3), 1.5), batch_size=[5]), target=0)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32])
def test_class_indices_of_any_integer_dtype(dtype: torch.dtype) -> None:
    f, p = mlp()
    x, classes = inputs(5), torch.tensor([0, 1, 2, 1, 0])
    torch.testing.assert_close(saliency(f, p, x, target=classes.to(dtype)), saliency(f, p, x, target=classes))


@pytest.mark.parametrize("method", ["saliency", "integrated_gradients"])
def test_a_tap_that_leaves_probes_alone_and_changes_a_shape(method: str) -> None:
    """A custom tap skipping probe forwards (`measuring`) that reshapes an activation: the layer after it is measured
    again with every tap running (NOTE [taps in probes]), and its map is the one of the reshaping model by hand."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Flatten(), nn.Linear(4, 3)).double()
    f, p = tdhook_fn.pure(model)
    reshape = lambda value: value if measuring() else value.reshape(len(value), 2, 2)
    reshaped = f.with_taps(tdhook_fn.intervene("0", reshape))
    x = inputs(5)

    def attributed(g: tdhook_fn.Functional, params: TensorDict, layer: str) -> torch.Tensor:
        if method == "saliency":
            return saliency(g, params, x, target=1, layers=[layer], use_inputs=False)[layer]
        return integrated_gradients(g, params, x, 0.0, target=1, layers=[layer], use_inputs=False, n_steps=8)[layer]

    got = attributed(reshaped, p, "1")
    assert got.shape == (5, 2, 2)
    torch.testing.assert_close(got, attributed(*tdhook_fn.pure(nn.Sequential(model[0], Reshape(), *model[1:])), "2"))
    torch.testing.assert_close(attributed(reshaped, p, "1"), got)  # a later call: the remembered specs fit


class Reshape(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(len(x), 2, 2)
