"""Probes for every layer of a random-init GPT-2 (6 layers x 256 hidden, no download), from one forward.

The probe data: ``N`` sequences of ``TOKENS`` tokens, the residual stream after each block
at the last position (the last through ``ln_f``, as ``output_hidden_states`` gives it), ten
classes. Three comparisons, medians of interleaved rounds in one process
(one intra-op thread; OpenBLAS likewise, ``OPENBLAS_THREAD_TIMEOUT`` set before numpy loads):

- fitting alone: ``fit_probes`` on the six cached layers against the floor, one batched
  Cholesky solve of all layers written by hand (stack, centre, Gram matrices, one
  ``cholesky`` and ``cholesky_solve``, intercepts), and against scikit-learn's
  ``RidgeClassifier`` fitted layer by layer (the incumbent);
- end to end: ``cache`` of the six blocks plus ``fit_probes`` against the floor of one plain
  forward plus the hand-written solve, and against tdhook 0.1.3's ``Probing`` context with a
  ``ProbeManager`` of ``RidgeClassifier`` probes (tdhook's way: hooks fit a scikit-learn
  estimator per layer, then score it);
- logistic probes (``kind="logistic"``, batched Newton) against ``LogisticRegression`` per layer.

Every variant is first checked to give the same probes.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import warnings

import numpy as np
import torch
import transformers
from _timing import interleaved_medians, print_table
from tensordict import TensorDict

import tdhook_fn
from tdhook_fn.latent import Site, cache
from tdhook_fn.latent.probing import fit_probes

warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()
torch.set_num_threads(1)
LAYERS, HIDDEN, TOKENS, N, CLASSES, ALPHA = 6, 256, 16, int(os.environ.get("PROBING_N", "512")), 10, 1.0


def gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=LAYERS, n_embd=HIDDEN, n_head=8, vocab_size=1000, n_positions=TOKENS,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).eval()


def floor_solve(stacked: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fastest plain torch: all layers' ridge classifiers in one batched Cholesky solve."""
    targets = 2 * torch.nn.functional.one_hot(labels, CLASSES).to(stacked.dtype) - 1
    mean_x, mean_y = stacked.mean(-2, keepdim=True), targets.mean(0)
    xc = stacked - mean_x
    gram = xc.mT @ xc + ALPHA * torch.eye(stacked.shape[-1], dtype=stacked.dtype)
    weight_t = torch.cholesky_solve(xc.mT @ (targets - mean_y), torch.linalg.cholesky(gram))
    return weight_t.mT, mean_y - (mean_x @ weight_t)[..., 0, :]


