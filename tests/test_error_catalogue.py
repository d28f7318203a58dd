"""Every bad input gets our error: the right type, and a message naming the culprit and the fix.

A row is ``(id, call, exception type, words)``: ``call`` takes no arguments, builds what it
needs and makes one bad call; the message must contain every word (case-insensitive).
Rows are grouped in one list per area; append a new area's list to ``ROWS``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pathlib
import tempfile
import types
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn import attribution
from tdhook_fn.attribution import metrics as _metrics  # noqa: F401  (attribution.metrics)
from tdhook_fn.compat.attribution import Saliency
from tdhook_fn.compat.metrics import InfidelityMetric, SensitivityMetric
from tdhook_fn.weights import (
    Adapter,
    adapter_params,
    apply_masks,
    apply_vectors,
    best_alpha,
    global_unstructured_masks,
    ln_structured_mask,
    pruning_scores,
    sweep_alphas,
    task_vector,
    with_adapters,
)

Row = tuple[str, Callable[[], Any], type[BaseException], tuple[str, ...]]

# ---------------------------------------------------------------- shared fixtures


def tiny_model(seed: int = 0) -> nn.Sequential:
    """``Linear(3, 4) -> ReLU -> Linear(4, 2)``; params ``0.weight`` is ``(4, 3)``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).eval()


def tiny_params(seed: int = 0) -> TensorDict:
    return tdhook_fn.params(tiny_model(seed))


def tiny_inputs() -> TensorDict:
    return TensorDict(input=torch.randn(5, 3), batch_size=[5])


def tiny_f() -> tdhook_fn.Functional:
    return tdhook_fn.functional(tiny_model())


# ---------------------------------------------------------------- weights


def _weight_masks() -> TensorDict:
    """Boolean keep-masks over the weights of :func:`tiny_params`, half of them pruned."""
    p = tiny_params()
    return global_unstructured_masks(p.select(("0", "weight"), ("2", "weight")).abs(), 0.5)


def _vector() -> TensorDict:
    return task_vector(tiny_params(0), tiny_params(1))


def _sweep(alphas: Any) -> Any:
    p = tiny_params()
    return sweep_alphas(lambda q: q["0", "weight"].sum(), p, _vector(), alphas)


def _importance(module_key: str, parameter_name: str, parameter: torch.Tensor) -> torch.Tensor:
    return parameter.abs()


def _mask(shape: tuple[int, ...], key: str = "weight", dtype: torch.dtype = torch.bool) -> TensorDict:
    return TensorDict({"0": {key: torch.ones(shape, dtype=dtype)}}, batch_size=[])


class _WithAdaptersChild(nn.Module):
    """A model with a submodule named ``adapters``: the default adapter key."""

    def __init__(self) -> None:
        super().__init__()
        self.adapters = nn.Linear(3, 3)
        self.out = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.adapters(x))


def _adapted_call_with_tensor_entry() -> Any:
    model = tiny_model()
    g = with_adapters(tdhook_fn.functional(model), {"sae": (nn.Linear(4, 4), "[0]", "[0]")})
    p = tdhook_fn.params(model)
    p.set("adapters", torch.zeros(4))
    return g(p, tiny_inputs())


WEIGHTS_ROWS: list[Row] = [
    # apply_masks
    ("apply_masks-float-mask", lambda: apply_masks(tiny_params(), _mask((4, 3), dtype=torch.float32) * 0.5),
     TypeError, ("apply_masks", "'0.weight'", "bool", "mask.bool()")),
    ("apply_masks-integer-mask", lambda: apply_masks(tiny_params(), _mask((4, 3), dtype=torch.uint8)),
     TypeError, ("apply_masks", "'0.weight'", "torch.uint8", "bool")),
    ("apply_masks-swapped", lambda: apply_masks(_weight_masks(), tiny_params()),
     TypeError, ("apply_masks", "swapped", "apply_masks(params, masks)")),
    ("apply_masks-dict-masks", lambda: apply_masks(tiny_params(), {"0": {"weight": torch.ones(4, 3) > 0}}),
     TypeError, ("apply_masks", "masks", "TensorDict", "dict")),
    ("apply_masks-unknown-key", lambda: apply_masks(tiny_params(), _mask((4, 3), key="nope")),
     ValueError, ("apply_masks", "'0.nope'", "keyed like params")),
    ("apply_masks-shape", lambda: apply_masks(tiny_params(), _mask((3, 4))),
     ValueError, ("apply_masks", "'0.weight'", "(3, 4)", "(4, 3)")),
    # ln_structured_mask / global_unstructured_masks / pruning_scores
    ("ln_structured_mask-unknown-norm", lambda: ln_structured_mask(torch.randn(4, 3), 2, 0, n="abc"),
     ValueError, ("ln_structured_mask", "n='abc'", "'fro'", "'nuc'", "inf")),
    ("ln_structured_mask-nuc-on-2d", lambda: ln_structured_mask(torch.randn(4, 3), 2, 0, n="nuc"),
     ValueError, ("ln_structured_mask", "n='nuc'", "3-d", "(4, 3)")),
    ("ln_structured_mask-n-none", lambda: ln_structured_mask(torch.randn(4, 3), 2, 0, n=None),
     TypeError, ("ln_structured_mask", "n=None", "n=2")),
    ("ln_structured_mask-n-nan", lambda: ln_structured_mask(torch.randn(4, 3), 2, 0, n=float("nan")),
     ValueError, ("ln_structured_mask", "n=nan")),
    ("ln_structured_mask-positional-n", lambda: ln_structured_mask(torch.randn(4, 3), 2, 0, 2),
     TypeError, ("ln_structured_mask", "positional")),
    ("ln_structured_mask-float-dim", lambda: ln_structured_mask(torch.randn(4, 3), 2, 1.5),
     TypeError, ("ln_structured_mask", "dim", "int", "1.5")),
    ("ln_structured_mask-1d-entry-named", lambda: ln_structured_mask(tiny_params().select(("0", "bias")), 1, 0),
     ValueError, ("ln_structured_mask", "'0.bias'", "2 dims")),
    ("ln_structured_mask-dict-scores", lambda: ln_structured_mask({"w": torch.randn(4, 3)}, 1, 0),
     TypeError, ("ln_structured_mask", "scores", "TensorDict", "dict")),
    ("global_unstructured_masks-dict-scores", lambda: global_unstructured_masks({"w": torch.randn(4, 3)}, 1),
     TypeError, ("global_unstructured_masks", "scores", "TensorDict", "dict")),
    ("pruning_scores-swapped", lambda: pruning_scores(tiny_params(), tiny_model(), _importance),
     TypeError, ("pruning_scores", "model", "nn.Module")),
    ("pruning_scores-importance-not-callable", lambda: pruning_scores(tiny_model(), tiny_params(), "abs"),
     TypeError, ("pruning_scores", "importance", "callable")),
    ("pruning_scores-score-shape", lambda: pruning_scores(tiny_model(), tiny_params(), lambda **kw: torch.ones(3)),
     ValueError, ("pruning_scores", "'0.weight'", "(3,)", "(4, 3)")),
    # task vectors
    ("apply_vectors-positional-alpha", lambda: apply_vectors(tiny_params(), _vector(), 0.5),
     TypeError, ("apply_vectors", "keyword", "alpha=0.5")),
    ("apply_vectors-alpha-none", lambda: apply_vectors(tiny_params(), _vector(), alpha=None),
     TypeError, ("apply_vectors", "alpha", "number", "None")),
    ("apply_vectors-module-base", lambda: apply_vectors(tiny_model(), _vector()),
     TypeError, ("apply_vectors", "base", "Sequential", "tdhook_fn.params")),
    ("task_vector-module-finetuned", lambda: task_vector(tiny_params(), tiny_model(1)),
     TypeError, ("task_vector", "finetuned", "Sequential", "tdhook_fn.params")),
    ("sweep_alphas-none", lambda: _sweep(None),
     TypeError, ("sweep_alphas", "alphas", "sequence", "None")),
    ("sweep_alphas-scalar", lambda: _sweep(0.5),
     TypeError, ("sweep_alphas", "alphas", "[0.5]", "apply_vectors")),
    ("sweep_alphas-string", lambda: _sweep("0.5"),
     TypeError, ("sweep_alphas", "alphas", "str")),
    ("sweep_alphas-2d-tensor", lambda: _sweep(torch.ones(2, 2)),
     ValueError, ("sweep_alphas", "alphas", "1-d", "(2, 2)")),
    ("sweep_alphas-nan", lambda: _sweep([0.0, float("nan")]),
     ValueError, ("sweep_alphas", "alphas[1]", "finite")),
    ("sweep_alphas-empty", lambda: _sweep([]),
     ValueError, ("sweep_alphas", "alphas", "empty", "at least one")),
    ("sweep_alphas-fn-not-callable", lambda: sweep_alphas(tiny_params(), _vector(), lambda q: q, [0.5]),
     TypeError, ("sweep_alphas", "fn", "callable")),
    ("best_alpha-lengths", lambda: best_alpha([0.5, 1.0, 1.5], [0.1, 0.2], [True, True, True]),
     ValueError, ("best_alpha", "3 alphas", "2 scores")),
    # adapters
    ("with_adapters-list", lambda: with_adapters(tiny_f(), [(nn.Identity(), "[0]", "[0]")]),
     TypeError, ("with_adapters", "adapters", "mapping", "list")),
    ("with_adapters-short-tuple", lambda: with_adapters(tiny_f(), {"sae": (nn.Identity(), "[0]")}),
     TypeError, ("with_adapters", "'sae'", "(module, in_path, out_path)")),
    ("with_adapters-not-a-module", lambda: with_adapters(tiny_f(), {"sae": (abs, "[0]", "[0]")}),
     TypeError, ("with_adapters", "'sae'", "nn.Module")),
    ("with_adapters-bad-site", lambda: with_adapters(tiny_f(),
                                                     {"sae": Adapter(nn.Identity(), "[0]", "[0]", "middle")}),  # type: ignore[arg-type]
     ValueError, ("with_adapters", "'sae'", "site", "'output'", "'input'")),
    ("with_adapters-key-collision", lambda: with_adapters(tdhook_fn.functional(_WithAdaptersChild()),
                                                          {"sae": (nn.Identity(), "out", "out")}),
     ValueError, ("with_adapters", "key='adapters'", "model", "another key")),
    ("adapter_params-list", lambda: adapter_params([(nn.Identity(), "[0]", "[0]")]),
     TypeError, ("adapter_params", "adapters", "mapping", "list")),
    ("adapted-call-tensor-entry", _adapted_call_with_tensor_entry,
     TypeError, ("'adapters'", "Tensor", "adapter_params")),
]

