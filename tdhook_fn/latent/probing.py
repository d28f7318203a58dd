"""Probes: linear (and bilinear) read-outs of activations, every site fitted at once.

Pure statistics on activations (a TensorDict by site, as `tdhook_fn.latent.cache`
returns, or a tensor ``(..., N, D)`` whose leading dims are batch dims):

- `fit_probes`: ridge (scikit-learn's ``Ridge`` / ``RidgeClassifier``), logistic
  (``LogisticRegression``) or mean-difference probes, sites of one width in one batched solve.
- `predict_probes`, `decision_function`, `score_probes`: apply them.
- `fit_bilinear_probes`, `predict_bilinear_probes`: full or low-rank bilinear probes on pairs
  of activations, trained by Adam on every pair at once.
- `ridge_statistics`, `merge_ridge_statistics`, `solve_ridge`: ridge probes over data seen a
  batch at a time (`tdhook_fn.data.fit_probes` streams a dataset through them).
"""

from ._probe_bilinear import fit_bilinear_probes, predict_bilinear_probes
from ._probe_fit import fit_probes
from ._probe_predict import decision_function, predict_probes, score_probes
from ._probe_statistics import merge_ridge_statistics, ridge_statistics, solve_ridge

__all__ = [
    "decision_function",
    "fit_bilinear_probes",
    "fit_probes",
    "merge_ridge_statistics",
    "predict_bilinear_probes",
    "predict_probes",
    "ridge_statistics",
    "score_probes",
    "solve_ridge",
]