def main() -> None:
    model = gpt2()
    f = tdhook_fn.functional(model, in_keys={"input_ids": "input_ids"}, out_keys=["logits"])
    p = tdhook_fn.params(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (N, TOKENS), generator=g)
    labels = ids[:, -1] % CLASSES  # the last token's class: readable from every layer
    inputs = TensorDict(input_ids=ids, batch_size=[N])
    # what output_hidden_states gives after the embeddings: blocks 0-4, then the last block through ln_f
    blocks = [*(Site(f"transformer.h[{i}]", index=(-1,)) for i in range(LAYERS - 1)),
              Site("transformer.ln_f", index=(-1,))]

    def ours_end_to_end() -> TensorDict:
        with torch.no_grad():
            return fit_probes(cache(f, p, inputs, blocks, detach=True), labels, alpha=ALPHA)

    def floor_end_to_end() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            hidden = model.transformer(ids, output_hidden_states=True).hidden_states[1:]  # no LM head: not needed
        return floor_solve(torch.stack([h[:, -1] for h in hidden]), labels)

    with torch.no_grad():
        acts = cache(f, p, inputs, blocks, detach=True)
    stacked = torch.stack([acts[s.key] for s in blocks])
    probes = ours_end_to_end()
    weight, bias = floor_end_to_end()
    keys = [s.key for s in blocks]
    torch.testing.assert_close(torch.stack([probes[k, "weight"] for k in keys]), weight, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(torch.stack([probes[k, "bias"] for k in keys]), bias, rtol=1e-3, atol=1e-4)

    from sklearn.linear_model import LogisticRegression, RidgeClassifier
    layers_np = [a.double().numpy() for a in stacked]
    labels_np = labels.numpy()

    def sklearn_fit() -> list[RidgeClassifier]:
        return [RidgeClassifier(alpha=ALPHA).fit(x, labels_np) for x in layers_np]

    fitted = sklearn_fit()
    probes64 = fit_probes(acts.apply(lambda t: t.double()), labels, alpha=ALPHA)
    for k, est in zip(keys, fitted, strict=True):
        np.testing.assert_allclose(probes64[k, "weight"].numpy(), est.coef_, rtol=1e-6, atol=1e-8)

    tdhook_run = _tdhook_runner(model, ids, labels)
    tdhook_run()

    fit_times = interleaved_medians({
        "fit_probes (float32)": lambda: fit_probes(acts, labels, alpha=ALPHA),
        "floor: one batched Cholesky": lambda: floor_solve(stacked, labels),
        "sklearn RidgeClassifier x6": sklearn_fit,
    }, rounds=9)
    print_table(f"ridge probes, {LAYERS} layers x {HIDDEN}, N={N}, {CLASSES} classes: fitting alone",
                list(fit_times.items()), {"floor": fit_times["floor: one batched Cholesky"],
                                          "sklearn": fit_times["sklearn RidgeClassifier x6"]})
    e2e = interleaved_medians({
        "cache + fit_probes": ours_end_to_end,
        "floor: forward + batched solve": floor_end_to_end,
        "tdhook Probing + RidgeClassifier": tdhook_run,
    }, rounds=7)
    print_table("end to end: one forward, probes at every block", list(e2e.items()),
                {"floor": e2e["floor: forward + batched solve"], "tdhook": e2e["tdhook Probing + RidgeClassifier"]})

    def sklearn_logistic() -> list[LogisticRegression]:
        return [LogisticRegression(max_iter=1000).fit(x, labels_np) for x in layers_np]

    logistic = interleaved_medians({
        "fit_probes logistic (Newton)": lambda: fit_probes(acts, labels, kind="logistic"),
        "sklearn LogisticRegression x6": sklearn_logistic,
    }, rounds=3)
    print_table("logistic probes", list(logistic.items()), {"sklearn": logistic["sklearn LogisticRegression x6"]})


def _tdhook_runner(model, ids, labels):  # type: ignore[no-untyped-def]
    """tdhook 0.1.3: a Probing context whose hooks fit a RidgeClassifier per block, on a TensorDictModule."""
    from sklearn.linear_model import RidgeClassifier
    from tdhook.latent.probing import ProbeManager, Probing
    from tensordict.nn import TensorDictModule

    module = TensorDictModule(model, in_keys=["input_ids"], out_keys=["logits"])

    def last_position(data):  # type: ignore[no-untyped-def]
        data = data[0] if isinstance(data, tuple) else data
        return data[:, -1].detach().double().numpy()

    def accuracy(predicted, y):  # type: ignore[no-untyped-def]
        return {"accuracy": float((np.asarray(predicted) == np.asarray(y)).mean())}

    def run():  # type: ignore[no-untyped-def]
        manager = ProbeManager(RidgeClassifier, {"alpha": ALPHA}, accuracy, allow_overwrite=True,
                               data_preprocess_callback=last_position)
        context = Probing(r".*transformer\.h\.[0-4]$|.*transformer\.ln_f$", manager.probe_factory,
                          additional_keys=["labels", "step_type"])
        batch = TensorDict(input_ids=ids, labels=labels.numpy(), step_type="fit", batch_size=[len(ids)])
        with context.prepare(module) as hooked, torch.no_grad():
            hooked(batch)
        assert len(manager.estimators) == LAYERS, sorted(manager.estimators)
        return manager

    return run


if __name__ == "__main__":
    main()
