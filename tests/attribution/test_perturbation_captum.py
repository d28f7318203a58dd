"""The perturbation methods against captum 0.9, on the zoo's MLP, CNN, two-input model and transformer.

float64 throughout. captum's ``FeatureAblation`` and ``FeaturePermutation`` keep the
model's dtype: compared to float64 precision (the forwards run on other batch shapes,
so a few ulps of the outputs, which the differences carry). captum's ``Occlusion``
divides its sums in float32 (``single_attrib.float() / weight``) and
``ShapleyValueSampling`` accumulates in float32 (``dtype=torch.float``): occlusion is
compared with captum's sums divided in float64 (its ``format_result`` patched to do so)
and at float32 precision unpatched; Shapley sampling at float32 precision against
captum, and to float64 precision against a hand-written loop over captum's orders.
The random methods get captum's draws by seeding torch's global generator alike.
"""

from __future__ import annotations

from unittest import mock

import attr_zoo
import captum.attr as ca
import pytest
import torch
from attr_zoo import as_tuple, build, captum_inputs, from_captum
from tensordict import TensorDict
from zoo import same, snapshot, tiny_gpt2

from tdhook_fn.attribution._feature_ablation import feature_ablation
from tdhook_fn.attribution._feature_permutation import feature_permutation
from tdhook_fn.attribution._occlusion import occlusion
from tdhook_fn.attribution._shapley_value_sampling import shapley_value_sampling

F64 = torch.float64
BATCHES = [(3,), (), (2, 3)]


@pytest.fixture(autouse=True)
def _one_thread():
    yield from attr_zoo.one_thread()


def close64(ours: torch.Tensor, theirs: torch.Tensor, scale: float) -> None:
    """Equal to float64 precision: the differences of outputs of size ``scale`` carry their rounding."""
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype == F64
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-13 * max(1.0, scale))


def close32(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Equal to float32 precision (captum's float32 accumulations)."""
    scale = theirs.abs().max().item()
    torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=2e-6, atol=2e-7 * max(1.0, scale))


def output_scale(e: attr_zoo.Entry, td: TensorDict) -> float:
    return e.model(*attr_zoo.as_captum(e, td)).abs().max().item()


def masks_for(name: str) -> dict[str, torch.Tensor] | torch.Tensor:
    """Feature groups for each model: pairs of elements, rows of an image, tokens."""
    if name == "mlp":
        return torch.tensor([[0, 0, 1, 2]])
    if name == "cnn":
        return torch.arange(5).reshape(1, 1, 5, 1).expand(1, 1, 5, 5).contiguous()
    if name == "transformer":
        return torch.arange(3).reshape(1, 3, 1).expand(1, 3, 8).contiguous()
    return {"x": torch.tensor([[0, 1, 1, 2]]), "y": torch.tensor([[2, 3, 3]])}  # id 2 spans both keys


def as_captum_mask(name: str, mask):
    return tuple(mask[k] for k in ("x", "y")) if isinstance(mask, dict) else mask


WINDOWS = {"mlp": (2,), "cnn": (1, 2, 3), "transformer": (2, 3)}
STRIDES = {"mlp": 1, "cnn": (1, 1, 2), "transformer": (1, 2)}

# ------------------------------------------------------------------ feature ablation


@pytest.mark.parametrize("batch", BATCHES, ids=str)
@pytest.mark.parametrize("grouped", [False, True], ids=["elements", "groups"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "two_input", "transformer"])
def test_feature_ablation_equals_captum(name, grouped, batch):
    e = build(name, F64)
    td = e.inputs(batch)
    base = e.baselines(batch)
    before = snapshot(e.model)
    mask = masks_for(name) if grouped else None
    ours = feature_ablation(e.f, e.params, td, base, target=1, feature_mask=mask)
    theirs = as_tuple(ca.FeatureAblation(e.model).attribute(
        captum_inputs(e, td), baselines=tuple(as_tuple(captum_inputs(e, base))), target=1,
        feature_mask=None if mask is None else as_captum_mask(name, mask)))
    for key, t in zip(e.in_keys, theirs, strict=True):
        close64(ours[key], from_captum(t, batch), output_scale(e, td))
    assert same(before, snapshot(e.model))


def test_feature_ablation_per_target_and_tensor_targets_equal_captum_calls():
    e = build("cnn", F64)
    x = e.inputs((4,))["input"]
    f, p = e.f, e.params
    ours = feature_ablation(f, p, x, 0.1, target=(0, 3), per_target=True, chunk_size=7)
    for i, t in enumerate((0, 3)):
        close64(ours[i], ca.FeatureAblation(e.model).attribute(x, baselines=0.1, target=t), 10.0)
    summed = feature_ablation(f, p, x, 0.1, target=(0, 3))
    close64(summed, ours.sum(0), 10.0)
    labels = torch.tensor([3, 0, 2, 1])
    close64(feature_ablation(f, p, x, target=labels), ca.FeatureAblation(e.model).attribute(x, target=labels), 10.0)


def test_feature_ablation_per_sample_masks_equal_captum():
    e = build("mlp", F64)
    x = e.inputs((3,))["input"]
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 2, 3], [5, 5, 5, 5]])
    ours = feature_ablation(e.f, e.params, x, 0.0, target=2, feature_mask=mask)
    close64(ours, ca.FeatureAblation(e.model).attribute(x, target=2, feature_mask=mask), 10.0)


