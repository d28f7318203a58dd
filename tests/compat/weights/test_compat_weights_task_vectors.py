"""tdhook_fn.compat.weights.TaskVectors side by side with tdhook 0.1.3's TaskVectors."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import pytest
import tdhook.weights
import tdhook.weights.task_vectors
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from zoo import Blocks, Tied, cnn, same, snapshot

import tdhook_fn.compat.weights
import tdhook_fn.compat.weights.task_vectors

LIBS = [tdhook.weights, tdhook_fn.compat.weights]
ALPHAS = [0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0]
GEN = torch.Generator().manual_seed(5)
TASK_X = torch.randn(64, 4, generator=GEN)
TASK_Y = (TASK_X[:, 0] + TASK_X[:, 1] > 0).long()
CONTROL_X = torch.randn(64, 4, generator=GEN)
IMAGES = torch.randn(16, 1, 5, 5, generator=GEN)
IMAGE_LABELS = torch.arange(16) % 4
DATA: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {
    "blocks": (TASK_X, TASK_Y, CONTROL_X),
    "cnn": (IMAGES[:8], IMAGE_LABELS[:8], IMAGES[8:]),
}


def make_blocks() -> nn.Module:
    torch.manual_seed(0)
    return Blocks().eval()


def finetuned(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 30) -> nn.Module:
    tuned = copy.deepcopy(model).train()
    optimizer = torch.optim.SGD(tuned.parameters(), lr=0.2)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(tuned(x), y).backward()
        optimizer.step()
    return tuned.eval()


def blocks_pair() -> tuple[nn.Module, nn.Module]:
    model = make_blocks()
    return model, finetuned(model, TASK_X, TASK_Y)


def cnn_pair() -> tuple[nn.Module, nn.Module]:
    """A CNN with BatchNorm: its task vector holds running statistics and an int counter."""
    torch.manual_seed(0)
    model = cnn().eval()
    return model, finetuned(model, IMAGES[:8], IMAGE_LABELS[:8], steps=5)


def output(module: Any, x: torch.Tensor) -> torch.Tensor:
    return module(TensorDict(input=x, batch_size=[x.shape[0]]))["output"].detach()


def callbacks(
    base: nn.Module, log: list[tuple[str, float]], data: str
) -> tuple[Callable[..., float], Callable[..., bool]]:
    """Task accuracy, and adequacy = agreement with the base model on control data."""
    task_x, task_y, control_x = DATA[data]
    control_labels = base(control_x).argmax(-1)

    def accuracy(module: Any) -> float:
        value = float((output(module, task_x).argmax(-1) == task_y).float().mean())
        log.append(("accuracy", value))
        return value

    def adequate(module: Any) -> bool:
        agreement = float((output(module, control_x).argmax(-1) == control_labels).float().mean())
        log.append(("adequacy", agreement))
        return agreement >= 0.55

    return accuracy, adequate


def factory(lib: Any, base: nn.Module, log: list[tuple[str, float]] | None = None, data: str = "blocks") -> Any:
    accuracy, adequate = callbacks(base, [] if log is None else log, data)
    return lib.TaskVectors(ALPHAS, accuracy, adequate)


def assert_equal_td(a: TensorDict, b: TensorDict, floating_only: bool = False) -> None:
    assert set(a.keys(True, True)) == set(b.keys(True, True))
    for key in a.keys(True, True):
        if floating_only and not a.get(key).is_floating_point():
            continue
        assert torch.equal(a.get(key), b.get(key)), key


@pytest.mark.parametrize("pair", [blocks_pair, cnn_pair], ids=["blocks", "cnn_batchnorm"])
def test_vectors_and_weights_match_tdhook(pair: Callable[[], tuple[nn.Module, nn.Module]]) -> None:
    model, tuned = pair()
    results = []
    for lib in LIBS:
        with factory(lib, model, data=pair.__name__[:-5]).prepare(copy.deepcopy(model)) as hooked:
            task = hooked.get_task_vector(tuned)
            forget = hooked.get_forget_vector(tuned)
            results.append((task, forget, hooked.get_weights(task, alpha=0.7), hooked.get_weights(task, forget, task)))
    (ref_task, ref_forget, ref_w, ref_w2), (task, forget, w, w2) = results
    assert_equal_td(task, ref_task)
    assert_equal_td(forget, ref_forget)
    assert_equal_td(w, ref_w, floating_only=True)
    assert_equal_td(w2, ref_w2, floating_only=True)
    for key in w.keys(True, True):  # integer buffers keep the model's value (tdhook makes them floats)
        if not w.get(key).is_floating_point():
            assert torch.equal(w.get(key), tdhook_fn.params(model).get(key)), key
    assert any(not t.is_floating_point() for t in task.values(True, True)) == (pair is cnn_pair)


def test_compute_alpha_matches_tdhook() -> None:
    model, tuned = blocks_pair()
    results = []
    for lib in LIBS:
        log: list[tuple[str, float]] = []
        with factory(lib, model, log).prepare(copy.deepcopy(model)) as hooked:
            task = hooked.get_task_vector(tuned)
            alpha = hooked.hooking_context.compute_alpha(task)
            weights = hooked.get_weights(task)  # alpha computed again
        results.append((alpha, log, weights))
    (ref_alpha, ref_log, ref_weights), (alpha, log, weights) = results
    assert alpha == ref_alpha and type(alpha) is type(ref_alpha)
    assert log == ref_log
    assert_equal_td(weights, ref_weights)
    scores = dict(zip([a for a in ALPHAS], range(len(ALPHAS)), strict=True))
    assert 0 < scores[alpha] < len(ALPHAS) - 1  # neither end: the callbacks decide
    assert ("adequacy", 1.0) in log and any(kind == "adequacy" and v < 0.55 for kind, v in log)


@pytest.mark.parametrize("pair", [blocks_pair, cnn_pair], ids=["blocks", "cnn_batchnorm"])
def test_with_applied_vectors_matches_tdhook_without_touching_the_model(
    pair: Callable[[], tuple[nn.Module, nn.Module]],
) -> None:
    model, tuned = pair()
    x = IMAGES if pair is cnn_pair else TASK_X
    plain = model(x).detach()
    before = snapshot(model)
    outs = []
    for lib in LIBS:
        target = model if lib is tdhook_fn.compat.weights else copy.deepcopy(model)
        with factory(lib, model, data=pair.__name__[:-5]).prepare(target) as hooked:
            task = hooked.get_task_vector(tuned)
            with hooked.with_applied_vectors(task, alpha=0.6) as applied:
                assert applied is hooked
                outs.append(output(applied, x))
                if lib is tdhook_fn.compat.weights:
                    assert same(before, snapshot(model))
                    assert torch.equal(model(x).detach(), plain)  # tdhook loads the weights into the model
            assert torch.equal(output(hooked, x), plain)
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[1], plain)
    assert same(before, snapshot(model))


def test_no_adequate_alpha() -> None:
    model, tuned = blocks_pair()
    before = snapshot(model)
    for lib in LIBS:
        never = lib.TaskVectors(ALPHAS, lambda module: 1.0, lambda module: False)
        target = model if lib is tdhook_fn.compat.weights else copy.deepcopy(model)
        with never.prepare(target) as hooked:
            task = hooked.get_task_vector(tuned)
            with pytest.raises(RuntimeError, match="No value satisfies the control adequacy criterion"):
                hooked.hooking_context.compute_alpha(task)
            with pytest.raises(RuntimeError, match="No value satisfies the control adequacy criterion"):
                hooked.get_weights(task)
            assert torch.equal(output(hooked, TASK_X), model(TASK_X).detach())
    assert same(before, snapshot(model))


@pytest.mark.parametrize("lib", LIBS, ids=["tdhook", "ours"])
def test_misuse_errors(lib: Any) -> None:
    model, tuned = blocks_pair()
    context = factory(lib, model).prepare(copy.deepcopy(model))
    with context as hooked:
        task = hooked.get_task_vector(tuned)
    with pytest.raises(RuntimeError, match="Cannot compute alpha outside of context"):
        context.compute_alpha(task)
    module_class = lib.task_vectors.TaskVectorsModule
    loose = module_class(TensorDictModule(copy.deepcopy(model), ["input"], ["output"]))
    with pytest.raises(RuntimeError, match="Module was not prepared with TaskVectors"):
        loose.get_weights(task)
    applied = loose.get_weights(task, alpha=1.0)
    assert all(torch.allclose(applied.get(k), tdhook_fn.params(tuned).get(k), atol=1e-6) for k in task.keys(True, True))


def test_tensordict_module_keys_match_tdhook() -> None:
    model, tuned = blocks_pair()
    outs = []
    for lib in LIBS:
        td_module = TensorDictModule(copy.deepcopy(model), ["x"], ["y"])
        with factory(lib, model).prepare(td_module) as hooked:
            task = hooked.get_task_vector(tuned)
            with hooked.with_applied_vectors(task, alpha=1.0):
                outs.append((task, hooked(TensorDict(x=TASK_X, batch_size=[64]))["y"].detach()))
    assert_equal_td(outs[0][0], outs[1][0])
    assert torch.allclose(outs[1][1], tuned(TASK_X).detach(), atol=1e-6)
    assert torch.equal(outs[0][1], outs[1][1])


def test_applied_weights_stay_in_the_calling_thread_and_block() -> None:
    model, tuned = blocks_pair()
    plain = model(TASK_X).detach()
    seen: list[torch.Tensor] = []
    with factory(tdhook_fn.compat.weights, model).prepare(model) as hooked:
        task = hooked.get_task_vector(tuned)
        with pytest.raises(KeyError), hooked.with_applied_vectors(task, alpha=1.0):
            worker = threading.Thread(target=lambda: seen.append(output(hooked, TASK_X)))
            worker.start()
            worker.join()
            nested = hooked.with_applied_vectors(task, alpha=0.0)
            with nested:
                assert torch.equal(output(hooked, TASK_X), plain)
            assert torch.allclose(output(hooked, TASK_X), tuned(TASK_X).detach(), atol=1e-6)
            raise KeyError("body failed")
        assert torch.equal(output(hooked, TASK_X), plain)
    assert torch.equal(seen[0], plain)


def test_tied_parameters_appear_once() -> None:
    """tdhook's vectors list a tied weight under every name; ours under its first."""
    torch.manual_seed(0)
    model = Tied()
    tuned = copy.deepcopy(model)
    with torch.no_grad():
        tuned.enc.weight.add_(1.0)
    vectors = []
    for lib in LIBS:
        with factory(lib, model).prepare(copy.deepcopy(model)) as hooked:
            vectors.append(hooked.get_task_vector(tuned))
    assert set(vectors[0].keys(True, True)) == {("enc", "weight"), ("dec", "weight")}
    assert set(vectors[1].keys(True, True)) == {("enc", "weight")}
    assert torch.equal(vectors[1]["enc", "weight"], vectors[0]["enc", "weight"])


