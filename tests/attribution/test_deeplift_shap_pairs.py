"""deeplift_shap on a chain walks the n inputs and k references forward once and every pair backward
(NOTE [pairs on the chain]): the same maps as every pair expanded into its own rows of deeplift (the chain walk's,
and the general path's, which a forward hook on the model forces); what the walk does not read takes the expanded
pairs.
Also layer_deeplift's error for a layer whose module runs twice."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from attr_zoo import on_general_path
from tensordict import TensorDict, TensorDictBase
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import _deeplift_shap
from tdhook_fn.attribution._deeplift import deeplift, layer_deeplift
from tdhook_fn.attribution._deeplift_shap import deeplift_shap

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
D = torch.float64


def _mlp(softmax: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3),
                         *([nn.Softmax(-1)] if softmax else [])).to(D).eval()


def _cnn(softmax: bool = False) -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 6, 3), nn.Sigmoid(),
                         nn.Flatten(), nn.Linear(24, 5), nn.LeakyReLU(0.1), nn.Linear(5, 4),
                         *([nn.Softmax(-1)] if softmax else [])).to(D).eval()


_MODELS = {"mlp": (_mlp, (5,)), "mlp softmax": (lambda: _mlp(True), (5,)), "cnn max pool": (_cnn, (1, 8, 8)),
           "cnn softmax": (lambda: _cnn(True), (1, 8, 8))}


def _expanded(f: Any, p: TensorDictBase, x: TensorDict, refs: torch.Tensor, target: Any,
              **kwargs: Any) -> TensorDict:
    """DeepLiftShap as every (input, reference) pair in its own rows of `deeplift`, averaged over the references."""
    batch, k = x.batch_size, len(refs)
    pairs = x.unsqueeze(-1).expand(*batch, k)
    references = TensorDict(input=refs, batch_size=[k]).expand(*batch, k)
    if isinstance(target, torch.Tensor) and target.dim():
        target = target.unsqueeze(-1).expand(*target.shape, k)
    maps = deeplift(f, p, pairs, references, target=target, **kwargs)
    lead = 1 if kwargs.get("per_target") else 0
    return maps.apply(lambda t: t.mean(lead + len(batch)), batch_size=maps.batch_size[: lead + len(batch)])


def _walked(f: Any, p: TensorDictBase, x: TensorDict, refs: torch.Tensor, target: Any, **kwargs: Any) -> TensorDict:
    """The pairs' walk, which must apply here."""
    out = _deeplift_shap._pairs_walked(f, p, x, refs, "input", target, kwargs.get("multiply_by_inputs", True),
                                       kwargs.get("eps", 1e-10), kwargs.get("per_target", False))
    assert out is not None
    return out



