"""The user's hooks and hook switches around compat's patching and activation addition, side by side with tdhook 0.1.3.

tdhook registers a context's hooks on entry, so a hook set on the hooked module afterwards runs after the patch
(NOTE [the user's hooks after the method's]), and ``disable_context_hooks`` removes the hooks doing the context's
work (NOTE [latent contexts, pure]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import tdhook.latent
import torch
from tensordict import TensorDict
from torch import nn
from zoo import same, snapshot

import tdhook_fn.compat.latent

LIBS = {"tdhook": tdhook.latent, "ours": tdhook_fn.compat.latent}
X, CORRUPTED = (torch.randn(5, 4, generator=torch.Generator().manual_seed(seed)) for seed in (1, 2))


class Named(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0, self.act, self.l1, self.l2 = nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(self.act(self.l0(x)))))


def model() -> nn.Module:
    torch.manual_seed(0)
    return Named()


def patching_td() -> TensorDict:
    return TensorDict(input=X.clone(), patched=TensorDict(input=CORRUPTED.clone(), batch_size=[5]), batch_size=[5])


def addition_td() -> TensorDict:
    return TensorDict(positive=TensorDict(input=X.clone(), batch_size=[5]),
                      negative=TensorDict(input=CORRUPTED.clone(), batch_size=[5]), batch_size=[5])


def halfway(module_key: str, output: torch.Tensor, output_to_patch: torch.Tensor) -> torch.Tensor:
    return 0.5 * output + 0.5 * output_to_patch


CONTEXTS: dict[str, tuple[Callable[[Any], Any], Callable[[], TensorDict]]] = {
    "patching": (lambda lib: lib.ActivationPatching(["l0"]), patching_td),
    "patching_fn": (lambda lib: lib.ActivationPatching(["l0"], patch_fn=halfway), patching_td),
    "addition": (lambda lib: lib.ActivationAddition(["l0", "l1"]), addition_td),
}


def results(make: Callable[[Any], Any], data: Callable[[], TensorDict], inside: Callable[[Any], TensorDict]
            ) -> dict[str, TensorDict]:
    out = {}
    for name, lib in LIBS.items():
        m = model()  # (one each: tdhook leaves the hooks registered through its hooked module on the model)
        before = snapshot(m)
        with make(lib).prepare(m) as hooked:
            out[name] = inside(hooked).clone()
        if name == "ours":
            assert same(before, snapshot(m))
    return out


def assert_same(out: dict[str, TensorDict]) -> None:
    keys = set(out["ours"].keys(True, True))
    assert keys == set(out["tdhook"].keys(True, True))
    for key in keys:
        torch.testing.assert_close(out["ours"].get(key), out["tdhook"].get(key))


@pytest.mark.parametrize("prepend", [False, True])
@pytest.mark.parametrize("context", list(CONTEXTS))
def test_a_hook_set_after_entry_sees_what_tdhooks_does(context: str, prepend: bool) -> None:
    """A nonlinear hook on the patched (or steered) module, set on the hooked module inside the context: it runs
    after the patch and is left out of the vectors, as in tdhook, or before both with ``prepend``; it sees tdhook's
    values, as often."""
    make, data = CONTEXTS[context]
    seen: dict[str, list[torch.Tensor]] = {"tdhook": [], "ours": []}

    def inside(hooked: Any) -> TensorDict:
        calls = seen["ours" if isinstance(hooked, tdhook_fn.compat.modules.HookedModule) else "tdhook"]

        def doubled_relu(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            calls.append(output.detach().clone())
            return torch.relu(output) * 2.0

        hooked.register_submodule_hook("l0", doubled_relu, "fwd", prepend=prepend)
        return hooked(data())

    out = results(make, data, inside)
    assert_same(out)
    assert len(seen["ours"]) == len(seen["tdhook"]) == 2
    for ours, theirs in zip(seen["ours"], seen["tdhook"], strict=True):
        torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("context", list(CONTEXTS))
def test_disabled_context_hooks_turn_the_context_off(context: str) -> None:
    """Inside ``disable_context_hooks`` tdhook's patching runs the model plainly and its addition finds no vector;
    after the block the context works again."""
    make, data = CONTEXTS[context]

    def inside(hooked: Any) -> TensorDict:
        with hooked.disable_context_hooks():
            off = hooked(data())
        return TensorDict(off=off, on=hooked(data()))

    out = results(make, data, inside)
    assert_same(out)
    if context != "addition":
        plain = model()(CORRUPTED)
        torch.testing.assert_close(out["ours"]["off", "patched", "output"], plain)
        assert (out["ours"]["on", "patched", "output"] - plain).abs().max() > 1e-3
    else:
        assert not list(out["ours"]["off"].keys())


def test_a_hook_set_before_a_disable_block_is_in_the_vectors_after_it() -> None:
    """tdhook registers its hooks anew when a ``disable_context_hooks`` block ends, so a hook set on the hooked
    module before the block runs before the steering's caching hooks after it: it is part of the vectors
    (NOTE [a context's own hooks]). (Patching then patches as for a hook set before entry, which docs/compat.md
    lists.)"""
    make, data = CONTEXTS["addition"]

    def inside(hooked: Any) -> TensorDict:
        hooked.register_submodule_hook("l0", lambda module, args, output: torch.relu(output) * 2.0, "fwd")
        with hooked.disable_context_hooks():
            pass
        return hooked(data())

    assert_same(results(make, data, inside))


def test_a_gpt2_on_token_ids_patched_under_a_hook_set_after_entry() -> None:
    """A GPT-2 from a config on token ids: the first block's MLP patched with a halfway ``patch_fn`` under a hook set
    inside the context; the MLP's output after the hook (recorded by a second one) and the patched logits are
    tdhook's (the hook runs after the patch)."""
    transformers = pytest.importorskip("transformers")
    from zoo import tiny_gpt2

    ids, corrupted = (torch.randint(0, 40, (3, 6), generator=torch.Generator().manual_seed(seed)) for seed in (0, 1))
    out, seen = {}, {}
    for name, lib in LIBS.items():
        gpt2, seen[name] = tiny_gpt2(transformers).double(), []
        factory = lib.ActivationPatching(["transformer.h[0].mlp"], patch_fn=halfway)
        with factory.prepare(gpt2, in_keys={"input_ids": "input_ids"}, out_keys=["logits"]) as hooked:
            mlp = "transformer.h[0].mlp"
            hooked.register_submodule_hook(mlp, lambda module, args, output: torch.tanh(output * 20), "fwd")
            hooked.register_submodule_hook(mlp, lambda module, args, output, kept=seen[name]: kept.append(output),
                                           "fwd")
            td = TensorDict(input_ids=ids, patched=TensorDict(input_ids=corrupted, batch_size=[3]), batch_size=[3])
            out[name] = hooked(td)["patched", "logits"]
    torch.testing.assert_close(out["ours"], out["tdhook"])
    assert len(seen["ours"]) == len(seen["tdhook"]) == 2
    for ours, theirs in zip(seen["ours"], seen["tdhook"], strict=True):
        torch.testing.assert_close(ours, theirs)