def test_mismatched_model_is_named() -> None:
    model, _ = blocks_pair()
    with factory(tdhook_fn.compat.weights, model).prepare(model) as hooked:
        with pytest.raises(ValueError, match="heads"):
            hooked.get_task_vector(nn.Sequential(nn.Linear(4, 4)))


class _Spectral(nn.Module):
    """An FNO-style layer: complex weights on the low frequencies."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, dtype=torch.cfloat))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.irfft(torch.fft.rfft(x, dim=-1)[..., :4] * self.w, n=x.shape[-1], dim=-1)


@pytest.mark.parametrize("lib", LIBS, ids=["tdhook", "compat"])
def test_complex_weights_get_the_vector_as_tdhook(lib: Any) -> None:
    torch.manual_seed(0)
    base, tuned = _Spectral(), _Spectral()
    x = torch.randn(3, 6)
    with lib.TaskVectors([1.0], lambda _m: 1.0, lambda _m: True).prepare(copy.deepcopy(base)) as hooked:
        vector = hooked.get_task_vector(tuned)
        with hooked.with_applied_vectors(vector, alpha=1.0) as applied:
            out = applied(TensorDict(input=x, batch_size=[3]))["output"]
    torch.testing.assert_close(out, tuned(x))


def test_applied_buffers_in_training_mode_update_a_copy_kept_for_the_block() -> None:
    """Inside with_applied_vectors buffers are the applied ones (as tdhook loads them); a training-mode
    call updates those, later calls of the block see the update, and the model's buffers never change."""
    model, tuned = cnn_pair()
    vectors = factory(tdhook_fn.compat.weights, model, data="cnn")  # (its callbacks run the model in eval mode)
    model.train()
    before = snapshot(model)

    def loaded_with(weights: TensorDict, mode: bool) -> nn.Module:  # tdhook's way: the weights loaded into a model
        twin = copy.deepcopy(model).train(mode)
        weights.to_module(twin)
        return twin

    with vectors.prepare(model) as hooked:
        task = hooked.get_task_vector(tuned)
        loaded = loaded_with(hooked.get_weights(task, alpha=0.6), True)
        with hooked.with_applied_vectors(task, alpha=0.6):
            first, second = output(hooked, IMAGES[:8]), output(hooked, IMAGES[8:])
            assert same(before, snapshot(model))
        assert torch.equal(first, loaded(IMAGES[:8]).detach())
        assert torch.equal(second, loaded(IMAGES[8:]).detach())
        model.eval()
        with hooked.with_applied_vectors(task, alpha=0.6):  # a new block starts from the applied weights again
            fresh = output(hooked, IMAGES)
        assert torch.equal(fresh, loaded_with(hooked.get_weights(task, alpha=0.6), False)(IMAGES).detach())
        model.train()
    assert same(before, snapshot(model))