# ---------------------------------------------------------------- core and attribution


def _td_of(x: torch.Tensor, **more: torch.Tensor) -> TensorDict:
    return TensorDict(input=x, **more, batch_size=[len(x)])


def _with_shape(key: tuple[str, ...], shape: tuple[int, ...]) -> TensorDict:
    p = tiny_params()
    p[key] = torch.zeros(shape)
    return p


def _cnn() -> tuple[tdhook_fn.Functional, TensorDict, TensorDict]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)).eval()
    return tdhook_fn.functional(net), tdhook_fn.params(net), TensorDict(input=torch.randn(2, 1, 8, 8), batch_size=[2])


class _WithSpare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.spare = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), x


class _TupleBlock(nn.Module):  # as Hugging Face blocks: a tuple out
    def __init__(self) -> None:
        super().__init__()
        self.block = _Pair()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)[0]


def _saliency_on_a_tensor() -> Any:
    from tdhook_fn.compat.attribution import Saliency

    targets = lambda td, _: TensorDict(o=td["output"][..., 0], batch_size=td.batch_size)
    with Saliency(init_attr_targets=targets).prepare(tiny_model()) as hooked:
        return hooked(torch.randn(5, 3))


CORE_ROWS: list[Row] = [
    ("params-wrong-shape", lambda: tdhook_fn.call(tiny_model(), _with_shape(("0", "bias"), (1,)), torch.ones(3)),
     ValueError, ("shapes", "0.bias", "(1,)", "(4,)")),
    ("functional-plain-tensor", lambda: tiny_f()(tiny_params(), torch.randn(5, 3)),
     TypeError, ("functional", "TensorDict", "Tensor", "batch_size")),
    ("call-plain-tensor-params", lambda: tdhook_fn.call(tiny_model(), torch.ones(3), torch.ones(3)),
     TypeError, ("params", "TensorDict", "tdhook_fn.params")),
    ("label-float", lambda: attribution.saliency(
        tiny_f(), tiny_params(), _td_of(torch.randn(5, 3), y=torch.full((5,), 1.7)), target=tdhook_fn.label("y")),
     TypeError, ("label('y')", "integer", "torch.float32")),
    ("label-missing-key", lambda: attribution.saliency(tiny_f(), tiny_params(), tiny_inputs(),
                                                       target=tdhook_fn.label("y")),
     KeyError, ("label('y')", "no 'y'", "input")),
    ("label-shape", lambda: attribution.saliency(
        tiny_f(), tiny_params(), _td_of(torch.randn(5, 3), y=torch.zeros(5, 2, dtype=torch.long)),
        target=tdhook_fn.label("y")),
     ValueError, ("label('y')", "(5, 2)", "one label per sample")),
    ("layers-never-run", lambda: attribution.saliency(
        tdhook_fn.functional(_WithSpare()), tdhook_fn.params(_WithSpare()), tiny_inputs(), target=0,
        layers=["spare"]),
     ValueError, ("'spare'", "never ran")),
    ("layers-a-string", lambda: attribution.saliency(tiny_f(), tiny_params(), tiny_inputs(), target=0, layers="[0]"),
     TypeError, ("layers", "list of submodule paths", "layers=['[0]']")),
    ("ig-layers-a-string", lambda: attribution.integrated_gradients(
        tiny_f(), tiny_params(), tiny_inputs(), 0.0, target=0, layers="[0]"),
     TypeError, ("integrated_gradients", "layers=['[0]']")),
    ("grad-cam-layers-a-list", lambda: attribution.grad_cam(tiny_f(), tiny_params(), tiny_inputs(), target=0,
                                                             layers=["[0]"]),
     TypeError, ("grad_cam", "map each submodule path to a DimsConfig")),
    ("ig-method-a-list", lambda: attribution.integrated_gradients(
        tiny_f(), tiny_params(), tiny_inputs(), 0.0, target=0, method=["riemann_left"]),
     ValueError, ("unknown integration method", "riemann_left", "gausslegendre")),
    ("saliency-inputs-a-list", lambda: attribution.saliency(tiny_f(), tiny_params(), [torch.randn(5, 3)], target=0),
     TypeError, ("saliency", "inputs must be a TensorDict", "batch_size=[len(x)]")),
    ("saliency-model-as-f", lambda: attribution.saliency(tiny_model(), tiny_params(), tiny_inputs(), target=0),
     TypeError, ("saliency", "module Sequential", "tdhook_fn.functional(model)")),
    ("ig-model-as-f", lambda: attribution.integrated_gradients(tiny_model(), tiny_params(), tiny_inputs(), 0.0,
                                                               target=0),
     TypeError, ("integrated_gradients", "tdhook_fn.functional(model)")),
    ("saliency-batch-without-batch-size", lambda: attribution.saliency(
        tiny_f(), tiny_params(), TensorDict(input=torch.randn(5, 3)), target=0),
     ValueError, ("target 0", "batch is []", "batch_size")),
    ("saliency-integer-input", lambda: attribution.saliency(
        tdhook_fn.functional(nn.Embedding(5, 2), in_keys=["ids"]), tdhook_fn.params(nn.Embedding(5, 2)),
        TensorDict(ids=torch.zeros(3, 2, dtype=torch.long), batch_size=[3]), target=0),
     TypeError, ("saliency", "'ids'", "torch.int64", "embedding layer")),
    ("ig-interpolate-integer-input", lambda: attribution.integrated_gradients(
        tdhook_fn.functional(nn.Embedding(5, 2), in_keys=["ids"]), tdhook_fn.params(nn.Embedding(5, 2)),
        TensorDict(ids=torch.zeros(3, 2, dtype=torch.long), batch_size=[3]), 0.0, target=0, layers=[""],
        interpolate="inputs", use_inputs=False),
     TypeError, ("integrated_gradients", "'ids'", "cannot be interpolated", "interpolate='layers'")),
    ("grad-cam-dim-out-of-range", lambda: attribution.grad_cam(*_cnn(), target=0,
                                                                layers={"[1]": attribution.DimsConfig((5,))}),
     ValueError, ("grad_cam", "'[1]'", "dim 5", "3 dims", "[4, 6, 6]")),
    ("grad-cam-tdhook-style-dims", lambda: attribution.grad_cam(
        *_cnn(), target=0, layers={"[1]": attribution.DimsConfig((2, 3), (1,))}),
     ValueError, ("grad_cam", "dim 3", "counting the batch dim", "subtract 1", "compat")),
    ("compat-grad-cam-dim-out-of-range", lambda: _compat_grad_cam((5,)),
     ValueError, ("grad_cam", "dim 4", "dim 5 counting the batch dim")),
    ("grad-cam-empty-dims", lambda: attribution.grad_cam(*_cnn(), target=0,
                                                          layers={"[1]": attribution.DimsConfig(None, ())}),
     ValueError, ("grad_cam", "'[1]'", "feature_sum_dims", "every dim", "mix samples", "None")),
    ("compat-grad-cam-empty-dims", lambda: _compat_grad_cam(()),
     ValueError, ("GradCAM", "dims ()", "mixes samples", "None")),
    ("compat-attribution-hooked-tensor", lambda: _saliency_on_a_tensor(),
     TypeError, ("Saliency", "on a TensorDict", "got Tensor", "['input']")),
    ("layer-output-a-tuple", lambda: attribution.saliency(
        tdhook_fn.functional(_TupleBlock()), tdhook_fn.params(_TupleBlock()), tiny_inputs(), target=0,
        layers=["block"]),
     TypeError, ("saliency", "'block'", "outputs a tuple", "one tensor")),
    ("path-error-public", lambda: tdhook_fn.resolve_path(tiny_model(), "train(False)"),
     tdhook_fn.PathError, ("train", "not allowed")),
]


def _compat_grad_cam(dims: tuple[int, ...]) -> Any:
    from tdhook_fn.compat.attribution import GradCAM
    from tdhook_fn.compat.attribution.grad_cam import DimsConfig

    f, _, td = _cnn()
    with GradCAM({"[1]": DimsConfig(dims)}).prepare(f.model, in_keys=["input"],
                                                                   out_keys=["output"]) as hooked:
        return hooked(td)


# ---------------------------------------------------------------- data (dataset runs into an out_dir)


def _attribute_into(out: Path, **extra: Any) -> Any:
    import tdhook_fn.data

    return tdhook_fn.data.attribute(attribution.saliency, tiny_f(), tiny_params(), _DATA, out,
                                    **{"batch_size": 2, "target": 0, "progress": False, **extra})


_DATA = TensorDict(input=torch.randn(5, 3, generator=torch.Generator().manual_seed(0)), batch_size=[5])


