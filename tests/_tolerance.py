"""What "equal" means for two floating-point results computed along different kernels.

``torch.equal`` is right where both sides run the same ops on the same shapes (a value
restored from a saved copy, a second identical call, compat calling the pure function).
Where the same maths runs with another batch size (a ``chunk_size``, ``vmap`` against one
batched call, a stacked ensemble against a loop), CPU kernels may block and reduce in
another order: MKL and oneDNN pick their gemm blocking by shape and by instruction set
(an AMD EPYC with AVX2 rounds differently from an Intel Xeon with AVX-512). Such a
reordering moves a result by a few ulps; :func:`assert_close_ulps` allows that much.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase


def assert_close_ulps(
    actual: torch.Tensor | TensorDictBase,
    expected: torch.Tensor | TensorDictBase,
    *,
    ulps: float = 4,
    scale: float | None = None,
    msg: str | None = None,
) -> None:
    """``actual == expected`` up to ``ulps`` units of rounding of their dtype.

    Relative tolerance ``ulps * eps``; absolute ``ulps * eps * max(1, scale)``, ``scale``
    being ``max |expected|`` unless given: an element that is a cancellation of larger
    terms (a gradient summed over paths and layers) carries the rounding of those terms,
    not its own. Pass ``scale`` where the terms are larger than any element of the result
    (a convergence delta sums the attributions: pass their total). Shapes and dtypes must
    match. TensorDicts are compared key by key, with the same keys and batch size.

    Measured on the attribution zoo with MKL and ATen forced onto other code paths
    (``MKL_ENABLE_INSTRUCTIONS=AVX2``, or ``=SSE4_2`` with ``ATEN_CPU_CAPABILITY=default``,
    which reproduce the AMD failures on an Intel machine): chunked against unchunked
    integrated gradients differ by at most 1.25 such ulps, a stacked ensemble under
    ``vmap`` against a loop by 1.5, ``vmap`` per sample against the batched call by 2.5
    (the transformer).
    """
    if isinstance(expected, TensorDictBase) or isinstance(actual, TensorDictBase):
        assert isinstance(actual, TensorDictBase) and isinstance(expected, TensorDictBase), (type(actual), msg)
        assert set(actual.keys(True, True)) == set(expected.keys(True, True)), msg
        assert actual.batch_size == expected.batch_size, (actual.batch_size, expected.batch_size, msg)
        for key in expected.keys(True, True):
            key_msg = f"{msg or ''} {key!r}".strip()
            assert_close_ulps(actual.get(key), expected.get(key), ulps=ulps, scale=scale, msg=key_msg)
        return
    assert actual.shape == expected.shape, (actual.shape, expected.shape, msg)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype, msg)
    eps = torch.finfo(expected.dtype).eps
    if scale is None:
        scale = expected.abs().max().item() if expected.numel() else 0.0
    tol = ulps * eps
    report = None if msg is None else lambda m: f"{msg}: {m}"
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * max(1.0, scale), msg=report)