def _base_and_tuned() -> tuple[nn.Module, nn.Module, nn.Module]:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    tuned = copy.deepcopy(base)
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(0.5 * torch.randn(p.shape))
    further = copy.deepcopy(tuned)
    with torch.no_grad():
        for p in further.parameters():
            p.mul_(1.5)
    return base, tuned, further


def test_vectors_over_an_applied_block_start_from_its_weights() -> None:
    """TaskVectors prepared over the hooked module of an applied vectors block: its base weights are the applied
    ones, as in tdhook (vector and output)."""
    x = TensorDict(input=torch.randn(7, 6, generator=torch.Generator().manual_seed(1)), batch_size=[7])
    results = []
    for lib in LIBS:
        base, tuned, further = _base_and_tuned()
        with lib.TaskVectors([1.0], lambda m: 0.0, lambda m: True).prepare(base) as outer:
            with outer.with_applied_vectors(outer.get_task_vector(tuned), alpha=1.0) as applied:
                with lib.TaskVectors([1.0], lambda m: 0.0, lambda m: True).prepare(applied) as inner:
                    vector = inner.get_task_vector(further)
                    with inner.with_applied_vectors(vector, alpha=0.5) as twice:
                        results.append((vector, twice(x.clone())["output"].detach()))
    (theirs, their_out), (ours, our_out) = results
    for key in ours.keys(True, True):
        torch.testing.assert_close(ours.get(key), theirs.get(key))
    torch.testing.assert_close(our_out, their_out)