# ------------------------------------------------------------------ occlusion


def _float64_format_result(total_attrib, weights, is_inputs_tuple, use_weights):
    """captum's ``format_result``, dividing in the sums' dtype (captum: float32)."""
    from captum._utils.common import _format_output

    attrib = tuple(a / w.to(a.dtype) for a, w in zip(total_attrib, weights, strict=True)) if use_weights \
        else tuple(total_attrib)
    return _format_output(is_inputs_tuple, attrib)


def captum_occlusion(e, td, base, window, strides, target=1, patched=True):
    call = ca.Occlusion(e.model).attribute
    args = {"sliding_window_shapes": window, "strides": strides, "baselines": base, "target": target}
    if not patched:
        return call(captum_inputs(e, td), **args)
    with mock.patch("captum.attr._core.feature_ablation.format_result", _float64_format_result):
        return call(captum_inputs(e, td), **args)


@pytest.mark.parametrize("batch", BATCHES, ids=str)
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_occlusion_equals_captum(name, batch):
    e = build(name, F64)
    td = e.inputs(batch)
    base = e.baselines(batch)
    before = snapshot(e.model)
    ours = occlusion(e.f, e.params, td, base, target=1, sliding_window_shapes=WINDOWS[name], strides=STRIDES[name])
    flat_base = captum_inputs(e, base)
    theirs = captum_occlusion(e, td, flat_base, WINDOWS[name], STRIDES[name])
    close64(ours["input"], from_captum(theirs, batch), output_scale(e, td))
    close32(ours["input"], from_captum(captum_occlusion(e, td, flat_base, WINDOWS[name], STRIDES[name],
                                                        patched=False), batch))
    assert same(before, snapshot(e.model))


@pytest.mark.parametrize(("window", "strides"), [((1, 5, 5), None), ((1, 1, 1), 1), ((1, 3, 3), (1, 2, 2)),
                                                 ((1, 4, 2), (1, 3, 2)), ((1, 2, 5), (1, 1, 1))])
def test_occlusion_windows_cut_at_the_edges_equal_captum(window, strides):
    e = build("cnn", F64)
    td = e.inputs((3,))
    ours = occlusion(e.f, e.params, td["input"], 0.5, target=2, sliding_window_shapes=window, strides=strides)
    close64(ours, captum_occlusion(e, td, 0.5, window, strides, target=2), 10.0)


