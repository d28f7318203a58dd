"""Explanation metrics: infidelity and sensitivity_max against captum 0.9.0 and a batched floor.

A digits-sized CNN (``[N, 1, 8, 8] -> 10`` classes, a conv, a pool and a linear head) on
the first ``N = 64`` of scikit-learn's digits, 20 perturbations per sample.

- infidelity of saliency maps, perturbations ``I = 0.05 eps`` from a seeded generator, all
  at once (the default) and in chunks of ``CHUNK`` perturbations per sample (captum's
  ``max_examples_per_batch = CHUNK * N``: captum runs ``F(x)`` again for every batch, ours once);
- sensitivity_max of ``|saliency|`` with captum's default uniform noise (radius 0.02).

The floor is the plain torch a capable engineer writes for the same numbers: every
perturbed copy in one forward (one backward for the explanations), on the module itself
(its max pooling on a channels-last copy, as ours runs it, differentiated by the plain
kernel's backward: NOTE [shadow max pooling]), nothing built in the timed region beyond what
the fast way needs (the perturbations are drawn in every variant). Every variant is first
checked to give the same numbers. Times are CPU seconds of this one-thread process, medians
of interleaved rounds.
"""

from __future__ import annotations

import copy
import functools
import warnings

import torch
from _digits import cnn, digits, fastest_pooling
from _timing import cpu_medians, print_table
from captum.attr import Saliency
from captum.metrics import infidelity as captum_infidelity
from captum.metrics import sensitivity_max as captum_sensitivity_max
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.attribution import saliency
from tdhook_fn.attribution.metrics import infidelity, sensitivity_max

warnings.filterwarnings("ignore")
N, SAMPLES, SEED, CHUNK = 64, 20, 0, 5


def noise_of(g: torch.Generator):  # type: ignore[no-untyped-def]
    def perturb(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = torch.randn(x.shape, generator=g) * 0.05
        return d, x - d

    return perturb


def bench_infidelity(net: nn.Sequential, x: torch.Tensor, target: torch.Tensor) -> None:
    f, p = tdhook_fn.pure(net)
    attr = saliency(f, p, x, target=target)
    td, attr_td = TensorDict(input=x, batch_size=[N]), TensorDict(input=attr, batch_size=[N])
    g = torch.Generator()
    perturb = noise_of(g)
    fast = fastest_pooling(net)  # (the floor's forward: its max pooling in channels-last)

    def perturb_td(copies: TensorDict) -> tuple[TensorDict, TensorDict]:
        d, moved = perturb(copies["input"])
        return TensorDict(input=d, batch_size=copies.batch_size), TensorDict(input=moved, batch_size=copies.batch_size)

    def ours(chunk: int | None = None) -> torch.Tensor:
        g.manual_seed(SEED)
        return infidelity(f, p, perturb_td, td, attr_td, target=target, n_perturb_samples=SAMPLES, chunk_size=chunk)

    def ours_tensor() -> torch.Tensor:
        g.manual_seed(SEED)
        return infidelity(f, p, perturb, x, attr, target=target, n_perturb_samples=SAMPLES)

    def captum(chunk: int | None = None) -> torch.Tensor:
        g.manual_seed(SEED)
        return captum_infidelity(net, perturb, x, attr, target=target, n_perturb_samples=SAMPLES,
                                 max_examples_per_batch=None if chunk is None else chunk * N)

    def floor(chunk: int | None = None) -> torch.Tensor:
        g.manual_seed(SEED)
        k = chunk or SAMPLES
        with torch.no_grad():
            copies, column = x.repeat_interleave(k, 0), target.repeat_interleave(k)[:, None]  # (built once per call)
            before = fast(x).gather(1, target[:, None]).squeeze(1)
            total = torch.zeros(N)
            for _ in range(SAMPLES // k):
                d, moved = perturb(copies)
                after = fast(moved).gather(1, column).squeeze(1).view(N, k)
                dots = (attr[:, None] * d.view(N, k, *x.shape[1:])).flatten(2).sum(2)
                total += ((dots - (before[:, None] - after)) ** 2).sum(1)
            return total / SAMPLES

    for chunk in (None, CHUNK):
        impls = {"ours (TensorDict)": lambda c=chunk: ours(c), "captum 0.9.0": lambda c=chunk: captum(c),
                 "hand-written batched floor": lambda c=chunk: floor(c)}
        if chunk is None:
            impls = {**impls, "ours (tensor, captum-style)": ours_tensor}
        reference = floor(chunk)
        for name, fn in impls.items():
            torch.testing.assert_close(fn(), reference, rtol=1e-4, atol=1e-7, msg=f"{name} differs")
        times = cpu_medians(impls, rounds=15, number=3)
        how = "all at once" if chunk is None else f"in chunks of {chunk} per sample"
        print_table(f"infidelity of saliency maps, CNN on digits, batch {N}, {SAMPLES} perturbations {how}",
                    list(times.items()),
                    {"floor": times["hand-written batched floor"], "captum": times["captum 0.9.0"]})


def bench_sensitivity(net: nn.Module, x: torch.Tensor, target: torch.Tensor) -> None:
    f, p = tdhook_fn.pure(net)
    td = TensorDict(input=x, batch_size=[N])
    explain = functools.partial(saliency, f, p, abs=True)
    captum_saliency = Saliency(net)
    assert isinstance(net, nn.Sequential)
    # the floor's model: weights that do not require grad (ours takes the params as constants; a forward that records
    # the weights for their gradients is slower), its max pooling in channels-last, differentiated in the default layout
    fast = fastest_pooling(copy.deepcopy(net).requires_grad_(False))

    def ours() -> torch.Tensor:
        torch.manual_seed(SEED)
        return sensitivity_max(explain, td, target=target, n_perturb_samples=SAMPLES)  # type: ignore[return-value]

    def captum() -> torch.Tensor:
        torch.manual_seed(SEED)
        return captum_sensitivity_max(captum_saliency.attribute, x, target=target, n_perturb_samples=SAMPLES)

    def grads(inputs: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        inputs = inputs.detach().requires_grad_()
        out = fast(inputs).gather(1, t[:, None]).sum()  # (as ours: NOTE [shadow max pooling])
        return torch.autograd.grad(out, inputs)[0].abs()

    def floor() -> torch.Tensor:
        torch.manual_seed(SEED)
        moved = x.repeat_interleave(SAMPLES, 0)
        moved = moved + torch.empty(moved.shape).uniform_(-0.02, 0.02)
        expl = grads(x, target)
        moved_expl = grads(moved, target.repeat_interleave(SAMPLES))
        norm = expl.flatten(1).norm(dim=1)
        norm = torch.where(norm == 0, torch.ones_like(norm), norm)
        change = (expl.repeat_interleave(SAMPLES, 0) - moved_expl).flatten(1).norm(dim=1).view(N, SAMPLES)
        return (change / norm[:, None]).max(1).values

    impls = {"ours": ours, "captum 0.9.0": captum, "hand-written batched floor": floor}
    reference = floor()
    for name, fn in impls.items():
        torch.testing.assert_close(fn(), reference, rtol=1e-4, atol=1e-7, msg=f"{name} differs")
    times = cpu_medians(impls, rounds=15, number=3)
    print_table(f"sensitivity_max of |saliency|, CNN on digits, batch {N}, {SAMPLES} perturbations",
                list(times.items()), {"floor": times["hand-written batched floor"], "captum": times["captum 0.9.0"]})


def main() -> None:
    net = cnn()
    x = digits(N)
    target = net(x).argmax(-1)
    bench_infidelity(net, x, target)
    bench_sensitivity(net, x, target)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
