"""deeplift, deeplift_shap, layer_deeplift: equal to captum 0.9, complete, composable, and leave the model alone.

Captum 0.9 has two known bugs these functions do not copy (captum issues #1104 and #1276,
fixed after 0.9): two supported nonlinearities in a row read a stale gradient, and max
pooling's fallback reads the first sample's gradient. The oracle here is captum on the
same model with a copy (``_Copy``) between adjacent nonlinearities, which gives it the
right gradients; tests that the copy matters show captum's bug, and ours is complete.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from captum.attr import DeepLift, DeepLiftShap, LayerDeepLift
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torch import nn
from zoo import same, snapshot

import tdhook_fn
from tdhook_fn.attribution._deeplift import deeplift, layer_deeplift
from tdhook_fn.attribution._deeplift_rules import RESCALED, needs_reference_gradients
from tdhook_fn.attribution._deeplift_shap import deeplift_shap

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
D = torch.float64


class _Copy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


def _captum_safe(model: nn.Sequential) -> nn.Sequential:
    """The same function, with a copy between adjacent nonlinearities (captum #1104)."""
    mods: list[nn.Module] = []
    for module in model:
        if mods and type(mods[-1]) in RESCALED and type(module) in RESCALED:
            mods.append(_Copy())
        mods.append(module)
    return nn.Sequential(*mods)


def _mlp(act: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), act(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).to(D).eval()


def _cnn(softmax: bool = False) -> nn.Sequential:
    torch.manual_seed(1)
    layers: list[nn.Module] = [nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 6, 3),
                               nn.Sigmoid(), nn.Flatten(), nn.Linear(24, 5)]
    return nn.Sequential(*layers, *([nn.Softmax(-1)] if softmax else [])).to(D).eval()


class _Attention(nn.Module):
    """A transformer-style block: fused q/k/v, a softmax module, a residual ReLU MLP."""

    def __init__(self, d: int = 6):
        super().__init__()
        self.qkv, self.softmax, self.out = nn.Linear(d, 3 * d), nn.Softmax(-1), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 12), nn.ReLU(), nn.Linear(12, d))
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        h = x + self.out(self.softmax(q @ k.transpose(-1, -2) / 6**0.5) @ v)
        h = h + self.mlp(h)
        return self.head(h.mean(1))  # type: ignore[no-any-return]


def _pure(model: nn.Module) -> tuple[Any, Any]:
    return tdhook_fn.functional(model), tdhook_fn.params(model)


def _captum(cls: Any, model: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(model, *args).attribute(**kwargs).detach()  # type: ignore[no-any-return]


@pytest.mark.parametrize("act", [nn.ReLU, nn.ELU, nn.LeakyReLU, nn.Sigmoid, nn.Tanh, nn.Softplus])
@pytest.mark.parametrize("baseline", ["zero", "one", "each"])
def test_mlp_equals_captum(act: type[nn.Module], baseline: str) -> None:
    model = _mlp(act)
    f, p = _pure(model)
    torch.manual_seed(2)
    x = torch.randn(6, 5, dtype=D)
    b = {"zero": torch.zeros(1, 5, dtype=D), "one": torch.randn(1, 5, dtype=D), "each": torch.randn(6, 5, dtype=D)}
    ours = deeplift(f, p, x, b[baseline], target=1)
    theirs = _captum(DeepLift, model, inputs=x, baselines=b[baseline].expand_as(x), target=1)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-13)


def test_multipliers_and_eps_equal_captum() -> None:
    model = _mlp()
    f, p = _pure(model)
    x, b = torch.randn(4, 5, dtype=D), torch.randn(4, 5, dtype=D)
    for eps in (1e-10, 0.3):
        ours = deeplift(f, p, x, b, target=2, multiply_by_inputs=False, eps=eps)
        theirs = _captum(DeepLift, model, False, eps, inputs=x, baselines=b, target=2)
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("shared", [True, False])
def test_cnn_with_max_pool_equals_captum(shared: bool) -> None:
    model = _cnn()
    f, p = _pure(model)
    torch.manual_seed(3)
    x = torch.randn(5, 1, 8, 8, dtype=D)
    b = torch.randn(1 if shared else 5, 1, 8, 8, dtype=D) * 0.3
    ours = deeplift(f, p, x, b, target=(1, 4), per_target=True)
    for i, t in enumerate((1, 4)):
        theirs = _captum(DeepLift, _captum_safe(model), inputs=x, baselines=b.expand_as(x), target=t)
        torch.testing.assert_close(ours[i], theirs, rtol=1e-10, atol=1e-13)