@pytest.mark.parametrize("name", list(_MODELS))
@pytest.mark.parametrize("eps", [1e-10, 0.3], ids=["no pair near", "some near"])
@pytest.mark.parametrize("multiply", [True, False])
def test_pairs_walk_equals_the_expanded_pairs(name: str, eps: float, multiply: bool) -> None:
    build, shape = _MODELS[name]
    model = build()
    f, p = tdhook_fn.pure(model)
    torch.manual_seed(2)
    x = TensorDict(input=torch.randn(3, *shape, dtype=D), batch_size=[3])
    refs = torch.randn(4, *shape, dtype=D)
    refs[1] = x["input"][0] + 1e-3  # (a pair close to its reference: the plain gradient where eps is large)
    kwargs = {"eps": eps, "multiply_by_inputs": multiply}
    ours = deeplift_shap(f, p, x, refs, target=1, **kwargs)
    torch.testing.assert_close(ours, _walked(f, p, x, refs, 1, **kwargs), rtol=0, atol=0)
    torch.testing.assert_close(ours, _expanded(f, p, x, refs, 1, **kwargs), rtol=1e-10, atol=1e-13)
    general = on_general_path(model, lambda: deeplift_shap(f, p, x, refs, target=1, **kwargs))
    torch.testing.assert_close(ours, general, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("name", ["mlp", "cnn max pool"])
def test_per_target_and_label_tensors_on_the_pairs_walk(name: str) -> None:
    build, shape = _MODELS[name]
    model = build()
    f, p = tdhook_fn.pure(model)
    torch.manual_seed(3)
    x = TensorDict(input=torch.randn(2, 3, *shape, dtype=D), batch_size=[2, 3])  # (a batch of two dims)
    refs = torch.randn(5, *shape, dtype=D)
    for target, per_target in (((0, 2, 1), True), (torch.tensor([[0, 1, 2], [2, 2, 0]]), False),
                               (torch.tensor(2), False)):
        ours = deeplift_shap(f, p, x, refs, target=target, per_target=per_target)
        assert ours.batch_size == torch.Size([3, 2, 3] if per_target else [2, 3])
        torch.testing.assert_close(ours, _walked(f, p, x, refs, target, per_target=per_target), rtol=0, atol=0)
        expanded = _expanded(f, p, x, refs, target, per_target=per_target)
        torch.testing.assert_close(ours, expanded, rtol=1e-10, atol=1e-13)


def test_a_callable_target_sees_the_pairs_batch() -> None:
    """A callable target takes the expanded pairs (the walk reads class indices only): it sees batch ``[*B, K]``."""
    model = _mlp()
    f, p = tdhook_fn.pure(model)
    torch.manual_seed(4)
    x, refs = torch.randn(3, 5, dtype=D), torch.randn(4, 5, dtype=D)
    seen = []

    def first_logit(out: TensorDictBase) -> torch.Tensor:
        seen.append(out.batch_size)
        return out["output"][..., 0]

    ours = deeplift_shap(f, p, x, refs, target=first_logit)
    assert seen and all(size == torch.Size([3, 4]) for size in seen)
    torch.testing.assert_close(ours, deeplift_shap(f, p, x, refs, target=0), rtol=1e-10, atol=1e-13)


def test_vmap_takes_the_expanded_pairs_and_gives_the_same_maps() -> None:
    model = _cnn()
    f, p = tdhook_fn.pure(model)
    torch.manual_seed(5)
    x = TensorDict(input=torch.randn(3, 1, 8, 8, dtype=D), batch_size=[3])
    refs = torch.randn(4, 1, 8, 8, dtype=D)
    per_sample = torch.func.vmap(lambda td: deeplift_shap(f, p, td, refs, target=2))(x)
    torch.testing.assert_close(per_sample, deeplift_shap(f, p, x, refs, target=2), rtol=1e-10, atol=1e-13)


def test_references_of_another_dtype_take_the_expanded_pairs() -> None:
    model = _mlp()
    f, p = tdhook_fn.pure(model)
    x = TensorDict(input=torch.randn(3, 5, dtype=D), batch_size=[3])
    refs = torch.randn(4, 5, dtype=torch.float32)
    assert _deeplift_shap._pairs_walked(f, p, x, refs, "input", 0, True, 1e-10, False) is None
    refs64 = refs.to(D)
    torch.testing.assert_close(deeplift_shap(f, p, x, refs, target=0), _expanded(f, p, x, refs64, 0),
                               rtol=1e-6, atol=1e-7)


def test_layer_deeplift_names_itself_for_a_module_run_twice() -> None:
    act = nn.ReLU()
    model = nn.Sequential(nn.Linear(5, 7), act, nn.Linear(7, 7), act, nn.Linear(7, 2)).to(D)
    f, p = tdhook_fn.pure(model)
    with pytest.raises(ValueError, match=r"^layer_deeplift: layer '\[1\]' runs 2 times") as caught:
        layer_deeplift(f, p, torch.randn(4, 5, dtype=D), target=0, layers=["[1]"])
    assert "its own module" in str(caught.value) and "layer_calls" not in str(caught.value)


def test_leaky_relu_plain_gradient_on_the_walk_keeps_its_slope_exact() -> None:
    """Where ``|dx| < eps`` the walk's LeakyReLU hands on its slope in the input's dtype (not rounded to float32)."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(5, 6), nn.LeakyReLU(0.1), nn.Linear(6, 3)).to(D).eval()
    f, p = tdhook_fn.pure(model)
    x, b = torch.randn(8, 5, dtype=D), torch.randn(8, 5, dtype=D)
    walked = deeplift(f, p, x, b, target=1, eps=10.0)  # (every |dx| below eps: the plain gradient everywhere)
    general = on_general_path(model, lambda: deeplift(f, p, x, b, target=1, eps=10.0))
    torch.testing.assert_close(walked, general, rtol=1e-13, atol=1e-15)


def test_a_last_layer_that_does_not_fit_raises_not_broadcasts() -> None:
    """The walk skips the last linear layer's forward (NOTE [seed rows]) only where its input fits its weight: a
    weight of one input feature after eight must not broadcast over them."""
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(1, 3)).to(D).eval()
    f, p = tdhook_fn.pure(model)
    x = torch.randn(4, 5, dtype=D)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        deeplift(f, p, x, target=0)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        deeplift_shap(f, p, x, torch.randn(3, 5, dtype=D), target=0)


@pytest.mark.parametrize("act", [nn.LeakyReLU(0.1), nn.ELU(0.7), nn.Softplus(2.0, 1.5),
                                 nn.LeakyReLU(0.2, inplace=True)], ids=["leaky", "elu", "softplus", "leaky in place"])
@pytest.mark.parametrize("eps", [1e-10, 10.0], ids=["rescaled", "plain gradient"])
def test_rescale_rules_without_a_closed_form_before_compose_with_vmap(act: nn.Module, eps: float) -> None:
    """Their plain gradient on the general path is in closed form (a module's own vjp in the rules' backward made
    functorch assert under vmap), and equals the module's own (captum's fallback)."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(5, 6), act, nn.Linear(6, 3)).to(D).eval()
    f, p = tdhook_fn.pure(model)
    x = TensorDict(input=torch.randn(4, 5, dtype=D) * 3, batch_size=[4])
    b = TensorDict(input=torch.randn(4, 5, dtype=D), batch_size=[4])
    batched = on_general_path(model, lambda: deeplift(f, p, x, b, target=1, eps=eps))
    per_sample = torch.func.vmap(lambda xi, bi: deeplift(f, p, xi, bi, target=1, eps=eps))(x, b)
    torch.testing.assert_close(per_sample, batched, rtol=1e-10, atol=1e-13)
    if eps > 1:  # (every |dx| below eps: the plain gradient, which autograd gives at the inputs)
        inputs = x["input"].clone().requires_grad_()
        (grad,) = torch.autograd.grad(model(inputs)[:, 1].sum(), inputs)
        torch.testing.assert_close(batched["input"], grad * (x["input"] - b["input"]), rtol=1e-12, atol=1e-14)


def test_one_reference_is_deeplift_against_it() -> None:
    """``K = 1``: the walk's pairs are its rows with one shared reference, `deeplift`'s own."""
    model = _cnn()
    f, p = tdhook_fn.pure(model)
    torch.manual_seed(8)
    x, ref = torch.randn(3, 1, 8, 8, dtype=D), torch.randn(1, 1, 8, 8, dtype=D)
    torch.testing.assert_close(deeplift_shap(f, p, x, ref, target=1), deeplift(f, p, x, ref, target=1),
                               rtol=1e-12, atol=1e-15)
