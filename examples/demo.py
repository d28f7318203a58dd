"""The main example: a small model, one attribution, computed as pure functions.

Run with ``make demo``.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

import tdhook_fn


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).eval()
    params = tdhook_fn.params(model)
    x = torch.randn(4, 6)
    f = tdhook_fn.functional(model)

    # input x gradient for class 2, one sample at a time under vmap
    def class_2(sample: torch.Tensor) -> torch.Tensor:
        return f(params, TensorDict(input=sample))["output"][2]

    attribution = x * torch.func.vmap(torch.func.grad(class_2))(x)
    print("model:", model)
    print("input x gradient for class 2, 4 samples x 6 features:")
    print(attribution)
    # a tap reads an activation for one call, without hooks left on the model
    _, seen = tdhook_fn.call_with_taps(model, params, [tdhook_fn.capture("[1]", key="hidden")], x[0])
    print("hidden units active for sample 0:", int((seen["hidden"] > 0).sum()), "of 16")


if __name__ == "__main__":
    main()