def test_captum_adjacent_nonlinearities_bug_and_our_completeness() -> None:
    """captum 0.9 (#1104) is off on ReLU -> MaxPool; we are complete there, and equal to the repaired captum."""
    model = _cnn()
    f, p = _pure(model)
    x, b = torch.randn(3, 1, 8, 8, dtype=D), torch.randn(3, 1, 8, 8, dtype=D)
    ours = deeplift(f, p, x, b, target=0)
    buggy = _captum(DeepLift, model, inputs=x, baselines=b, target=0)
    gap = model(x)[:, 0] - model(b)[:, 0]
    torch.testing.assert_close(ours.flatten(1).sum(1), gap.detach(), rtol=1e-10, atol=1e-12)
    assert (buggy.flatten(1).sum(1) - gap).abs().max() > 1e-3


def test_softmax_equals_captum_per_sample() -> None:
    """Captum centres the softmax rule over the whole batch; ours per sample: equal one sample at a time."""
    model = _cnn(softmax=True)
    f, p = _pure(model)
    x, b = torch.randn(3, 1, 8, 8, dtype=D), torch.randn(3, 1, 8, 8, dtype=D) * 0.3
    ours = deeplift(f, p, x, b, target=2)
    for i in range(3):
        theirs = _captum(DeepLift, _captum_safe(model), inputs=x[i : i + 1], baselines=b[i : i + 1], target=2)
        torch.testing.assert_close(ours[i : i + 1], theirs, rtol=1e-10, atol=1e-13)


def test_transformer_style_block_equals_captum() -> None:
    torch.manual_seed(4)
    model = _Attention().to(D).eval()
    assert needs_reference_gradients(model)
    f, p = _pure(model)
    x, b = torch.randn(3, 5, 6, dtype=D), torch.randn(3, 5, 6, dtype=D) * 0.1
    ours = deeplift(f, p, x, b, target=1)
    for i in range(3):
        theirs = _captum(DeepLift, model, inputs=x[i : i + 1], baselines=b[i : i + 1], target=1)
        torch.testing.assert_close(ours[i : i + 1], theirs, rtol=1e-10, atol=1e-13)
    layer = layer_deeplift(f, p, x[:1], b[:1], target=1, layers=["mlp[1]"])
    theirs = _captum(LayerDeepLift, model, model.mlp[1], inputs=x[:1], baselines=b[:1], target=1)
    torch.testing.assert_close(layer, theirs, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("path, index", [("[2]", 2), ("[3]", 3), ("[1]", 1)])
def test_layer_deeplift_equals_captum(path: str, index: int) -> None:
    model = _mlp()
    f, p = _pure(model)
    x, b = torch.randn(4, 5, dtype=D), torch.randn(4, 5, dtype=D)
    for multiply in (True, False):
        ours = layer_deeplift(f, p, x, b, target=0, layers=[path], multiply_by_inputs=multiply)
        theirs = _captum(LayerDeepLift, model, model[index], multiply, inputs=x, baselines=b, target=0)
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-13)


def test_layer_deeplift_on_a_cnn_equals_captum() -> None:
    model = _cnn()
    f, p = _pure(model)
    x = torch.randn(3, 1, 8, 8, dtype=D)
    ours = layer_deeplift(f, p, TensorDict(input=x, batch_size=[3]), target=3, layers=["[3]", "[4]"])
    safe = _captum_safe(model)
    for path, module in (("[3]", safe[4]), ("[4]", safe[5])):
        theirs = _captum(LayerDeepLift, safe, module, inputs=x, target=3)
        torch.testing.assert_close(ours[path], theirs, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("model_fn", [_mlp, _cnn])
def test_deeplift_shap_equals_captum(model_fn: Any) -> None:
    model = model_fn()
    f, p = _pure(model)
    shape = (5,) if model_fn is _mlp else (1, 8, 8)
    x, refs = torch.randn(3, *shape, dtype=D), torch.randn(4, *shape, dtype=D)
    labels = torch.tensor([0, 2, 1])
    ours = deeplift_shap(f, p, x, refs, target=labels)
    theirs = _captum(DeepLiftShap, _captum_safe(model), inputs=x, baselines=refs, target=labels)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-13)
    gap = model(x)[torch.arange(3), labels] - model(refs)[:, labels].mean(0)
    torch.testing.assert_close(ours.flatten(1).sum(1), gap.detach(), rtol=1e-10, atol=1e-12)


