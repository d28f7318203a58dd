"""Weight methods: the alpha sweep of task vectors, and the memory of global pruning masks.

Alpha sweep: 16 alphas on an MLP 64-128-128-10, scored by accuracy on 64 and on 2048
samples: ``tdhook_fn.weights.sweep_alphas`` against tdhook 0.1.3's
``with_applied_vectors`` loop and two hand-written floors on plain dicts of tensors
prepared before the timing: a Python loop over the alphas, one ``vmap`` over them, and
two ``vmap`` over 8 alphas each, all computing ``base + alpha * vector`` inside and
calling ``torch.func.functional_call``. The ratio to the best (fastest) floor is printed
for each size.
Memory: peak RSS growth of computing global masks for a ~10M-parameter model, against
tdhook's ``Pruning`` context (which clones every weight), each in a fresh process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from _timing import interleaved_medians, print_table
from tensordict import TensorDict
from torch import nn
from torch.func import functional_call, vmap

import tdhook_fn
from tdhook_fn.weights import sweep_alphas, task_vector

ALPHAS = [i / 8 for i in range(16)]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)).eval()


def _setup(n: int) -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    base, tuned = _mlp(), _mlp()
    with torch.no_grad():
        for p, q in zip(base.parameters(), tuned.parameters()):
            q.copy_(p + 0.05 * torch.randn_like(p))
    return base, tuned, torch.randn(n, 64), torch.randint(0, 10, (n,))


def _sweeps(n: int) -> None:
    model, tuned, x, y = _setup(n)
    base, vector = tdhook_fn.params(model), task_vector(tdhook_fn.params(model), tdhook_fn.params(tuned))
    accuracy = lambda p: (tdhook_fn.call(model, p, x).argmax(-1) == y).float().mean()
    # the floors: what a capable engineer writes by hand, everything that does not depend on
    # alpha prepared here, outside the timing
    plain_base = {".".join(k): v for k, v in base.items(True, True)}
    plain_vector = {".".join(k): v for k, v in vector.items(True, True)}
    alpha_tensor = torch.tensor(ALPHAS)
    score = lambda p: (functional_call(model, p, (x,)).argmax(-1) == y).float().mean()
    shifted = lambda a: {k: b + a * plain_vector[k] for k, b in plain_base.items()}
    loop_floor = lambda: torch.stack([score(shifted(a)) for a in ALPHAS])
    vmap_floor = lambda: vmap(lambda a: score(shifted(a)))(alpha_tensor)
    # vmap in two halves: 8 alphas' activations stay in cache where 16 do not (NOTE [vmap or loop])
    halves_floor = lambda: torch.cat([vmap(lambda a: score(shifted(a)))(half) for half in alpha_tensor.split(8)])

    def tdhook_loop() -> torch.Tensor:
        from tdhook.weights import TaskVectors

        factory = TaskVectors(ALPHAS, lambda m: 0.0, lambda m: True)
        td = TensorDict(input=x, batch_size=[n])
        scores = []
        with factory.prepare(model) as hooked:
            vec = hooked.get_task_vector(tuned)
            for a in ALPHAS:
                with hooked.with_applied_vectors(vec, alpha=a) as applied:
                    scores.append((applied(td.clone())["output"].argmax(-1) == y).float().mean())
        return torch.stack(scores)

    impls = {
        "hand-written loop floor": loop_floor,
        "hand-written vmap floor": vmap_floor,
        "hand-written vmap halves floor": halves_floor,
        "tdhook_fn sweep_alphas": lambda: sweep_alphas(accuracy, base, vector, ALPHAS),
        "tdhook 0.1.3 with_applied_vectors": tdhook_loop,
    }
    reference = loop_floor()
    for name, fn in impls.items():
        torch.testing.assert_close(fn(), reference, msg=f"{name} disagrees")
    with torch.no_grad():  # calls of a few milliseconds: samples of 5 in a row (see interleaved_medians)
        times = interleaved_medians(impls, rounds=15, number=5 if n < 512 else 1)
    floors = {name: times[f"hand-written {name} floor"] for name in ("loop", "vmap", "vmap halves")}
    better = min(("loop", "vmap"), key=floors.__getitem__)  # of the two plain floors
    best = min(floors, key=floors.__getitem__)
    print_table(f"task-vector alpha sweep, 16 alphas, MLP 64-128-128-10, {n} samples", list(times.items()),
                {"best floor": floors[best], "tdhook": times["tdhook 0.1.3 with_applied_vectors"]})
    ours = times["tdhook_fn sweep_alphas"]
    print(f"  sweep_alphas / better of loop and vmap floors ({better}): {ours / floors[better]:.2f}x;"
          f" / best floor ({best}): {ours / floors[best]:.2f}x")


_MEMORY_SCRIPT = """
import torch
from torch import nn
from _timing import peak_rss_growth_mib
import tdhook_fn
from tdhook.weights import Pruning
from tdhook_fn.weights import global_unstructured_masks, pruning_scores, default_skip
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(10)])  # ~10.5M parameters
importance = lambda module_key, parameter_name, parameter: parameter.abs()

def tdhook_context():
    with Pruning(importance, amount_to_prune=0.5).prepare(model):
        pass

def ours():
    global_unstructured_masks(pruning_scores(model, tdhook_fn.params(model), importance, skip=default_skip), 0.5)

print(peak_rss_growth_mib(tdhook_context if {tdhook!r} else ours))
"""


def _peak(tdhook: bool) -> float:
    out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT.format(tdhook=tdhook)],
                         capture_output=True, text=True, check=True, cwd=Path(__file__).parent)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    torch.set_num_threads(1)
    for n in (64, 2048):
        _sweeps(n)
    ours, theirs = _peak(False), _peak(True)
    print("\nglobal pruning masks, 10 x Linear(1024, 1024) (~10.5M parameters), amount 0.5: peak RSS growth")
    print(f"  tdhook_fn masks (scores + masks)      {ours:8.1f} MiB")
    print(f"  tdhook 0.1.3 Pruning context          {theirs:8.1f} MiB")


if __name__ == "__main__":
    main()