def _in_an_out_dir(prepare: Callable[[Path], Any], **extra: Any) -> Any:
    """Run into a fresh out_dir once, ``prepare`` it (a context entered around the second run), run again."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        _attribute_into(out)
        with prepare(out):
            return _attribute_into(out, **extra)


@contextlib.contextmanager
def _held(out: Path) -> Iterator[None]:
    from tdhook_fn.data._lock import DirLock

    lock = DirLock(out)  # a second open file: its flock excludes this process's run as another process's would
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _corrupt_job(out: Path) -> Any:
    (out / "_job.json").write_text("{")
    return contextlib.nullcontext()


def _zero_rows(out: Path) -> Any:
    with open(out / "input.memmap", "r+b") as fh:
        fh.write(bytes(8))
    return contextlib.nullcontext()


def _not_ours() -> Any:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "notes.txt").write_text("mine")
        return _attribute_into(Path(tmp), overwrite=True)


DATA_ROWS: list[Row] = [
    ("data-out-dir-in-use", lambda: _in_an_out_dir(_held),
     RuntimeError, ("out_dir", "in use by process", str(os.getpid()), "wait", "another out_dir")),
    ("data-corrupt-job-file", lambda: _in_an_out_dir(_corrupt_job),
     ValueError, ("cannot read", "_job.json", "overwrite=True")),
    ("data-damaged-rows-resume-false", lambda: _in_an_out_dir(_zero_rows, resume=False),
     FileExistsError, ("batches [0]", "damaged", "resume=True", "overwrite=True")),
    ("data-another-job", lambda: _in_an_out_dir(lambda out: contextlib.nullcontext(), batch_size=3),
     ValueError, ("holds another job", "batch_size", "overwrite=True")),
    ("data-directory-not-ours", _not_ours, FileExistsError, ("not written by", "never deleted")),
]


# ---------------------------------------------------------------- paths


class _Holding(nn.Module):
    """A model holding objects that are not modules; no path may call, read or index into them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.checkpoint = pathlib.Path("/nonexistent/tdhook_fn/ckpt.pt")
        self.log = logging.getLogger("tdhook_fn.tests.error_catalogue")
        self.show = print

    def me(self) -> nn.Module:
        return self

    def log_of(self) -> logging.Logger:
        return self.log


class _WithFilters(nn.Module, logging.Filterer):
    """A user module inheriting a standard-library mixin."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        logging.Filterer.__init__(self)


def _resolve_in_holding(path: str) -> Any:
    return tdhook_fn.resolve_path(_Holding(), path)


PATHS_ROWS: list[Row] = [
    ("paths-call-on-a-non-module", lambda: _resolve_in_holding("checkpoint.unlink()"),
     tdhook_fn.PathError, ("'checkpoint.unlink()'", "'unlink'", "pathlib", "not an nn.Module", "your own methods")),
    ("paths-attribute-of-a-non-module", lambda: _resolve_in_holding("checkpoint.parent"),
     tdhook_fn.PathError, ("'checkpoint.parent'", "'parent'", "pathlib", "own attributes (__dict__)",
                           "property or __getattr__")),
    ("paths-index-a-tensor", lambda: _resolve_in_holding("lin.weight[0]"),
     tdhook_fn.PathError, ("'lin.weight[0]'", "indexing", "Parameter", "lists, tuples and dicts")),
    ("paths-later-call-no-class-defines", lambda: _resolve_in_holding("me().log.setLevel(50)"),
     tdhook_fn.PathError, ("'setLevel'", "no module class of this model defines", "before any call runs")),
    ("paths-later-call-on-a-non-module-result", lambda: _resolve_in_holding("log_of().me()"),
     tdhook_fn.PathError, ("'log_of' returned", "logging.Logger", "not an nn.Module")),
    ("paths-attribute-set-on-the-instance", lambda: _resolve_in_holding("show('x')"),
     tdhook_fn.PathError, ("'show'", "set on this _Holding", "not a method its class defines")),
    ("paths-inherited-library-method", lambda: tdhook_fn.resolve_path(_WithFilters(), "addFilter('x')"),
     tdhook_fn.PathError, ("'addFilter'", "is library code", "defined in logging", "your own methods")),
]


# ---------------------------------------------------------------- taps, targets, attribution patching (round 3)


def _gpt2_wpe(method: str) -> Any:
    """Layer attribution of GPT-2's positional embedding, whose output ``[1, T, D]`` is shared by the batch."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=20, n_positions=8)
    model = transformers.GPT2LMHeadModel(config).eval()
    f, p = tdhook_fn.pure(model, ["input_ids"], ["logits"])
    td = TensorDict(input_ids=torch.randint(0, 20, (3, 5)), batch_size=[3])
    last = lambda out: out["logits"][:, -1, 0]
    if method == "saliency":
        return attribution.saliency(f, p, td, target=last, layers=["transformer.wpe"], use_inputs=False)
    return attribution.integrated_gradients(f, p, td, 0.0, target=last, layers=["transformer.wpe"], use_inputs=False)


def _atp(metric: Callable[[TensorDict], torch.Tensor], inference: bool = False) -> Any:
    from tdhook_fn.latent import Site, attribution_patching

    sites = [Site("[1]", index=(i,)) for i in range(4)]
    f, p, clean, corrupted = tiny_f(), tiny_params(), tiny_inputs(), tiny_inputs()
    with torch.inference_mode(inference):
        return attribution_patching(f, p, clean, corrupted, sites, metric)


def _tap_call(*taps: tdhook_fn.Tap) -> Any:
    return tdhook_fn.call_with_taps(_WithSpare(), tdhook_fn.params(_WithSpare()), list(taps), torch.ones(2, 3))


def _saliency_in_inference_mode() -> Any:
    f, p, x = tiny_f(), tiny_params(), tiny_inputs()
    with torch.inference_mode():
        return attribution.saliency(f, p, x, target=0)


_FEWER = lambda out: TensorDict(o=out["output"][:2, 0], batch_size=[2])  # values for 2 of the 5 samples

ERRORS_ROUND3_ROWS: list[Row] = [
    # taps
    ("capture-keyed-like-an-output", lambda: tiny_f().with_taps(tdhook_fn.capture("[0]", key="output")),
     ValueError, ("capture('[0]')", "key 'output'", "out_keys", "another key")),
    ("two-captures-one-key", lambda: tiny_f().with_taps(tdhook_fn.capture("[0]", key="h"),
                                                        tdhook_fn.capture("[2]", key="h")),
     ValueError, ("2 captures", "one key 'h'", "'[0]'", "'[2]'", "its own key")),
    ("intervene-never-called", lambda: _tap_call(tdhook_fn.intervene("spare", torch.zeros_like)),
     ValueError, ("intervene('spare')", "never called module 'spare'", "did nothing")),
    ("capture-never-called", lambda: _tap_call(tdhook_fn.capture("spare")),
     ValueError, ("capture('spare')", "never called module 'spare'")),
    ("tap-call-beyond-runs", lambda: _tap_call(tdhook_fn.intervene("lin", torch.zeros_like, call=2)),
     ValueError, ("call=2", "module 'lin' once", "below 1")),
    # targets
    ("label-out-of-range", lambda: attribution.saliency(
        tiny_f(), tiny_params(), _td_of(torch.randn(5, 3), y=torch.tensor([0, 1, 2, 1, 7])),
        target=tdhook_fn.label("y")),
     ValueError, ("label('y')", "[2, 7]", "2 classes", "0 to 1")),
    ("label-negative", lambda: attribution.saliency(
        tiny_f(), tiny_params(), _td_of(torch.randn(5, 3), y=torch.tensor([0, -1, 1, 1, 0])),
        target=tdhook_fn.label("y")),
     ValueError, ("label('y')", "[-1]", "2 classes")),
    ("target-tensordict-other-batch", lambda: attribution.saliency(tiny_f(), tiny_params(), tiny_inputs(),
                                                                   target=_FEWER),
     ValueError, ("TensorDict (batch size [2])", "'o'", "leading dims must be the batch [5]")),
    ("ig-target-tensordict-other-batch", lambda: attribution.integrated_gradients(
        tiny_f(), tiny_params(), tiny_inputs(), 0.0, target=_FEWER, n_steps=4),
     ValueError, ("TensorDict (batch size [2])", "leading dims must be the batch [4, 5]")),
    ("saliency-inference-mode", _saliency_in_inference_mode,
     ValueError, ("does not depend differentiably", "autograd is off", "torch.inference_mode()", "outside")),
    # layers without a batch dim
    ("saliency-gpt2-wpe-layer", lambda: _gpt2_wpe("saliency"),
     ValueError, ("saliency", "'transformer.wpe'", "[1, 5, 8]", "not the batch", "positional embedding")),
    ("ig-gpt2-wpe-layer", lambda: _gpt2_wpe("integrated_gradients"),
     ValueError, ("integrated_gradients", "'transformer.wpe'", "not the batch", "attribute a layer after")),
    # attribution patching
    ("atp-metric-argmax", lambda: _atp(lambda out: out["output"].argmax(-1).float()),
     ValueError, ("attribution_patching", "metric", "does not depend differentiably", "argmax", "estimate would be 0")),
    ("atp-inference-mode", lambda: _atp(lambda out: out["output"][..., 0], inference=True),
     ValueError, ("attribution_patching", "autograd is off", "torch.inference_mode()", "torch.no_grad()")),
]


# ---------------------------------------------------------------- latent


class _BlockTwice(nn.Module):
    """One block called twice in a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.block(x)))


def _sweep_a_block_that_runs_twice() -> Any:
    from tdhook_fn.latent import Site, patching_sweep

    model = _BlockTwice().eval()
    return patching_sweep(tdhook_fn.functional(model), tdhook_fn.params(model), tiny_inputs(), tiny_inputs(),
                          [Site("block", index=(0,))], lambda out: out["output"][..., 0])


LATENT_ROWS: list[Row] = [
    ("patching-sweep-site-runs-twice", _sweep_a_block_that_runs_twice,
     ValueError, ("patching_sweep", "'block'", "ran 2 times", "Site(..., call=k)")),
]


# ---------------------------------------------------------------- core: the shadow a call runs on


class _ForwardObject:
    """A forward object holding its module weakly (what nnsight's NNsight installs on every module)."""

    def __init__(self, module: nn.Module) -> None:
        self.module_ref = weakref.ref(module)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.module_ref().weight)