def test_deeplift_shap_per_target_and_dict_baselines() -> None:
    model = _mlp()
    f, p = _pure(model)
    x, refs = TensorDict(input=torch.randn(2, 3, 5, dtype=D), batch_size=[2, 3]), torch.randn(4, 5, dtype=D)
    both = deeplift_shap(f, p, x, TensorDict(input=refs, batch_size=[4]), target=(0, 2), per_target=True)
    assert both.batch_size == torch.Size([2, 2, 3])
    for i, t in enumerate((0, 2)):
        torch.testing.assert_close(both[i], deeplift_shap(f, p, x, refs, target=t), rtol=1e-12, atol=1e-14)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), width=st.integers(1, 6), scale=st.floats(0.0, 3.0))
def test_completeness(seed: int, width: int, scale: float) -> None:
    """Summation to delta: the map of each sample sums to F(x) - F(b) (ReLU, tanh, sigmoid, max pool)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv1d(1, width, 3, padding=1), nn.ReLU(), nn.MaxPool1d(2), nn.Flatten(),
                          nn.Linear(4 * width, 5), nn.Tanh(), nn.Linear(5, 4), nn.Sigmoid(), nn.Linear(4, 2)).to(D)
    f, p = _pure(model)
    x, b = torch.randn(3, 1, 8, dtype=D) * scale, torch.randn(3, 1, 8, dtype=D)
    attr = deeplift(f, p, x, b, target=1)
    gap = (model(x)[:, 1] - model(b)[:, 1]).detach()
    torch.testing.assert_close(attr.flatten(1).sum(1), gap, rtol=1e-9, atol=1e-11)
    layer = layer_deeplift(f, p, x, b, target=1, layers=["[5]"])
    torch.testing.assert_close(layer.sum(-1), gap, rtol=1e-9, atol=1e-11)


def test_per_target_equals_one_call_per_target() -> None:
    model = _cnn()
    f, p = _pure(model)
    x = TensorDict(input=torch.randn(4, 1, 8, 8, dtype=D), batch_size=[4])
    maps = deeplift(f, p, x, 0.1, target=(0, 3, 4), per_target=True)
    assert maps.batch_size == torch.Size([3, 4])
    for i, t in enumerate((0, 3, 4)):
        torch.testing.assert_close(maps["input"][i], deeplift(f, p, x, 0.1, target=t)["input"], rtol=1e-12,
                                   atol=1e-14)


@pytest.mark.parametrize("model_fn", [_mlp, _cnn])
def test_vmap_and_batch_shapes(model_fn: Any) -> None:
    model = model_fn()
    f, p = _pure(model)
    shape = (5,) if model_fn is _mlp else (1, 8, 8)
    x = TensorDict(input=torch.randn(4, *shape, dtype=D), batch_size=[4])
    b = TensorDict(input=torch.randn(4, *shape, dtype=D), batch_size=[4])
    full = deeplift(f, p, x, b, target=1)["input"]
    per_sample = torch.func.vmap(lambda xi, bi: deeplift(f, p, xi, bi, target=1))(x, b)["input"]
    torch.testing.assert_close(per_sample, full, rtol=1e-10, atol=1e-13)
    grid = deeplift(f, p, x.reshape(2, 2), b.reshape(2, 2), target=1)
    assert grid.batch_size == torch.Size([2, 2])
    torch.testing.assert_close(grid["input"].reshape(full.shape), full, rtol=1e-10, atol=1e-13)


def test_label_targets_and_other_inputs() -> None:
    """A per-sample label tensor, and an input the baselines leave alone (passed unchanged, as captum's extras)."""

    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.act, self.out = nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3)

        def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
            return self.out(self.act(self.lin(x)) * gate)  # type: ignore[no-any-return]

    torch.manual_seed(5)
    model = Gated().to(D)
    f, p = tdhook_fn.functional(model, in_keys=["x", "gate"]), tdhook_fn.params(model)
    x, gate, labels = torch.randn(4, 5, dtype=D), torch.rand(4, 6, dtype=D), torch.tensor([0, 1, 2, 1])
    td = TensorDict(x=x, gate=gate, batch_size=[4])
    ours = deeplift(f, p, td, 0.0, target=labels, input_keys=["x"])["x"]
    theirs = _captum(DeepLift, model, inputs=x, baselines=torch.zeros_like(x), target=labels,
                     additional_forward_args=(gate,))
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-13)


