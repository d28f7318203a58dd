"""compat's registered rules and EpsilonPlus against zennit 0.5.1, the library tdhook's rules are adapted from.

zennit imports torchvision, which is not installed: it runs in a subprocess with the
stub of ``tests/zennit_stub`` on its path (``transformers`` breaks where such a stub is
importable, so it never joins this process's path). zennit is installed without its
dependencies (``make install``; see constraints.txt).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
STUB = ROOT / "tests" / "zennit_stub"

SCRIPT = r'''
import torch
from torch import nn
from tensordict import TensorDict
from zennit.composites import EpsilonPlus as ZennitEpsilonPlus
from zennit.rules import AlphaBeta, Epsilon, Flat, Norm, Pass, WSquare, ZPlus

from tdhook_fn.compat.attribution import LRP
from tdhook_fn.compat.attribution.lrp_helpers import rules as ours

torch.set_default_dtype(torch.float64)


def relevance(module, x, r):
    x = x.clone().requires_grad_()
    module(x).backward(r)
    return x.grad


def build(make):
    torch.manual_seed(0)
    return make()


MODULES = {
    "linear": (lambda: nn.Linear(10, 8), (4, 10)),
    "square": (lambda: nn.Linear(8, 8), (4, 8)),
    "conv": (lambda: nn.Conv1d(3, 4, 3, padding=1), (2, 3, 9)),
    "conv2d": (lambda: nn.Conv2d(2, 3, 3, stride=2), (2, 2, 7, 7)),
}
PAIRS = [  # (zennit rule, ours, modules)
    (lambda: Epsilon(1e-6), lambda: ours.EpsilonRule(1e-6), ["linear", "conv", "conv2d"]),
    (lambda: Norm(1e-6), lambda: ours.EpsilonRule(1e-6), ["linear", "conv"]),
    (lambda: AlphaBeta(2.0, 1.0), lambda: ours.AlphaBetaRule(2.0, 1.0), ["linear", "conv", "conv2d"]),
    (lambda: ZPlus(), lambda: ours.AlphaBetaRule(1.0, 0.0), ["linear", "conv", "conv2d"]),
    (lambda: Flat(), lambda: ours.FlatRule(), ["linear", "conv", "conv2d"]),
    (lambda: WSquare(), lambda: ours.WSquareRule(), ["linear", "conv", "conv2d"]),
    (lambda: Pass(), lambda: ours.PassRule(), ["square"]),
]
checked = 0
for make_zennit, make_ours, names in PAIRS:
    for name in names:
        make, shape = MODULES[name]
        torch.manual_seed(1)
        x = torch.randn(shape)
        zennit_module, our_module = build(make), build(make)
        r = torch.randn_like(zennit_module(x))
        handles = make_zennit().register(zennit_module)
        theirs = relevance(zennit_module, x, r)
        handles.remove()
        with make_ours().register(our_module):
            mine = relevance(our_module, x, r)
        torch.testing.assert_close(mine, theirs, rtol=1e-9, atol=1e-12, msg=lambda m: f"{name}: {m}")
        checked += 1

for make, shape in [(lambda: nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 6), nn.ReLU()), (5, 10)),
                    (lambda: nn.Sequential(nn.Conv1d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv1d(4, 2, 3, padding=1),
                                           nn.ReLU()), (2, 3, 9))]:
    torch.manual_seed(2)
    x = torch.randn(shape)
    zennit_model, our_model = build(make), build(make)
    r = torch.randn_like(zennit_model(x))
    with ZennitEpsilonPlus(epsilon=1e-6).context(zennit_model) as modified:
        theirs = relevance(modified, x, r)
    grads = TensorDict(output=r, batch_size=[x.shape[0]])
    lrp = LRP(rule_mapper=ours.EpsilonPlus(epsilon=1e-6), init_attr_grads=lambda *_: grads,
              skip_modules=LRP.default_skip)
    with lrp.prepare(our_model) as hooked:
        mine = hooked(TensorDict(input=x, batch_size=[x.shape[0]]))["attr", "input"]
    torch.testing.assert_close(mine, theirs, rtol=1e-9, atol=1e-12)
    checked += 1
print("checked", checked)
'''


def test_rules_and_epsilon_plus_equal_zennit() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STUB), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == ["checked", "20"]


def test_the_stub_is_never_on_the_test_process_path():
    """Collected (its doctests), the stub would join sys.path here and transformers would import it."""
    assert str(STUB) not in sys.path
    assert "torchvision" not in sys.modules