def test_vectors_over_a_pruned_module_start_from_its_pruned_weights() -> None:
    """TaskVectors prepared over a Pruning's hooked module: the vector is taken from the pruned weights, and the
    applied weights replace the pruned ones (the later context's edit wins), as in tdhook."""
    x = TensorDict(input=torch.randn(7, 6, generator=torch.Generator().manual_seed(1)), batch_size=[7])
    results = []
    for lib in LIBS:
        base, tuned, _ = _base_and_tuned()
        importance = lambda module_key, parameter_name, parameter: parameter.abs()
        with lib.Pruning(importance, 0.5).prepare(base) as pruned:
            with lib.TaskVectors([1.0], lambda m: 0.0, lambda m: True).prepare(pruned) as hooked:
                vector = hooked.get_task_vector(tuned)
                with hooked.with_applied_vectors(vector, alpha=0.5) as applied:
                    results.append((vector, applied(x.clone())["output"].detach()))
    (theirs, their_out), (ours, our_out) = results
    assert set(ours.keys(True, True)) == set(theirs.keys(True, True))
    for key in ours.keys(True, True):
        torch.testing.assert_close(ours.get(key), theirs.get(key))
    torch.testing.assert_close(our_out, their_out)


@pytest.mark.parametrize("structured", [False, True], ids=["global", "structured"])
def test_pruning_inside_an_applied_block_scores_and_masks_the_applied_weights(structured: bool) -> None:
    """Pruning prepared over the hooked module of an applied vectors block: its importance callback sees the
    applied weights, and it masks them, as tdhook (which prunes the weights the model holds in the block)."""
    x = TensorDict(input=torch.randn(7, 6, generator=torch.Generator().manual_seed(1)), batch_size=[7])
    results = []
    for lib in LIBS:
        base, tuned, _ = _base_and_tuned()
        seen: list[torch.Tensor] = []

        def importance(module_key: str, parameter_name: str, parameter: torch.Tensor) -> torch.Tensor | None:
            seen.append(parameter.detach().clone())
            return parameter.abs() if parameter_name == "weight" else None

        structured_options = {"modules_to_prune": {"td_module.module[2]": (0, 0.5)}}  # (tdhook's names from `applied`)
        options: dict[str, Any] = structured_options if structured else {"amount_to_prune": 0.5}
        with lib.TaskVectors([1.0], lambda m: 0.0, lambda m: True).prepare(base) as hooked:
            with hooked.with_applied_vectors(hooked.get_task_vector(tuned), alpha=0.5) as applied:
                with lib.Pruning(importance, **options).prepare(applied) as pruned:
                    results.append((seen, pruned(x.clone())["output"].detach()))
    (their_seen, their_out), (our_seen, our_out) = results
    assert len(our_seen) == len(their_seen)
    for ours, theirs in zip(our_seen, their_seen, strict=True):
        torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(our_out, their_out)