def test_occlusion_with_disjoint_windows_is_feature_ablation_of_blocks():
    e = build("cnn", F64)
    x = e.inputs((4,))["input"]
    blocks = (torch.arange(5)[:, None] // 2 * 3 + torch.arange(5)[None, :] // 2).reshape(1, 1, 5, 5)
    ours = occlusion(e.f, e.params, x, 0.0, target=0, sliding_window_shapes=(1, 2, 2), strides=(1, 2, 2))
    close64(ours, ca.FeatureAblation(e.model).attribute(x, target=0, feature_mask=blocks), 10.0)


def test_occlusion_of_two_inputs_equals_captum():
    e = build("two_input", F64)
    td = e.inputs((4,))
    base = e.baselines((4,))
    ours = occlusion(e.f, e.params, td, base, target=0, sliding_window_shapes={"x": (2,), "y": (2,)},
                     strides={"x": 2, "y": 1}, chunk_size=3)
    with mock.patch("captum.attr._core.feature_ablation.format_result", _float64_format_result):
        theirs = ca.Occlusion(e.model).attribute(captum_inputs(e, td), sliding_window_shapes=((2,), (2,)),
                                                 strides=(2, 1), baselines=captum_inputs(e, base), target=0)
    for key, t in zip(e.in_keys, theirs, strict=True):
        close64(ours[key], t, output_scale(e, td))


def test_occlusion_per_target_equals_captum_calls():
    e = build("transformer", F64)
    x = e.inputs((3,))["input"]
    ours = occlusion(e.f, e.params, x, target=(0, 1, 2), per_target=True, sliding_window_shapes=(1, 8))
    assert ours.shape == (3, 3, 3, 8)
    for t in range(3):
        close64(ours[t], captum_occlusion(e, e.inputs((3,)), 0.0, (1, 8), None, target=t), 10.0)


# ------------------------------------------------------------------ feature permutation


@pytest.mark.parametrize("grouped", [False, True], ids=["elements", "groups"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_feature_permutation_equals_captum_given_its_seed(name, grouped):
    e = build(name, F64)
    td = e.inputs((5,))
    mask = masks_for(name) if grouped else None
    torch.manual_seed(11)
    ours = feature_permutation(e.f, e.params, td, target=1, feature_mask=mask, chunk_size=4)
    torch.manual_seed(11)
    theirs = ca.FeaturePermutation(e.model).attribute(captum_inputs(e, td), target=1, feature_mask=mask)
    close64(ours["input"], theirs, output_scale(e, td))


def test_feature_permutation_with_a_generator_draws_what_the_seeded_global_one_draws():
    e = build("mlp", F64)
    x = e.inputs((6,))["input"]
    g = torch.Generator().manual_seed(5)
    ours = feature_permutation(e.f, e.params, x, target=(0, 2), per_target=True, generator=g)
    for i, t in enumerate((0, 2)):
        torch.manual_seed(5)
        close64(ours[i], ca.FeaturePermutation(e.model).attribute(x, target=t), 10.0)


# ------------------------------------------------------------------ Shapley value sampling


def reference_shapley(model, x, base, mask, orders):
    """Shapley sampling by hand, in the inputs' dtype: one forward per step of each order."""
    n_features = orders.shape[1]
    out = torch.zeros_like(x)
    for order in orders:
        state = base.clone()
        previous = model(state)[:, 1]
        for feature in order.tolist():
            chosen = (mask == feature).expand_as(x)
            state = torch.where(chosen, x, state)
            now = model(state)[:, 1]
            out += chosen * (now - previous).reshape(-1, *[1] * (x.dim() - 1))
            previous = now
    assert n_features == int(mask.max()) + 1
    return out / len(orders)


@pytest.mark.parametrize("grouped", [False, True], ids=["elements", "groups"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_shapley_value_sampling_equals_captum_given_its_seed(name, grouped):
    e = build(name, F64)
    td = e.inputs((3,))
    x = td["input"]
    base = 0.3 * e.inputs((3,), seed=2)["input"]
    mask = masks_for(name) if grouped else None
    n_samples = 3 if name == "cnn" and not grouped else 5
    before = snapshot(e.model)
    torch.manual_seed(4)
    ours = shapley_value_sampling(e.f, e.params, td, TensorDict(input=base, batch_size=[3]), target=1,
                                  n_samples=n_samples, feature_mask=mask, chunk_size=16)["input"]
    torch.manual_seed(4)
    theirs = ca.ShapleyValueSampling(e.model).attribute(x, baselines=base, target=1, n_samples=n_samples,
                                                         feature_mask=mask)
    close32(ours, theirs)
    full_mask = torch.arange(x[0].numel()).reshape(1, *x.shape[1:]) if mask is None else mask
    torch.manual_seed(4)
    orders = torch.stack([torch.randperm(int(full_mask.max()) + 1) for _ in range(n_samples)])
    close64(ours, reference_shapley(e.model, x, base, full_mask, orders), output_scale(e, td))
    assert same(before, snapshot(e.model))


def test_shapley_value_sampling_of_two_inputs_equals_captum():
    e = build("two_input", F64)
    td = e.inputs((4,))
    mask = masks_for("two_input")
    torch.manual_seed(9)
    ours = shapley_value_sampling(e.f, e.params, td, 0.2, target=2, n_samples=6, feature_mask=mask)
    torch.manual_seed(9)
    theirs = ca.ShapleyValueSampling(e.model).attribute(captum_inputs(e, td), baselines=(0.2, 0.2), target=2,
                                                         n_samples=6, feature_mask=as_captum_mask("two_input", mask))
    for key, t in zip(e.in_keys, theirs, strict=True):
        close32(ours[key], t)


def test_shapley_value_sampling_per_target_equals_captum_calls():
    e = build("mlp", F64)
    x = e.inputs((4,))["input"]
    g = torch.Generator()
    ours = shapley_value_sampling(e.f, e.params, x, target=(0, 1, 2), per_target=True, n_samples=4,
                                  generator=g.manual_seed(2))
    for t in range(3):
        torch.manual_seed(2)
        close32(ours[t], ca.ShapleyValueSampling(e.model).attribute(x, target=t, n_samples=4))


# ------------------------------------------------------------------ a Hugging Face model, token ids


def test_token_ablation_and_shapley_on_gpt2_with_an_attention_mask_equal_captum():
    """Token ids replaced by a pad id (0), the attention mask passed along unchanged (captum's additional args)."""
    transformers = pytest.importorskip("transformers")
    import tdhook_fn

    model = tiny_gpt2(transformers).double()
    f = tdhook_fn.functional(model, in_keys={"input_ids": "input_ids", "attention_mask": "attention_mask"},
                             out_keys=["logits"])
    p = tdhook_fn.params(model)
    ids = torch.randint(1, 40, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    td = TensorDict(input_ids=ids, attention_mask=mask, batch_size=[2])
    last = lambda out: TensorDict(logits=out["logits"][..., -1, 3], batch_size=out.batch_size)
    forward = lambda i, m: model(input_ids=i, attention_mask=m).logits[:, -1, 3]
    ours = feature_ablation(f, p, td, 0, target=last, input_keys=["input_ids"], chunk_size=4)["input_ids"]
    theirs = ca.FeatureAblation(forward).attribute(ids, baselines=0, additional_forward_args=(mask,))
    close64(ours, theirs, 10.0)
    windows = occlusion(f, p, td, 0, target=last, input_keys=["input_ids"], sliding_window_shapes=(2,))["input_ids"]
    with mock.patch("captum.attr._core.feature_ablation.format_result", _float64_format_result):
        close64(windows, ca.Occlusion(forward).attribute(ids, sliding_window_shapes=(2,), baselines=0,
                                                         additional_forward_args=(mask,)), 10.0)
    torch.manual_seed(3)
    phi = shapley_value_sampling(f, p, td, 0, target=last, input_keys=["input_ids"], n_samples=4)["input_ids"]
    torch.manual_seed(3)
    close32(phi, ca.ShapleyValueSampling(forward).attribute(ids, baselines=0, additional_forward_args=(mask,),
                                                            n_samples=4))


def test_feature_permutation_of_two_inputs_equals_captum_given_its_seed():
    """Every element its own feature, numbered across the inputs in order: captum's draws, feature by feature."""
    e = build("two_input", F64)
    td = e.inputs((5,))
    torch.manual_seed(2)
    ours = feature_permutation(e.f, e.params, td, target=0, chunk_size=3)
    torch.manual_seed(2)
    theirs = ca.FeaturePermutation(e.model).attribute(captum_inputs(e, td), target=0)
    for key, t in zip(e.in_keys, theirs, strict=True):
        close64(ours[key], t, output_scale(e, td))
