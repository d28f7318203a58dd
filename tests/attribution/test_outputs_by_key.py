"""Several outputs: cotangents pair with outputs by key, and each target's change counts in the delta."""

import copy

import tdhook.attribution as theirs
import torch
from captum.attr import IntegratedGradients as CaptumIG
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

import tdhook_fn
import tdhook_fn.compat.attribution as ours
from tdhook_fn.attribution import integrated_gradients, saliency


class _Two(torch.nn.Module):
    """Two outputs of different widths, the second ten times larger."""

    def __init__(self, widths=(3, 2)):
        super().__init__()
        self.body, self.h, self.g = torch.nn.Linear(3, 4), torch.nn.Linear(4, widths[0]), torch.nn.Linear(4, widths[1])

    def forward(self, x):
        z = torch.tanh(self.body(x))
        return self.h(z), 10 * self.g(z)


def _hooked(lib, factory, model):
    return factory.prepare(TensorDictModule(model, in_keys=["x"], out_keys=["o1", ("m", "o2")]))


def test_cotangents_pair_with_nested_outputs_by_key():
    torch.manual_seed(0)
    model, td = _Two(), TensorDict(x=torch.randn(2, 3), batch_size=[2])
    grads = lambda t, _a: t.apply(lambda v: v.detach())  # the gradient of half the squared norm
    reference = torch.func.vmap(torch.func.grad(lambda x: 0.5 * sum((o**2).sum() for o in model(x))))(td["x"])
    for lib in (theirs, ours):
        with _hooked(lib, lib.Saliency(init_attr_grads=grads), model) as hooked:
            torch.testing.assert_close(hooked(td.clone())["attr", "x"], reference.detach())
        with _hooked(lib, lib.Saliency(), model) as hooked:  # ones: widths 3 and 2 (it raised)
            plain = hooked(td.clone())["attr", "x"]
        torch.testing.assert_close(plain, torch.func.vmap(torch.func.grad(
            lambda x: sum(o.sum() for o in model(x))))(td["x"]).detach())
    f = tdhook_fn.functional(model, in_keys=["x"], out_keys=["o1", ("m", "o2")])
    pure = saliency(f, tdhook_fn.params(model), td, target=lambda out: out, cotangents=lambda v: v.apply(
        lambda t: t.detach()))
    torch.testing.assert_close(pure["x"], reference.detach())


def test_convergence_delta_with_targets_of_different_widths():
    torch.manual_seed(0)
    model = _Two((1, 3))
    td = TensorDict(x=torch.randn(2, 3), baseline=TensorDict(x=torch.zeros(2, 3), batch_size=[2]), batch_size=[2])
    deltas = []
    for lib in (theirs, ours):
        factory = lib.IntegratedGradients(multiply_by_inputs=True, compute_convergence_delta=True, n_steps=100)
        with _hooked(lib, factory, model) as hooked:
            deltas.append(hooked(td.clone())["convergence_delta"].detach())
    torch.testing.assert_close(deltas[1], deltas[0], atol=1e-5, rtol=0)
    assert deltas[1].abs().max() < 1e-4


def test_half_precision_ig_rounds_once():
    """bf16 maps within 1.3x of captum's float64 maps rounded to bf16 (the floor), not rounded twice."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).eval()
    low, x = model.bfloat16(), (torch.randn(16, 8) * 2).bfloat16()
    truth = CaptumIG(copy.deepcopy(low).double()).attribute(x.double(), target=1)  # the same numbers, exactly
    f, p = tdhook_fn.pure(low)
    got = integrated_gradients(f, p, x, 0.0, target=1)
    error = ((got.double() - truth).norm() / truth.norm()).item()
    floor = ((truth.bfloat16().double() - truth).norm() / truth.norm()).item()
    assert error < 1.3 * floor + 1e-3, (error, floor)