def test_in_place_relu_and_a_module_run_twice() -> None:
    """Captum refuses a module run twice; here each run has its own rescale, and the map stays complete."""
    torch.manual_seed(6)
    act = nn.ReLU(inplace=True)
    model = nn.Sequential(nn.Linear(5, 7), act, nn.Linear(7, 7), act, nn.Linear(7, 2)).to(D)
    f, p = _pure(model)
    x, b = torch.randn(4, 5, dtype=D), torch.randn(4, 5, dtype=D)
    attr = deeplift(f, p, x, b, target=0)
    torch.testing.assert_close(attr.sum(1), (model(x)[:, 0] - model(b)[:, 0]).detach(), rtol=1e-10, atol=1e-12)


def test_the_model_and_inputs_are_left_alone() -> None:
    model = _cnn()
    before = snapshot(model)
    f, p = _pure(model)
    x = TensorDict(input=torch.randn(2, 1, 8, 8, dtype=D), batch_size=[2])
    x_before, p_before = x.clone(), p.clone()
    deeplift(f, p, x, target=0)
    layer_deeplift(f, p, x, target=0, layers=["[3]"])
    deeplift_shap(f, p, x, torch.randn(3, 1, 8, 8, dtype=D), target=0)
    assert same(before, snapshot(model))
    assert (x == x_before).all() and (p == p_before).all()


def test_float32_stays_float32() -> None:
    model = _mlp().float()
    f, p = _pure(model)
    attr = deeplift(f, p, torch.randn(3, 5), target=0)
    assert attr.dtype == torch.float32


def test_bad_inputs() -> None:
    model = _mlp()
    f, p = _pure(model)
    x = torch.randn(3, 5, dtype=D)
    with pytest.raises(ValueError, match="eps"):
        deeplift(f, p, x, target=0, eps=-1.0)
    with pytest.raises(TypeError, match="Functional"):
        deeplift(lambda params, td: td, p, x, target=0)
    with pytest.raises(ValueError, match="layers is empty"):
        layer_deeplift(f, p, x, target=0, layers=[])
    with pytest.raises(ValueError, match="one sample's shape"):
        deeplift_shap(f, p, x, torch.randn(4, 3, dtype=D), target=0)
    with pytest.raises(TypeError, match="distribution"):
        deeplift_shap(f, p, x, 0.0, target=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("tail", ["leaky", "softmax"])
def test_chain_walk_equals_the_general_path(tail: str) -> None:
    """An index target on a chain takes the walk; a callable target the rules on the stacked batch: same maps."""
    torch.manual_seed(7)
    end: list[nn.Module] = [nn.LeakyReLU(0.2)] if tail == "leaky" else [nn.Softmax(-1)]
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(27, 6),
                          nn.Sigmoid(), nn.Linear(6, 4), *end).to(D).eval()
    f, p = _pure(model)
    x, b = torch.randn(5, 1, 8, 8, dtype=D), torch.randn(1, 1, 8, 8, dtype=D)
    walked = deeplift(f, p, x, b, target=(1, 2), per_target=True)
    general = [deeplift(f, p, x, b, target=lambda td, t=t: td["output"][..., t]) for t in (1, 2)]
    torch.testing.assert_close(walked, torch.stack(general), rtol=1e-10, atol=1e-13)


def test_layer_deeplift_of_token_embeddings_equals_captum() -> None:
    """Token ids: the baselines are ids (a pad token), the embedding's output is attributed."""

    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.lin, self.act, self.head = nn.Embedding(11, 6), nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.act(self.lin(self.emb(ids))).mean(1))  # type: ignore[no-any-return]

    torch.manual_seed(8)
    model = Tokens().to(D)
    f, p = _pure(model)
    ids = torch.randint(1, 11, (4, 5))
    ours = layer_deeplift(f, p, TensorDict(input=ids, batch_size=[4]), 0, target=2, layers=["emb"])["emb"]
    theirs = _captum(LayerDeepLift, model, model.emb, inputs=ids, baselines=torch.zeros_like(ids), target=2)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-13)


