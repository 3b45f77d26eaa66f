"""Decoding-sized matrix products on CPU: ``x @ W.T`` for a few rows, computed the way that is faster *on this machine*.

A decoding step multiplies a few rows M (one token per row, the k+1 tokens of a verify, a drafting window) by every
weight. MKL computes ``x @ W.T`` (``F.linear``) and the same product written as ``(W @ x.T).T`` (:func:`thin_linear`)
with different kernels, and which is faster depends on the CPU, M and the weight's shape. Two machines of this
project, the same torch 2.13.0 and MKL 2024.2, timing one step of the 12-layer, width-256 benchmark model's products
(``python benchmarks/thin_linear.py --threads 2``, ms):

=============================  =====  =====  =====  =====  =====  =====
rows M                         1      2      4      8      16     32
=============================  =====  =====  =====  =====  =====  =====
machine A: ``F.linear``        3.07   3.76   4.04   3.54   4.19   5.70
machine A: thin                1.51   1.46   1.49   2.46   4.07   5.66
machine B: ``F.linear``        1.16   1.20   1.39   1.71   2.86   3.71
machine B: thin                2.49   2.32   2.22   2.26   2.20   3.01
=============================  =====  =====  =====  =====  =====  =====

So nothing fixed is right everywhere: :func:`thin_path_pays` measures, once per process, weight shape, row bucket
(1, 2, 4, ..., ``THIN_ROWS``) and thread count, both ways on a few copies of a weight of that shape (more bytes than a
core's L2 cache, as a model's step streams its weights), and keeps the thin path only where it is at least
``THIN_MARGIN`` faster. About a millisecond per shape and bucket. Graphs traced by ``torch.compile`` keep ``F.linear``
(the decision is Python that a trace should not depend on). ``LIGHTNING_MTP_THIN_LINEAR=on`` / ``off`` forces a path
(``auto``: the default, measured) in eager code.

The two ways give the same products up to float summation order.

Example::

    >>> import torch
    >>> w, x = torch.randn(8, 4), torch.randn(3, 4)
    >>> torch.allclose(thin_linear(x, w), torch.nn.functional.linear(x, w), atol=1e-6)
    True
"""

from __future__ import annotations

import os
import time
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

THIN_ROWS = 64
"""Inputs of more rows always use ``F.linear`` (training-sized products are compute-bound either way)."""
THIN_MARGIN = 0.9
"""The thin path is taken where it measured at most this fraction of ``F.linear``'s time (noise is not a reason)."""
MEASURED_BYTES = 8 << 20
"""Weights measured per decision: copies of the shape up to this many bytes (beyond a core's L2 cache)."""
LARGEST_MEASURED = 16 << 20
"""Weights of more bytes than this are not measured and use ``F.linear``: streaming them dominates either way."""
ENV = "LIGHTNING_MTP_THIN_LINEAR"

_choices: dict[tuple[int, int, int, int], bool] = {}


def decisions() -> int:
    """How many shapes have been measured in this process: a timed step during which it grows measured its matrix
    products and says nothing about its own cost (``speculative="auto"`` does not learn from it)."""
    return len(_choices)


def thin_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear(x, weight, bias)`` computed as ``(weight @ x.T).T``: x (..., K), weight (N, K) -> (..., N).

    One row is padded to two (a single row falls back to GEMV otherwise). The result is a transposed view (the
    callers that need unit stride make it so, :func:`lightning_mtp.layers.unit_stride`)."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])  # (M, K)
    flat = flat.expand(2, -1).contiguous() if rows == 1 else flat.contiguous()
    out = torch.mm(weight, flat.t()).t()[:rows]  # (M, N), a transposed view
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def row_bucket(rows: int) -> int:
    """The power of two at or above ``rows`` (decisions are shared within a bucket)."""
    return 1 << max(0, rows - 1).bit_length()


def thin_path_pays(in_features: int, out_features: int, rows: int) -> bool:
    """Whether :func:`thin_linear` beats ``F.linear`` for ``rows`` rows through a float32 (out, in) weight on this CPU
    (measured once per shape, row bucket and thread count; see the module docstring)."""
    if torch.compiler.is_compiling():
        return False  # traced graphs keep F.linear: no timing (nor thread count, environment) inside a trace
    forced = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if forced != "auto":
        if forced not in ("on", "off"):
            raise ValueError(f"${ENV} must be one of ('auto', 'on', 'off'), got {os.environ[ENV]!r}")
        return forced == "on"
    key = (in_features, out_features, row_bucket(rows), torch.get_num_threads())
    choice = _choices.get(key)
    if choice is None:
        choice = _choices[key] = measure(in_features, out_features, key[2]) <= THIN_MARGIN
    return choice


def measure(in_features: int, out_features: int, rows: int, passes: int = 3) -> float:
    """Time of :func:`thin_linear` over ``F.linear`` for ``rows`` rows and (out, in) weights: the best of ``passes``
    passes over copies of the weight (``MEASURED_BYTES`` in all), after one warm-up pass. ``inf`` for weights larger
    than ``LARGEST_MEASURED`` (they keep ``F.linear``)."""
    size = in_features * out_features * 4
    if size > LARGEST_MEASURED:
        return float("inf")
    copies = max(2, min(32, MEASURED_BYTES // max(size, 1)))
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out_features, in_features, generator=generator) for _ in range(copies)]
    x = torch.randn(rows, in_features, generator=generator)
    best = {}
    with torch.inference_mode():
        for name, product in (("linear", F.linear), ("thin", thin_linear)):
            for w in weights:
                product(x, w)
            times = []
            for _ in range(passes):
                start = time.perf_counter()
                for w in weights:
                    product(x, w)
                times.append(time.perf_counter() - start)
            best[name] = min(times)
    return best["thin"] / max(best["linear"], 1e-12)


def clear() -> None:
    """Forget the measured decisions (tests; a changed thread count is measured anew without this)."""
    _choices.clear()
