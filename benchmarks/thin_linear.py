"""Matrix products of one decoding step: ``F.linear``, the thin path ``(W @ x.T).T`` and :class:`lightning_mtp.layers.
Linear`, which picks one of the two per shape and row count from a one-time measurement on this machine
(:mod:`lightning_mtp.small_matmul`).

A decoding step pushes M rows (batch × tokens per row) through every weight of the model. This times the three ways
of computing ``x @ W.T`` for the weights of the decode benchmark's model (``benchmarks/decode_model.yaml``: 12 layers
of width 256, SwiGLU 704, vocabulary 2048) at several M, side by side in one run, and writes JSON (``linear_ms``,
``auto_ms`` beside the fixed paths: ``auto`` should be the faster of the two everywhere).

Usage::

    python benchmarks/thin_linear.py --threads 2 --out benchmarks/results/thin_linear.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import provenance  # noqa: E402

from lightning_mtp.layers import Linear, mlp_hidden_size  # noqa: E402
from lightning_mtp.small_matmul import ENV, THIN_ROWS  # noqa: E402


def step_weights(dim: int, layers: int, vocab: int) -> list[Linear]:
    """The (out, in) projections of one trunk step: qkv, attention output, SwiGLU gate/up and down, then the head."""
    hidden = mlp_hidden_size(dim, 8 / 3)
    shapes = [(3 * dim, dim), (dim, dim), (2 * hidden, dim), (dim, hidden)] * layers + [(vocab, dim)]
    return [Linear(n_in, n_out, bias=False) for n_out, n_in in shapes]


def time_step(weights: list[Linear], rows: int, path: str, repeats: int) -> float:
    """Best of 3 means (ms) of one step's products at ``rows`` rows."""
    inputs = {w.in_features: torch.randn(rows, w.in_features) for w in weights}

    def once():
        for w in weights:
            x = inputs[w.in_features]
            w(x)

    os.environ[ENV] = {"linear": "off", "thin": "on", "auto": "auto"}[path]  # every path through the same module call
    with torch.inference_mode():
        for _ in range(5):
            once()
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(repeats):
                once()
            best = min(best, (time.perf_counter() - start) / repeats * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "thin_linear.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = step_weights(args.dim, args.layers, args.vocab)
    rows = []
    print(f"{'rows':>5} {'F.linear ms':>12} {'thin ms':>8} {'Linear (auto) ms':>17}")
    for m in args.rows:
        plain, thin = time_step(weights, m, "linear", args.repeats), time_step(weights, m, "thin", args.repeats)
        auto = time_step(weights, m, "auto", args.repeats) if m <= THIN_ROWS else plain
        rows.append({"rows": m, "f_linear_ms": plain, "thin_ms": thin, "auto_ms": auto, "thin_speedup": plain / thin,
                     "auto_vs_best": auto / min(plain, thin)})
        print(f"{m:>5} {plain:12.2f} {thin:8.2f} {auto:17.2f}", flush=True)
    os.environ.pop(ENV, None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**provenance(__file__), "threads": args.threads, "dim": args.dim,
                                    "layers": args.layers, "vocab": args.vocab, "repeats": args.repeats,
                                    "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