def _with_forward_object() -> nn.Sequential:
    model = tiny_model()
    model[0].forward = _ForwardObject(model[0])
    return model


class _ParamInANamespace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.store = types.SimpleNamespace(weight=self.lin.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.store.weight


CORE_SHADOW_ROWS: list[Row] = [
    ("call-params-none", lambda: tdhook_fn.call(tiny_model(), None, torch.ones(3)),
     TypeError, ("call", "params is None", "tdhook_fn.params(model)")),
    ("call-with-taps-params-none", lambda: tdhook_fn.call_with_taps(tiny_model(), None, [], torch.ones(3)),
     TypeError, ("call_with_taps", "params is None", "tdhook_fn.params(model)")),
    ("functional-params-none", lambda: tiny_f()(None, tiny_inputs()),
     TypeError, ("functional", "params is None", "tdhook_fn.params(model)")),
    ("forward-object-reaches-module", lambda: tdhook_fn.call(_with_forward_object(), tiny_params(), torch.ones(3)),
     ValueError, ("module '0'", "forward", "_ForwardObject", "reaches module '0'", ".module_ref()", "copy")),
    ("attribute-object-holds-parameter", lambda: tdhook_fn.call(_ParamInANamespace(),
                                                                tdhook_fn.params(_ParamInANamespace()),
                                                                torch.ones(3)),
     ValueError, ("'<root>'", "attribute 'store'", "reaches tensor 'lin.weight'", ".weight", "registered")),
]


# ---------------------------------------------------------------- attribution metrics


def _infidelity_call(**overrides: Any) -> Any:
    f, p = tiny_f(), tiny_params()
    x = torch.randn(4, 3)
    args: dict[str, Any] = {"target": 1, "n_perturb_samples": 2}
    args.update(overrides)
    attr = args.pop("attributions", torch.zeros_like(x))
    perturb = args.pop("perturb_func", lambda x: (0.1 * x, 0.9 * x))
    return attribution.metrics.infidelity(f, p, perturb, x, attr, **args)


def _sensitivity_call(**overrides: Any) -> Any:
    f, p = tiny_f(), tiny_params()
    x = TensorDict(input=torch.randn(4, 3), batch_size=[4])
    explain = overrides.pop("explanation_func", functools.partial(attribution.saliency, f, p, target=1))
    return attribution.metrics.sensitivity_max(explain, x, **overrides)


def _metric_without_attributions() -> Any:
    with Saliency().prepare(tiny_model()) as hooked:
        return SensitivityMetric()(hooked, tiny_inputs())


METRICS_ROWS: list[Row] = [
    ("infidelity-n-perturb-samples", lambda: _infidelity_call(n_perturb_samples=0),
     ValueError, ("infidelity", "n_perturb_samples", "positive int")),
    ("infidelity-chunk-size", lambda: _infidelity_call(chunk_size=0), ValueError, ("infidelity", "chunk_size")),
    ("infidelity-attribution-shape", lambda: _infidelity_call(attributions=torch.zeros(4, 2)),
     ValueError, ("infidelity", "attributions", "shape", "[4, 2]")),
    ("infidelity-perturb-returns-one", lambda: _infidelity_call(perturb_func=lambda x: x),
     TypeError, ("infidelity", "perturb_func", "(perturbations, perturbed_inputs)")),
    ("infidelity-perturb-not-callable", lambda: _infidelity_call(perturb_func=3),
     TypeError, ("perturb_func", "callable")),
    ("infidelity-baselines-batch", lambda: attribution.metrics.infidelity(
        tiny_f(), tiny_params(), lambda x, b: (x - b, b), tiny_inputs(), tiny_inputs(), target=1,
        baselines=TensorDict(input=torch.zeros(2, 3), batch_size=[2])),
     ValueError, ("infidelity", "baselines", "batch size", "one baseline per sample")),
    ("infidelity-attribution-batch", lambda: attribution.metrics.infidelity(
        tiny_f(), tiny_params(), lambda x: (x, x), tiny_inputs(), TensorDict(input=torch.zeros(5, 3)), target=1),
     ValueError, ("infidelity", "attributions", "batch size", "[5]")),
    ("infidelity-attribution-unknown-key", lambda: attribution.metrics.infidelity(
        tiny_f(), tiny_params(), lambda x: (x, x), tiny_inputs(), TensorDict(z=torch.zeros(5, 3), batch_size=[5]),
        target=1), KeyError, ("infidelity", "attributions", "'z'")),
    ("infidelity-perturb-wrong-shape", lambda: _infidelity_call(perturb_func=lambda x: (x[:1], x)),
     ValueError, ("infidelity", "perturb_func", "perturbations")),
    ("sensitivity-norm-ord", lambda: _sensitivity_call(norm_ord="nuc"),
     ValueError, ("sensitivity_max", "norm_ord", "'nuc'")),
    ("sensitivity-explanation-not-callable", lambda: _sensitivity_call(explanation_func=None),
     TypeError, ("sensitivity_max", "explanation_func", "callable")),
    ("sensitivity-explanation-batch", lambda: _sensitivity_call(explanation_func=lambda td: td[:2]),
     ValueError, ("sensitivity_max", "explanation_func", "batch size")),
    ("sensitivity-perturb-unknown-key", lambda: _sensitivity_call(
        perturb_func=lambda td, r: td.set("z", td["input"])),
     KeyError, ("sensitivity_max", "perturb_func", "'z'")),
    ("compat-metric-not-hooked", lambda: InfidelityMetric()(tiny_model(), tiny_inputs()),
     TypeError, ("InfidelityMetric", "module", "hooked module", "prepare(model)")),
    ("compat-metric-no-attributions", _metric_without_attributions,
     KeyError, ("SensitivityMetric", "no attributions", "'input'", "hooked(data)")),
]


# ---------------------------------------------------------------- latent: intrinsic dimension


def _dimension(name: str) -> Any:
    from tdhook_fn.latent import dimension

    return getattr(dimension, name)


DIMENSION_ROWS: list[Row] = [
    ("two-nn-too-few-points", lambda: _dimension("two_nn")(torch.randn(2, 3)),
     ValueError, ("two_nn", "at least 3 points", "N=2")),
    ("two-nn-integer-points", lambda: _dimension("two_nn")(torch.ones(4, 3, dtype=torch.long)),
     TypeError, ("two_nn", "floating-point", "x.float()")),
    ("two-nn-not-a-tensor", lambda: _dimension("two_nn")([[0.0, 1.0]]),
     TypeError, ("two_nn", "must be a tensor", "list")),
    ("two-nn-one-dim", lambda: _dimension("two_nn")(torch.randn(5)),
     ValueError, ("two_nn", "(..., N, D)", "(5,)")),
    ("two-nn-discard-fraction", lambda: _dimension("two_nn")(torch.randn(9, 3), discard_fraction=1.0),
     ValueError, ("two_nn", "discard_fraction", "[0, 1)", "1.0")),
    ("dimension-negative-eps", lambda: _dimension("local_knn")(torch.randn(9, 3), 2, eps=-1.0),
     ValueError, ("local_knn", "eps", ">= 0", "-1.0")),
    ("local-knn-too-few-points", lambda: _dimension("local_knn")(torch.randn(4, 3), 2),
     ValueError, ("local_knn", "at least 5 points", "2k + 1", "k=2", "N=4")),
    ("dimension-k-zero", lambda: _dimension("local_pca")(torch.randn(9, 3), 0),
     ValueError, ("local_pca", "k must be at least 1", "0")),
    ("dimension-k-float", lambda: _dimension("ca_pca")(torch.randn(9, 3), 2.5),
     TypeError, ("ca_pca", "k must be an int", "float")),
    ("local-pca-criterion", lambda: _dimension("local_pca")(torch.randn(9, 3), 2, criterion="median"),
     ValueError, ("local_pca", "criterion", "'gap'", "'median'")),
    ("local-pca-alpha", lambda: _dimension("local_pca")(torch.randn(9, 3), 2, alpha=1.5),
     ValueError, ("local_pca", "alpha", "(0, 1)", "1.5")),
    ("ca-pca-support", lambda: _dimension("ca_pca")(torch.randn(9, 3), 2, support=1.0),
     ValueError, ("ca_pca", "support", "[0, 1)", "1.0")),
    ("ca-pca-too-few-points", lambda: _dimension("ca_pca")(torch.randn(6, 3), 5),
     ValueError, ("ca_pca", "at least 7 points", "k + 2", "N=6")),
]


def _constant_layer() -> Any:
    from tdhook_fn.latent.similarity import cka

    acts = torch.randn(3, 20, 4)
    acts[2] = 1.0
    return cka(acts[:, None], acts[None, :])


def _similarity(name: str, *args: Any, **kwargs: Any) -> Callable[[], Any]:
    def call() -> Any:
        from tdhook_fn.latent import similarity

        return getattr(similarity, name)(*args, **kwargs)

    return call


SIMILARITY_ROWS: list[Row] = [
    ("cka-constant-representation", _constant_layer,
     ValueError, ("cka", "x is constant", "batch index (2, 0)", "tdhook returns NaN")),
    ("cka-bad-kernel", _similarity("cka", torch.randn(5, 2), torch.randn(5, 2), kernel="cosine"),
     ValueError, ("cka", "kernel must be one of", "'cosine'")),
    ("cka-bad-sigma", _similarity("cka", torch.randn(5, 2), torch.randn(5, 2), kernel="rbf", sigma=-1.0),
     ValueError, ("cka", "sigma", "positive")),
    ("cka-rbf-median-zero", _similarity("cka", torch.eye(6, 2)[[0, 2, 3, 4, 5, 5]], torch.randn(6, 2), kernel="rbf"),
     ValueError, ("cka", "median distance is 0", "sigma=")),
    ("cka-debiased-too-few", _similarity("cka", torch.randn(3, 2), torch.randn(3, 2), debiased=True),
     ValueError, ("cka", "at least 4 samples")),
    ("similarity-sample-counts", _similarity("information_imbalance", torch.randn(5, 2), torch.randn(6, 2)),
     ValueError, ("information_imbalance", "matching sample counts", "5", "6")),
    ("similarity-batch-broadcast", _similarity("cka", torch.randn(2, 5, 2), torch.randn(3, 5, 2)),
     ValueError, ("cka", "do not broadcast", "x[:, None]")),
    ("similarity-not-finite", _similarity("information_imbalance", torch.randn(5, 2), torch.full((5, 2), float("nan"))),
     ValueError, ("information_imbalance", "y holds NaN")),
    ("imbalance-bad-p", _similarity("information_imbalance", torch.randn(5, 2), torch.randn(5, 2), p=-2),
     ValueError, ("information_imbalance", "p must be", "positive")),
    ("similarity-complex", _similarity("cka", torch.randn(5, 2, dtype=torch.complex64), torch.randn(5, 2)),
     TypeError, ("cka", "x is complex", ".abs()")),
]


# ---------------------------------------------------------------- compat.latent.probing and its training functions


def _probe_missing_item() -> Any:
    from tdhook_fn.compat.latent.probing import Probing

    class Quiet:
        def step(self, data: Any, **kwargs: Any) -> None:
            return None

    context = Probing("0", lambda name, direction: Quiet(), additional_keys=["labels"])
    with context.prepare(tiny_model()) as hooked:
        hooked(tiny_inputs())


def _bilinear_pair_left_waiting() -> Any:
    from tdhook_fn.compat.latent.probing import BilinearProbeManager
    from tdhook_fn.compat.latent.probing.estimators import BilinearEstimator

    manager = BilinearProbeManager([("a", "b")], BilinearEstimator, {"d_latent1": 3, "d_latent2": 3},
                                   lambda p, y: {})
    probe = manager.probe_factory("a", "fwd")
    manager.before_all()
    probe.step(torch.randn(2, 3), labels=torch.zeros(2, 1), step_type="predict")
    manager.after_all()


def _mean_difference(y: list[Any]) -> Any:
    import numpy as np

    from tdhook_fn.compat.latent.probing import MeanDifferenceClassifier

    return MeanDifferenceClassifier().fit(np.random.randn(len(y), 3), np.array(y))


def _probe_bad_step_type() -> Any:
    from tdhook_fn.compat.latent.probing import Probe

    Probe(object(), print).step(torch.ones(2, 3), step_type="train")


def _unfitted_coef() -> Any:
    from tdhook_fn.compat.latent.probing import MeanDifferenceClassifier

    return MeanDifferenceClassifier().coef_


def _probe_training() -> Any:
    from tdhook_fn.latent import _probe_training

    return _probe_training


def _estimator(**kwargs: Any) -> Any:
    from tdhook_fn.compat.latent.probing import LinearEstimator

    return LinearEstimator(d_latent=3, epochs=1, **kwargs)


COMPAT_PROBING_ROWS: list[Row] = [
    ("probing-additional-key-missing", _probe_missing_item,
     KeyError, ("Probing", "['labels']", "not in the input TensorDict", "add them", "additional_keys")),
    ("bilinear-probe-pair-waiting", _bilinear_pair_left_waiting,
     ValueError, ("still waiting on keys", "['a', 'b']", "key_pattern matches both")),
    ("probe-step-type", _probe_bad_step_type,
     ValueError, ("step_type must be 'fit' or 'predict'", "'train'")),
    ("mean-difference-labels-not-0-1", lambda: _mean_difference([0, 1, 2, 1]),
     ValueError, ("MeanDifferenceClassifier", "0/1 labels", "[0, 1, 2]", "map the positive class to 1")),
    ("mean-difference-one-class", lambda: _mean_difference([1, 1, 1]),
     ValueError, ("Both classes must be present", "labelled 0", "labelled 1")),
    ("mean-difference-multiclass", lambda: _mean_difference([[1, 0], [0, 1]]),
     ValueError, ("Multiclass classification not supported", "(N,) labels")),
    ("mean-difference-not-fitted", _unfitted_coef, ValueError, ("not fitted", "call fit(X, y)")),
    ("estimator-rows-mismatch", lambda: _estimator(num_classes=2).fit(torch.randn(5, 3), y=torch.zeros(4).long()),
     ValueError, ("fit", "one row per target", "[5] rows for 4 targets")),
    ("estimator-linear-two-inputs", lambda: _estimator()(torch.randn(2, 3), torch.randn(2, 3)),
     ValueError, ("Linear estimator expects 1 input tensor", "got 2")),
    ("probe-loss-regression-shape", lambda: _estimator()._loss_fn(torch.zeros(4, 1), torch.zeros(4)),
     ValueError, ("does not match target shape", "reshape y to (N, 1)")),
    ("probe-loss-class-shape", lambda: _estimator(num_classes=3)._loss_fn(torch.zeros(4, 2), torch.zeros(4).long()),
     ValueError, ("does not match target shape", "(N,) indices for (N, 3) scores")),
    ("probe-scores-kind", lambda: _probe_training().probe_scores("cubic", {}, torch.ones(1, 2)),
     ValueError, ("probe_scores", "kind must be one of", "'cubic'")),
    ("adam-epoch-order", lambda: _probe_training().adam_epoch(
        "linear", {}, _probe_training().adam_init({}), (torch.ones(4, 2),), torch.ones(4, 1), torch.arange(3),
        num_classes=None),
     ValueError, ("adam_epoch", "permutation of the 4 samples", "(3,)")),
    ("adam-epoch-batch-size", lambda: _probe_training().adam_epoch(
        "linear", {}, _probe_training().adam_init({}), (torch.ones(4, 2),), torch.ones(4, 1), torch.arange(4),
        num_classes=None, batch_size=0),
     ValueError, ("adam_epoch", "batch_size must be at least 1", "got 0")),
]


# ---------------------------------------------------------------- latent.probing


def _probe_acts() -> TensorDict:
    g = torch.Generator().manual_seed(0)
    return TensorDict(a=torch.randn(20, 3, generator=g), b=torch.randn(20, 5, generator=g), batch_size=[20])


def _probe_labels() -> torch.Tensor:
    return torch.arange(20) % 3


def _probing():  # imported where used: the module is new, the catalogue must not fail to import without it
    from tdhook_fn.latent import probing
    return probing


PROBING_ROWS: list[Row] = [
    ("probing-n-mismatch", lambda: _probing().fit_probes(_probe_acts(), _probe_labels()[:7]),
     ValueError, ("fit_probes", "labels", "(7,)", "N=20")),
    ("probing-site-n-mismatch", lambda: _probing().fit_probes(
        TensorDict(a=torch.randn(20, 3), b=torch.randn(9, 3)), _probe_labels()),
     ValueError, ("fit_probes", "acts['b']", "N=9", "same samples")),
    ("probing-one-class", lambda: _probing().fit_probes(_probe_acts(), _probe_labels() * 0),
     ValueError, ("fit_probes", "1 class", "at least 2")),
    ("probing-bad-kind", lambda: _probing().fit_probes(_probe_acts(), _probe_labels(), kind="svm"),
     ValueError, ("fit_probes", "kind", "'svm'", "'ridge'")),
    ("probing-non-finite", lambda: _probing().fit_probes(
        _probe_acts().set("b", torch.full((20, 5), float("inf"))), _probe_labels()),
     ValueError, ("fit_probes", "'b'", "nan or infinity")),
    ("probing-singular", lambda: _probing().fit_probes(
        TensorDict(z=torch.zeros(20, 3)), _probe_labels(), alpha=0.0),
     ValueError, ("fit_probes", "'z'", "singular", "alpha > 0")),
    ("probing-integer-acts", lambda: _probing().fit_probes(TensorDict(a=torch.ones(20, 3, dtype=torch.long)),
                                                           _probe_labels()),
     TypeError, ("fit_probes", "acts['a']", "floating point")),
    ("probing-mean-difference-classes", lambda: _probing().fit_probes(_probe_acts(), _probe_labels(),
                                                                      kind="mean_difference"),
     ValueError, ("fit_probes", "exactly 2 classes")),
    ("probing-predict-missing-site", lambda: _probing().predict_probes(
        _probing().fit_probes(_probe_acts(), _probe_labels()), _probe_acts().exclude("a")),
     ValueError, ("predict_probes", "no site 'a'")),
    ("probing-merge-classes", lambda: _probing().merge_ridge_statistics(
        _probing().ridge_statistics(_probe_acts(), _probe_labels()),
        _probing().ridge_statistics(_probe_acts(), _probe_labels() % 2)),
     ValueError, ("merge_ridge_statistics", "'a'", "mean_y", "same sites and labels")),
    ("probing-bilinear-rank", lambda: _probing().fit_bilinear_probes(torch.randn(20, 3), torch.randn(20, 2),
                                                                     _probe_labels(), rank=0),
     ValueError, ("fit_bilinear_probes", "rank", "positive int")),
    ("probing-vmap-classes", lambda: torch.vmap(lambda x: _probing().fit_probes(x, _probe_labels()))(
        torch.randn(2, 20, 3)),
     ValueError, ("fit_probes", "vmap", "classes=")),
]


def _dl_model() -> tuple[Any, Any]:
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    return tdhook_fn.functional(net), tdhook_fn.params(net)


def _deeplift() -> Any:
    from tdhook_fn.attribution import _deeplift

    return _deeplift


def _deeplift_shap() -> Any:
    from tdhook_fn.attribution import _deeplift_shap

    return _deeplift_shap


class _PairwiseReLU(nn.Module):
    """A ReLU fed a tensor whose first dim is not the batch (the rescale rule cannot split it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act = nn.Linear(3, 4), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x).T).T.sum(-1, keepdim=True)


DEEPLIFT_ROWS: list[Row] = [
    ("deeplift-eps", lambda: _deeplift().deeplift(*_dl_model(), torch.randn(2, 3), target=0, eps=-1.0),
     ValueError, ("deeplift", "eps", ">= 0")),
    ("deeplift-not-functional", lambda: _deeplift().deeplift(lambda p, td: td, _dl_model()[1], torch.randn(2, 3),
                                                             target=0),
     TypeError, ("deeplift", "Functional", "tdhook_fn.functional")),
    ("deeplift-baseline-shape", lambda: _deeplift().deeplift(*_dl_model(), torch.randn(2, 3), torch.randn(5),
                                                             target=0),
     ValueError, ("deeplift", "baselines", "broadcast")),
    ("deeplift-batch-not-first", lambda: _deeplift().deeplift(
        tdhook_fn.functional(_PairwiseReLU()), tdhook_fn.params(_PairwiseReLU()), torch.randn(2, 3), target=0),
     ValueError, ("deeplift", "'act'", "batch", "first dim")),
    ("layer-deeplift-no-layers", lambda: _deeplift().layer_deeplift(*_dl_model(), torch.randn(2, 3), target=0,
                                                                    layers=[]),
     ValueError, ("layer_deeplift", "layers is empty", "deeplift")),
    ("layer-deeplift-str-layers", lambda: _deeplift().layer_deeplift(*_dl_model(), torch.randn(2, 3), target=0,
                                                                     layers="[1]"),
     TypeError, ("layer_deeplift", "layers", "list")),
    ("deeplift-shap-not-distribution", lambda: _deeplift_shap().deeplift_shap(*_dl_model(), torch.randn(2, 3), 0.0,
                                                                              target=0),
     TypeError, ("deeplift_shap", "distribution", "[K, ...]")),
    ("deeplift-shap-reference-shape", lambda: _deeplift_shap().deeplift_shap(
        *_dl_model(), torch.randn(2, 3), torch.randn(4, 5), target=0),
     ValueError, ("deeplift_shap", "'input'", "one sample's shape")),
    ("deeplift-shap-missing-key", lambda: _deeplift_shap().deeplift_shap(
        *_dl_model(), torch.randn(2, 3), TensorDict(other=torch.randn(4, 3), batch_size=[4]), target=0),
     KeyError, ("deeplift_shap", "'input'", "attributed input")),
]


# ---------------------------------------------------------------- attribution: perturbation methods


def _perturbation(name: str) -> Any:
    module = __import__(f"tdhook_fn.attribution._{name}", fromlist=[name])
    return getattr(module, name)


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 2), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(y)


def _two_inputs_call(name: str, **options: Any) -> Any:
    model = _TwoInputs()
    f = tdhook_fn.functional(model, ["x", "y"], ["output"])
    td = TensorDict(x=torch.randn(3, 4), y=torch.randn(3, 3), batch_size=[3])
    return _perturbation(name)(f, tdhook_fn.params(model), td, target=0, **options)


def _perturbation_call(name: str, x: torch.Tensor | None = None, **options: Any) -> Any:
    f, p = tdhook_fn.pure(tiny_model())
    return _perturbation(name)(f, p, torch.randn(4, 3) if x is None else x, target=options.pop("target", 1),
                               **options)


PERTURBATION_ROWS: list[Row] = [
    ("occlusion-window-too-large", lambda: _perturbation_call("occlusion", sliding_window_shapes=(4,)),
     ValueError, ("occlusion", "sliding window (4,)", "larger than one sample")),
    ("occlusion-stride-past-window", lambda: _perturbation_call("occlusion", sliding_window_shapes=(1,), strides=2),
     ValueError, ("occlusion", "stride 2", "window 1", "never be occluded")),
    ("occlusion-window-dims", lambda: _perturbation_call("occlusion", sliding_window_shapes=(1, 1)),
     ValueError, ("occlusion", "sliding_window_shapes", "2 dims", "one sample has 1")),
    ("occlusion-window-not-a-tuple", lambda: _perturbation_call("occlusion", sliding_window_shapes=2),
     TypeError, ("occlusion", "sliding_window_shapes", "tuple of ints", "2")),
    ("occlusion-window-zero", lambda: _perturbation_call("occlusion", sliding_window_shapes=(0,)),
     ValueError, ("occlusion", "positive", "(0,)")),
    ("occlusion-two-inputs-one-window", lambda: _two_inputs_call("occlusion", sliding_window_shapes=(2,)),
     TypeError, ("occlusion", "2 inputs", "sliding_window_shapes", "dict")),
    ("occlusion-window-missing-key", lambda: _two_inputs_call("occlusion", sliding_window_shapes={"x": (2,)}),
     KeyError, ("occlusion", "sliding_window_shapes", "'y'")),
    ("occlusion-window-unknown-key", lambda: _two_inputs_call(
        "occlusion", sliding_window_shapes={"x": (2,), "y": (1,), "z": (1,)}),
     KeyError, ("occlusion", "sliding_window_shapes", "'z'", "perturbed inputs")),
    ("feature-mask-float", lambda: _perturbation_call("feature_ablation", feature_mask=torch.zeros(1, 3)),
     TypeError, ("feature_ablation", "feature_mask", "integer feature ids", "torch.float32", ".long()")),
    ("feature-mask-shape", lambda: _perturbation_call("feature_ablation", feature_mask=torch.zeros(2, 2).long()),
     ValueError, ("feature_ablation", "feature_mask", "[2, 2]", "does not broadcast", "[4, 3]")),
    ("feature-mask-tensor-two-inputs", lambda: _two_inputs_call("feature_ablation",
                                                                feature_mask=torch.zeros(4).long()),
     TypeError, ("feature_ablation", "tensor feature_mask", "2 are", "dict")),
    ("feature-mask-missing-key", lambda: _two_inputs_call("feature_permutation",
                                                          feature_mask={"x": torch.zeros(4).long()}),
     KeyError, ("feature_permutation", "feature_mask", "'y'")),
    ("feature-mask-not-a-tensor", lambda: _perturbation_call("feature_ablation", feature_mask=[0, 1, 2]),
     TypeError, ("feature_ablation", "feature_mask", "list")),
    ("shapley-negative-ids", lambda: _perturbation_call("shapley_value_sampling",
                                                        feature_mask=torch.tensor([-1, 0, 1])),
     ValueError, ("shapley_value_sampling", "negative ids", "0, 1, 2")),
    ("shapley-n-samples", lambda: _perturbation_call("shapley_value_sampling", n_samples=0),
     ValueError, ("shapley_value_sampling", "n_samples", "positive int")),
    ("perturbation-chunk-size", lambda: _perturbation_call("occlusion", sliding_window_shapes=(1,), chunk_size=0),
     ValueError, ("occlusion", "chunk_size", "positive int")),
    ("permutation-one-sample", lambda: _perturbation_call("feature_permutation", x=torch.randn(1, 3)),
     ValueError, ("feature_permutation", "1 sample", "at least two")),
    ("perturbation-per-target-dims", lambda: _perturbation_call(
        "feature_ablation", target=lambda td: td["output"][..., None], per_target=True),
     ValueError, ("feature_ablation", "per_target", "[*batch, T]", "(2, 1)")),
    ("perturbation-integer-target", lambda: _perturbation_call(
        "feature_ablation", target=lambda td: td["output"].argmax(-1)),
     TypeError, ("feature_ablation", "target", "torch.int64", "floating point")),
    ("perturbation-unknown-input-key", lambda: _two_inputs_call("feature_ablation", input_keys=["z"]),
     KeyError, ("feature_ablation", "input_keys", "'z'")),
]


# ---------------------------------------------------------------- compat: tdhook's LRP rule API


def _rules() -> Any:
    from tdhook_fn.compat.attribution.lrp_helpers import rules

    return rules


class _TwoInputs(nn.Module):
    def forward(self, a: torch.Tensor, b: Any) -> torch.Tensor:
        return a + b


def _registered_call(rule: Any, module: nn.Module, *args: Any) -> Any:
    with rule.register(module):
        return module(*args)


def _registered_twice() -> None:
    layer = nn.Linear(2, 2)
    _rules().EpsilonRule().register(layer)
    _rules().PassRule().register(layer)


def _custom_rule_registered() -> None:
    class Custom(_rules().Rule):  # type: ignore[misc,name-defined]
        pass

    Custom().register(nn.Linear(2, 2))


def _nested_rules() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with _rules().EpsilonRule().register(model), _rules().EpsilonRule().register(model[0]):
        model(torch.ones(1, 2, requires_grad=True))


def _rule_inside_pure_call() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with _rules().EpsilonRule().register(model[0]):
        tdhook_fn.call(model, tdhook_fn.params(model), torch.ones(1, 2))


def _unconserved() -> None:
    hook = _rules().raise_for_unconserved_rel_factory()
    hook(nn.Linear(2, 2), torch.ones(2), torch.zeros(2))


LRP_RULES_ROWS: list[Row] = [
    ("lrp-rule-registered-twice", _registered_twice, ValueError, ("PassRule.register", "already has EpsilonRule",
                                                                  "remove it first")),
    ("lrp-rule-unregister-unknown", lambda: _rules().EpsilonRule().unregister(nn.Linear(2, 2)), ValueError,
     ("EpsilonRule.unregister", "not registered", "Linear")),
    ("lrp-rule-register-not-module", lambda: _rules().EpsilonRule().register("layer"), TypeError,
     ("EpsilonRule.register", "nn.Module", "str")),
    ("lrp-rule-register-custom", _custom_rule_registered, TypeError, ("Custom", "stands for no tdhook_fn rule",
                                                                      "relevance(call, grad)")),
    ("lrp-rule-nested", _nested_rules, ValueError, ("EpsilonRule", "Linear", "inside a Sequential",
                                                    "may not nest")),
    ("lrp-rule-in-pure-call", _rule_inside_pure_call, RuntimeError, ("EpsilonRule", "tdhook_fn pure function",
                                                                     "handle.remove()", "rule_mapper")),
    ("lrp-rule-alpha-beta-negative", lambda: _rules().AlphaBetaRule(-1.0, 1.0), ValueError,
     ("AlphaBetaRule", "must be non-negative", "alpha=-1.0")),
    ("lrp-rule-alpha-beta-difference", lambda: _rules().AlphaBetaRule(2.0, 0.5), ValueError,
     ("AlphaBetaRule", "alpha - beta must equal 1", "beta=0.5")),
    ("lrp-rule-multiple-inputs", lambda: _registered_call(_rules().AlphaBetaRule(), _TwoInputs(), torch.ones(2),
                                                          torch.ones(2)),
     NotImplementedError, ("AlphaBetaRule", "multiple inputs", "2 positional")),
    ("lrp-rule-pass-count", lambda: _registered_call(_rules().PassRule(), _TwoInputs(), torch.ones(2),
                                                     torch.ones(2)),
     ValueError, ("PassRule", "number of inputs and outputs", "2 inputs and 1 outputs")),
    ("lrp-rule-pass-shape", lambda: _registered_call(_rules().PassRule(), nn.Linear(3, 2), torch.ones(3)),
     ValueError, ("shape=torch.size([3])", "shape=torch.size([2])", "index 0")),
    ("lrp-rule-non-tensor", lambda: _registered_call(_rules().EpsilonRule(), _TwoInputs(), torch.ones(2), 3.0),
     TypeError, ("EpsilonRule", "_TwoInputs", "tensors as positional arguments", "one tensor returned")),
    ("lrp-rule-unconserved", _unconserved, RuntimeError, ("Unconserved relevance", "Linear", "inputs hold 2",
                                                          "outputs 0")),
]


# ---------------------------------------------------------------- attribution: conductance, internal influence


def _path_method(name: str) -> Any:
    import importlib

    module = {"layer_conductance": "_layer_conductance", "neuron_conductance": "_neuron_conductance",
              "internal_influence": "_internal_influence"}[name]
    return getattr(importlib.import_module(f"tdhook_fn.attribution.{module}"), name)


def _conductance(name: str, **options: Any) -> Any:
    return _path_method(name)(tiny_f(), tiny_params(), tiny_inputs(), **{"target": 0, **options})


CONDUCTANCE_ROWS: list[Row] = [
    ("conductance-no-layers", lambda: _conductance("layer_conductance", layers=[]),
     ValueError, ("layer_conductance", "layers is empty")),
    ("conductance-layers-str", lambda: _conductance("layer_conductance", layers="[0]"),
     TypeError, ("layer_conductance", "layers=['[0]']")),
    ("conductance-n-steps", lambda: _conductance("layer_conductance", layers=["[0]"], n_steps=0),
     ValueError, ("layer_conductance", "n_steps", ">= 1")),
    ("conductance-chunk-size", lambda: _conductance("layer_conductance", layers=["[0]"], chunk_size=0),
     ValueError, ("layer_conductance", "chunk_size", "path points per forward")),
    ("conductance-method", lambda: _conductance("layer_conductance", layers=["[0]"], method="simpson"),
     ValueError, ("'simpson'", "supported")),
    ("conductance-token-ids", lambda: _path_method("layer_conductance")(
        tdhook_fn.functional(nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2))),
        tdhook_fn.params(nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2))),
        torch.randint(0, 10, (2, 3)), 0, target=0, layers=["[2]"]),
     TypeError, ("layer_conductance", "torch.int64", "cannot move along a path", "input_keys")),
    ("conductance-plain-function", lambda: _path_method("layer_conductance")(
        lambda p, td: tiny_f()(p, td), tiny_params(), tiny_inputs(), target=0, layers=["[0]"]),
     TypeError, ("layer_conductance", "tdhook_fn.Functional", "tdhook_fn.pure(model)")),
    ("internal-influence-no-layers", lambda: _conductance("internal_influence", layers=[]),
     ValueError, ("internal_influence", "layers is empty")),
    ("internal-influence-baselines", lambda: _conductance("internal_influence", baselines=torch.zeros(2, 2),
                                                          layers=["[0]"]),
     ValueError, ("internal_influence", "baselines", "[2, 2]", "does not broadcast")),
    ("neuron-conductance-layer-list", lambda: _conductance("neuron_conductance", layer=["[0]"], neuron_selector=0),
     TypeError, ("neuron_conductance", "layer", "one submodule path")),
    ("neuron-conductance-selector-type", lambda: _conductance("neuron_conductance", layer="[0]",
                                                              neuron_selector=[0]),
     TypeError, ("neuron_conductance", "neuron_selector", "int", "callable")),
    ("neuron-conductance-selector-range", lambda: _conductance("neuron_conductance", layer="[0]",
                                                               neuron_selector=4),
     ValueError, ("neuron_conductance", "neuron_selector", "out of range", "[4]")),
    ("neuron-conductance-selector-dims", lambda: _conductance("neuron_conductance", layer="[0]",
                                                              neuron_selector=(0, 1)),
     ValueError, ("neuron_conductance", "neuron_selector", "2 indices", "1 dims")),
    ("neuron-conductance-selector-rows", lambda: _conductance("neuron_conductance", layer="[0]",
                                                              neuron_selector=lambda a: a[:, :2]),
     ValueError, ("neuron_conductance", "neuron_selector", "one value per row")),
    ("neuron-conductance-plain-function", lambda: _path_method("neuron_conductance")(
        lambda p, td: tiny_f()(p, td), tiny_params(), tiny_inputs(), target=0, layer="[0]", neuron_selector=0),
     TypeError, ("neuron_conductance", "tdhook_fn.Functional", "tdhook_fn.pure(model)")),
]


# ---------------------------------------------------------------- attribution: noise and modified-gradient methods


def _noise(name: str) -> Any:
    module = {"smoothgrad": "_smoothgrad", "gradient_shap": "_gradient_shap", "deconvolution": "_deconvolution",
              "guided_grad_cam": "_guided_grad_cam"}[name]
    return getattr(__import__(f"tdhook_fn.attribution.{module}", fromlist=[name]), name)


def _refs(n: int = 4) -> TensorDict:
    return TensorDict(input=torch.randn(n, 3), batch_size=[n])


def _tiny_cnn_f() -> tdhook_fn.Functional:
    torch.manual_seed(0)
    return tdhook_fn.functional(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)))


NOISE_ROWS: list[Row] = [
    ("smoothgrad-nt-type", lambda: _noise("smoothgrad")(tiny_f(), tiny_params(), tiny_inputs(), target=1,
                                                         nt_type="mean"),
     ValueError, ("smoothgrad", "nt_type", "'mean'", "vargrad")),
    ("smoothgrad-nt-samples", lambda: _noise("smoothgrad")(tiny_f(), tiny_params(), tiny_inputs(), target=1,
                                                            nt_samples=0),
     ValueError, ("smoothgrad", "nt_samples", "positive int")),
    ("smoothgrad-chunk-size", lambda: _noise("smoothgrad")(tiny_f(), tiny_params(), tiny_inputs(), target=1,
                                                            chunk_size=-1),
     ValueError, ("smoothgrad", "chunk_size")),
    ("smoothgrad-negative-stdev", lambda: _noise("smoothgrad")(tiny_f(), tiny_params(), tiny_inputs(), target=1,
                                                                stdevs=-0.1),
     ValueError, ("smoothgrad", "stdevs", "'input'", ">= 0")),
    ("smoothgrad-stdevs-count", lambda: _noise("smoothgrad")(tiny_f(), tiny_params(), tiny_inputs(), target=1,
                                                              stdevs=(0.1, 0.2)),
     ValueError, ("smoothgrad", "stdevs", "2 values", "1 attributed")),
    ("smoothgrad-stdevs-missing-key", lambda: _noise("smoothgrad")(tiny_f(), tiny_params(), tiny_inputs(), target=1,
                                                                    stdevs={"x": 0.1}),
     KeyError, ("smoothgrad", "stdevs", "'input'")),
    ("smoothgrad-token-ids", lambda: _noise("smoothgrad")(
        tiny_f(), tiny_params(), TensorDict(input=torch.ones(5, 3, dtype=torch.long), batch_size=[5]), target=1),
     TypeError, ("smoothgrad", "'input'", "torch.int64", "floating-point")),
    ("smoothgrad-attribution-with-delta", lambda: _noise("smoothgrad")(
        tiny_f(), tiny_params(), tiny_inputs(), 0.0, target=1, stdevs=0.1,
        attribution=functools.partial(attribution.integrated_gradients, return_convergence_delta=True)),
     ValueError, ("smoothgrad", "attribution", "tuple", "return_convergence_delta=False")),
    ("smoothgrad-attribution-not-callable", lambda: _noise("smoothgrad")(tiny_f(), tiny_params(), tiny_inputs(),
                                                                          target=1, attribution="saliency"),
     TypeError, ("smoothgrad", "attribution", "str")),
    ("gradient-shap-baselines-not-references", lambda: _noise("gradient_shap")(tiny_f(), tiny_params(),
                                                                                tiny_inputs(), 0.0, target=1),
     TypeError, ("gradient_shap", "baselines", "reference samples", "float")),
    ("gradient-shap-baselines-shape", lambda: _noise("gradient_shap")(
        tiny_f(), tiny_params(), tiny_inputs(), TensorDict(input=torch.zeros(4, 2), batch_size=[4]), target=1),
     ValueError, ("gradient_shap", "baselines", "'input'", "[2]", "[3]")),
    ("gradient-shap-baselines-batch-dims", lambda: _noise("gradient_shap")(
        tiny_f(), tiny_params(), tiny_inputs(), TensorDict(input=torch.zeros(2, 4, 3), batch_size=[2, 4]), target=1),
     ValueError, ("gradient_shap", "baselines", "one batch dim", "[2, 4]")),
    ("gradient-shap-baselines-missing-key", lambda: _noise("gradient_shap")(
        tiny_f(), tiny_params(), tiny_inputs(), TensorDict(x=torch.zeros(4, 3), batch_size=[4]), target=1),
     KeyError, ("gradient_shap", "baselines", "'input'")),
    ("gradient-shap-draws-batch", lambda: _noise("gradient_shap")(
        tiny_f(), tiny_params(), tiny_inputs(), _refs(), target=1, n_samples=3,
        draws=TensorDict(alpha=torch.rand(5, 2), index=torch.zeros(5, 2, dtype=torch.long), batch_size=[5, 2])),
     ValueError, ("gradient_shap", "draws", "[5, 3]", "[5, 2]")),
    ("gradient-shap-draws-missing-alpha", lambda: _noise("gradient_shap")(
        tiny_f(), tiny_params(), tiny_inputs(), _refs(), target=1, n_samples=2,
        draws=TensorDict(index=torch.zeros(5, 2, dtype=torch.long), batch_size=[5, 2])),
     KeyError, ("gradient_shap", "draws", "'alpha'")),
    ("gradient-shap-draws-index-range", lambda: _noise("gradient_shap")(
        tiny_f(), tiny_params(), tiny_inputs(), _refs(), target=1, n_samples=2,
        draws=TensorDict(alpha=torch.rand(5, 2), index=torch.full((5, 2), 4), batch_size=[5, 2])),
     ValueError, ("gradient_shap", "'index'", "integer indices", "4 baselines")),
    ("gradient-shap-n-samples", lambda: _noise("gradient_shap")(tiny_f(), tiny_params(), tiny_inputs(), _refs(),
                                                                 target=1, n_samples=1.5),
     ValueError, ("gradient_shap", "n_samples", "positive int")),
    ("deconvolution-plain-function", lambda: _noise("deconvolution")(
        lambda p, td: td, tiny_params(), tiny_inputs(), target=1),
     TypeError, ("deconvolution", "tdhook_fn.Functional", "tdhook_fn.functional(model)")),
    ("guided-grad-cam-layer-list", lambda: _noise("guided_grad_cam")(
        _tiny_cnn_f(), tdhook_fn.params(_tiny_cnn_f().model), torch.randn(2, 1, 6, 6), target=1, layer=["[0]"]),
     TypeError, ("guided_grad_cam", "layer", "one submodule path")),
    ("guided-grad-cam-flat-inputs", lambda: _noise("guided_grad_cam")(tiny_f(), tiny_params(), tiny_inputs(),
                                                                       target=1, layer="[0]"),
     ValueError, ("guided_grad_cam", "channel dim", "spatial")),
    ("guided-grad-cam-flat-layer", lambda: _noise("guided_grad_cam")(
        _tiny_cnn_f(), tdhook_fn.params(_tiny_cnn_f().model), torch.randn(2, 1, 6, 6), target=1, layer="[3]"),
     ValueError, ("guided_grad_cam", "'[3]'", "[c, *spatial]")),
]


# ---------------------------------------------------------------- attribution: surrogate models (LIME, KernelSHAP)


def _surrogate(name: str, **overrides: Any) -> Any:
    from tdhook_fn.attribution._kernel_shap import kernel_shap
    from tdhook_fn.attribution._lime import lime

    method = {"lime": lime, "kernel_shap": kernel_shap}[name]
    return method(tiny_f(), tiny_params(), tiny_inputs(), **{"target": 1, "n_samples": 6, **overrides})


def _shapley_samples(n_features: int) -> Any:
    from tdhook_fn.attribution._kernel_shap import shapley_kernel_samples

    return shapley_kernel_samples(n_features, 5)


SURROGATE_ROWS: list[Row] = [
    ("surrogate-float-feature-mask", lambda: _surrogate("lime", feature_mask=torch.zeros(3)),
     TypeError, ("lime", "feature_mask", "'input'", "integer")),
    ("surrogate-feature-mask-shape", lambda: _surrogate("kernel_shap", feature_mask=torch.arange(4)),
     ValueError, ("kernel_shap", "feature_mask", "[4]", "broadcast")),
    ("surrogate-feature-mask-negative", lambda: _surrogate("lime", feature_mask=torch.tensor([-1, 0, 1])),
     ValueError, ("lime", "feature_mask", "-1")),
    ("surrogate-feature-mask-missing-key", lambda: _surrogate("lime", feature_mask={"other": torch.arange(3)}),
     KeyError, ("lime", "feature_mask", "'input'")),
    ("surrogate-feature-mask-type", lambda: _surrogate("lime", feature_mask=[0, 1, 2]),
     TypeError, ("lime", "feature_mask", "list")),
    ("surrogate-samples-shape", lambda: _surrogate("lime", n_samples=None, samples=torch.ones(4, 2)),
     ValueError, ("lime", "samples", "[4, 2]", "3 features")),
    ("surrogate-samples-values", lambda: _surrogate("kernel_shap", n_samples=None,
                                                    samples=torch.full((4, 3), 0.5)),
     ValueError, ("kernel_shap", "samples", "zeros and ones")),
    ("surrogate-samples-and-n-samples", lambda: _surrogate("lime", samples=torch.ones(4, 3)),
     ValueError, ("lime", "n_samples=6", "4 rows")),
    ("surrogate-n-samples", lambda: _surrogate("kernel_shap", n_samples=0),
     ValueError, ("kernel_shap", "n_samples", "positive int")),
    ("surrogate-one-sample", lambda: _surrogate("kernel_shap", n_samples=1),
     ValueError, ("kernel_shap", "at least 2 interpretable samples", "got 1")),
    ("surrogate-weights-underflow", lambda: _surrogate("lime", distance_mode="euclidean", kernel_width=1e-30),
     ValueError, ("lime", "similarity weight", "kernel_width")),
    ("surrogate-chunk-size", lambda: _surrogate("lime", chunk_size=0), ValueError, ("lime", "chunk_size")),
    ("surrogate-interpretable-model", lambda: _surrogate("lime", interpretable_model="svm"),
     ValueError, ("lime", "interpretable_model", "'svm'", "lasso")),
    ("surrogate-model-shape", lambda: _surrogate("lime", interpretable_model=lambda x, y, w: x),
     ValueError, ("lime", "interpretable_model", "[5, 1, 3]", "[5, 6, 3]")),
    ("surrogate-alpha-linear", lambda: _surrogate("lime", interpretable_model="linear", alpha=1.0),
     ValueError, ("lime", "alpha", "'linear'")),
    ("surrogate-alpha-negative", lambda: _surrogate("lime", alpha=-1.0), ValueError, ("lime", "alpha", ">= 0")),
    ("surrogate-distance-mode", lambda: _surrogate("lime", distance_mode="manhattan"),
     ValueError, ("lime", "distance_mode", "'manhattan'")),
    ("surrogate-kernel-width", lambda: _surrogate("lime", kernel_width=0.0),
     ValueError, ("lime", "kernel_width", "> 0")),
    ("surrogate-one-feature", lambda: _surrogate("kernel_shap", feature_mask=torch.zeros(3, dtype=torch.long)),
     ValueError, ("kernel_shap", "at least 2 features", "F(x) - F(baseline)")),
    ("surrogate-shapley-samples-features", lambda: _shapley_samples(1),
     ValueError, ("kernel_shap", "at least 2 features")),
    ("surrogate-module-as-f", lambda: __import__("tdhook_fn.attribution._lime", fromlist=["lime"]).lime(
        tiny_model(), tiny_params(), tiny_inputs(), target=1),
     TypeError, ("lime", "pure", "tdhook_fn.pure(model)")),
    ("surrogate-baseline-shape", lambda: _surrogate("kernel_shap", baselines=torch.zeros(2)),
     ValueError, ("kernel_shap", "baselines", "broadcast")),
]


ROWS: list[Row] = [*WEIGHTS_ROWS, *CORE_ROWS, *DATA_ROWS, *PATHS_ROWS, *ERRORS_ROUND3_ROWS, *LATENT_ROWS,
                   *CORE_SHADOW_ROWS, *METRICS_ROWS, *DIMENSION_ROWS, *SIMILARITY_ROWS, *PROBING_ROWS,
                   *COMPAT_PROBING_ROWS, *LRP_RULES_ROWS, *CONDUCTANCE_ROWS, *NOISE_ROWS, *SURROGATE_ROWS,
                   *PERTURBATION_ROWS, *DEEPLIFT_ROWS]


@pytest.mark.parametrize(("call", "exc", "words"), [pytest.param(c, e, w, id=i) for i, c, e, w in ROWS])
def test_bad_input_gets_a_clear_error(call: Callable[[], Any], exc: type[BaseException],
                                      words: tuple[str, ...]) -> None:
    with pytest.raises(exc) as info:
        call()
    message = str(info.value).lower()
    missing = [w for w in words if w.lower() not in message]
    assert not missing, f"{missing} missing from {type(info.value).__name__}: {info.value}"


def test_row_ids_are_unique() -> None:
    ids = [row[0] for row in ROWS]
    assert len(ids) == len(set(ids))