def test_label_tensor_on_the_walk_equals_the_general_path() -> None:
    model = _cnn()
    f, p = _pure(model)
    x, labels = torch.randn(6, 1, 8, 8, dtype=D), torch.tensor([0, 4, 2, 2, 1, 3])
    walked = deeplift(f, p, x, 0.2, target=labels)
    general = deeplift(f, p, x, 0.2, target=lambda td: td["output"][torch.arange(6), labels])
    torch.testing.assert_close(walked, general, rtol=1e-10, atol=1e-13)
    theirs = _captum(DeepLift, _captum_safe(model), inputs=x, baselines=torch.full_like(x, 0.2), target=labels)
    torch.testing.assert_close(walked, theirs, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("eps", [1e-10, 0.3], ids=["no input near its reference", "some near"])
def test_max_pool_with_and_without_near_references_equals_the_general_path(eps: float) -> None:
    # the walk skips the pool's plain gradient where no |x - reference| is below eps: both ways equal the general
    # path's (a hook takes it), and captum's where it agrees (its eps at a max pool is not ours)
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(48, 4)).to(D).eval()
    f, p = _pure(model)
    x, b = torch.randn(4, 1, 8, 8, dtype=D), torch.randn(4, 1, 8, 8, dtype=D)
    walked = deeplift(f, p, x, b, target=2, eps=eps)
    handle = model[3].register_forward_hook(lambda _m, _a, out: out)
    try:
        general = deeplift(f, p, x, b, target=2, eps=eps)
    finally:
        handle.remove()
    torch.testing.assert_close(walked, general, rtol=1e-10, atol=1e-13)
    if eps < 1e-6:
        theirs = _captum(DeepLift, _captum_safe(model), True, eps, inputs=x, baselines=b, target=2)
        torch.testing.assert_close(walked, theirs, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("head", ["mlp", "flatten"])
def test_seed_rows_equal_the_general_path_and_alias_nothing(head: str) -> None:
    # a last linear layer after an activation (through a flatten): the walk starts from the weight's rows
    # (NOTE [seed rows]); the maps equal the general path's, and writing one leaves the params alone
    torch.manual_seed(9)
    model = (nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 4)) if head == "mlp" else
             nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8, 4))).to(D).eval()
    f, p = _pure(model)
    x = torch.randn(5, *((5,) if head == "mlp" else (1, 4, 4)), dtype=D)
    labels = torch.tensor([0, 3, 2, 2, 1])
    for target in (1, -1, labels):
        walked = deeplift(f, p, x, 0.3, target=target, multiply_by_inputs=False)
        general = deeplift(f, p, x, 0.3, multiply_by_inputs=False,
                           target=lambda td, t=target: td["output"][torch.arange(5), t])
        torch.testing.assert_close(walked, general, rtol=1e-10, atol=1e-13)
    per_target = deeplift(f, p, x, target=(0, -1), per_target=True)
    ones = [deeplift(f, p, x, target=lambda td, t=t: td["output"][..., t]) for t in (0, -1)]
    torch.testing.assert_close(per_target, torch.stack(ones), rtol=1e-10, atol=1e-13)
    before = p.clone()
    deeplift(f, p, x, target=1, multiply_by_inputs=False).add_(1.0)
    assert (p == before).all()


def test_a_nested_input_key_on_the_walk() -> None:
    # the walk's maps under a nested key ("a", "b"): the same TensorDict as the general path's (a callable target)
    model = _mlp()
    f, p = tdhook_fn.functional(model, in_keys=[("a", "b")], out_keys=["out"]), tdhook_fn.params(model)
    x = TensorDict({"a": {"b": torch.randn(5, 5, dtype=D)}}, batch_size=[5])
    walked = deeplift(f, p, x, 0.3, target=1)
    general = deeplift(f, p, x, 0.3, target=lambda td: td["out"][..., 1])
    assert walked.get(("a", "b")).shape == (5, 5)
    torch.testing.assert_close(walked.get(("a", "b")), general.get(("a", "b")), rtol=1e-10, atol=1e-13)
