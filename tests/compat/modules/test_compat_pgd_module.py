"""compat PGDModule against tdhook 0.1.3's: the same steps, keys and repr."""

from __future__ import annotations

import pytest
import tdhook.modules
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

import tdhook_fn.compat.modules
from tdhook_fn.attribution import pgd_step


class QuadraticGrad(torch.nn.Module):
    """The gradient of ``sum((x - c)^2)``: ``2 (x - c)``, so that the steps go somewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("centre", torch.tensor([0.5, -1.0, 2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * (x - self.centre)


def _grad_module() -> TensorDictModule:
    return TensorDictModule(QuadraticGrad(), in_keys=["input"], out_keys=[("_grad", "input")])


OPTIONS = [
    {},
    {"ascent": True},
    {"use_sign": False, "alpha": 0.05, "n_steps": 7},
    {"min_value": -0.3, "max_value": 0.8, "n_steps": 4},
    {"working_key": None, "n_steps": 3},
    {"grad_key": "g", "working_key": "w"},
]


@pytest.mark.parametrize("options", OPTIONS, ids=[str(o) for o in OPTIONS])
def test_steps_and_keys_equal_tdhooks(options):
    grad_key = options.get("grad_key", "_grad")
    working_key = options.get("working_key", "_working")
    module = TensorDictModule(QuadraticGrad(), in_keys=["input"], out_keys=[(grad_key, "input")])
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))

    def run(cls):
        td = TensorDict(input=x.clone(), batch_size=[4]) if working_key is None else TensorDict(
            {working_key: TensorDict(input=x.clone(), batch_size=[4])}, batch_size=[4])
        return cls(module, **options)(td)

    ours, ref = run(tdhook_fn.compat.modules.PGDModule), run(tdhook.modules.PGDModule)
    assert set(ours.keys(True, True)) == set(ref.keys(True, True))
    for key in ref.keys(True, True):
        assert torch.equal(ours[key], ref[key]), key


def test_in_keys_out_keys_and_repr_match_tdhooks():
    ours = tdhook_fn.compat.modules.PGDModule(_grad_module(), alpha=0.1, n_steps=5)
    ref = tdhook.modules.PGDModule(_grad_module(), alpha=0.1, n_steps=5)
    assert ours.in_keys == ref.in_keys and ours.out_keys == ref.out_keys
    assert repr(ours) == repr(ref)


def test_pgd_step_is_the_update_activation_maximisation_uses():
    x, g = torch.randn(5), torch.randn(5)
    assert torch.equal(pgd_step(x, g, 0.2), x + 0.2 * g)
    assert torch.equal(pgd_step(x, g, 0.2, ascent=False, use_sign=True, min_value=-0.5, max_value=0.5),
                       torch.clamp(x - 0.2 * torch.sign(g), -0.5, 0.5))
