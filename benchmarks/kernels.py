"""Time and peak memory of the Triton kernels against their torch twins.

Ops measured (each kernel vs its twin, same inputs):

- ``linear_cross_entropy``: the fused linear + cross-entropy of all depths that share the output head. Target shape:
  16k tokens, hidden 4096, vocab 128k (128256, Llama-3), D=3 MTP depths. Interpretation: the main next-token head and
  the D MTP depths all score the same 16k positions through one call, so the call sees ``16384 × (D + 1) = 65536``
  rows (N, H) against one (V, H) weight. Two passes: ``forward`` (no gradients wanted, e.g. validation) and
  ``forward+backward`` (training step; gradients are computed in the forward of both backends).
- ``verify_drafts``: speculative verification at batch 64, k=4, vocab 128256, ``greedy`` (bf16 logits) and
  ``sampling`` (fp32 probabilities p and q, random numbers drawn inside the call by both backends).

On a GPU, time is ``triton.testing.do_bench`` (median ms) and memory is the peak of ``torch.cuda.max_memory_allocated``
above what was allocated before the call. Without a GPU the script is a smoke test: small shapes, kernels run in
Triton's interpreter (it sets ``TRITON_INTERPRET=1`` itself before triton is imported), time with
``time.perf_counter`` (median of ``--reps``), no memory figure; interpreter times say nothing about GPU speed.

Usage::

    python benchmarks/kernels.py                      # GPU if present, else the CPU smoke test (< 2 min)
    python benchmarks/kernels.py --out benchmarks/results/kernels.json --tokens 16384 --depths 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not ON_GPU:  # must happen before anything imports triton (lightning_mtp.kernels does)
    os.environ["TRITON_INTERPRET"] = "1"

from lightning_mtp.kernels import (  # noqa: E402
    linear_cross_entropy_torch,
    linear_cross_entropy_triton,
    verify_drafts_torch,
    verify_drafts_triton,
)
from lightning_mtp.kernels.dispatch import interpreter_ready  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args() -> argparse.Namespace:
    gpu_default = ON_GPU
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kernels.json"))
    parser.add_argument("--tokens", type=int, default=16384 if gpu_default else 16, help="positions per call")
    parser.add_argument("--depths", type=int, default=3, help="MTP depths D; rows = tokens × (D + 1)")
    parser.add_argument("--hidden", type=int, default=4096 if gpu_default else 64)
    parser.add_argument("--vocab", type=int, default=128256 if gpu_default else 1000)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16" if gpu_default else "fp32")
    parser.add_argument("--chunk-size", type=int, default=None, help="rows per logits chunk (default: Liger's rule)")
    parser.add_argument("--verify-batch", type=int, default=64 if gpu_default else 8)
    parser.add_argument("--verify-k", type=int, default=4)
    parser.add_argument("--verify-vocab", type=int, default=128256 if gpu_default else 1000)
    parser.add_argument("--reps", type=int, default=2, help="CPU only: timed repetitions (median)")
    parser.add_argument("--skip-ce", action="store_true")
    parser.add_argument("--skip-verify", action="store_true")
    return parser.parse_args()


# ---- measurement ----


def measure(fn, reset=None) -> tuple[float, float | None]:
    """(median ms, peak MiB above the starting allocation or None on CPU) of ``fn()``."""
    if ON_GPU:
        import triton.testing

        fn()  # autotuning, compilation, allocator warm-up
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(lambda: (reset and reset(), fn()), warmup=5, rep=200, return_mode="median")
        if reset:
            reset()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        if reset:
            reset()
        return float(ms), float(peak)
    fn()  # warm-up (the interpreter rewrites the kernel once)
    times = []
    for _ in range(max(1, ARGS.reps)):
        if reset:
            reset()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    if reset:
        reset()
    return statistics.median(times), None


def bench_linear_cross_entropy(rows_out: list[dict]) -> None:
    device = "cuda" if ON_GPU else "cpu"
    dtype = DTYPES[ARGS.dtype]
    rows = ARGS.tokens * (ARGS.depths + 1)
    gen = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(rows, ARGS.hidden, device=device, generator=gen).to(dtype)
    weight = (torch.randn(ARGS.vocab, ARGS.hidden, device=device, generator=gen) * ARGS.hidden**-0.5).to(dtype)
    targets = torch.randint(0, ARGS.vocab, (rows,), device=device, generator=gen)
    targets[::17] = -100
    row_weights = torch.rand(rows, device=device, generator=gen) / rows
    shape = dict(
        rows=rows, tokens=ARGS.tokens, depths=ARGS.depths, hidden=ARGS.hidden, vocab=ARGS.vocab, dtype=ARGS.dtype
    )
    fns = {"triton": linear_cross_entropy_triton, "torch": linear_cross_entropy_torch}

    losses = {}
    for name, fn in fns.items():
        losses[name] = fn(hidden, weight, targets, row_weights, -100, ARGS.chunk_size).loss.float().item()
    print(f"linear_cross_entropy loss: triton {losses['triton']:.6f} torch {losses['torch']:.6f}")

    for pass_name in ("forward", "forward+backward"):
        results = {}
        for name, fn in fns.items():
            h = hidden.detach().requires_grad_(pass_name != "forward")
            w = weight.detach().requires_grad_(pass_name != "forward")

            def reset(h=h, w=w):
                h.grad = w.grad = None

            if pass_name == "forward":

                def work(fn=fn, h=h, w=w):
                    with torch.no_grad():
                        fn(h, w, targets, row_weights, -100, ARGS.chunk_size)

            else:

                def work(fn=fn, h=h, w=w):
                    fn(h, w, targets, row_weights, -100, ARGS.chunk_size).loss.backward()

            results[name] = measure(work, reset)
            reset()
        add_rows(rows_out, "linear_cross_entropy", pass_name, shape, results)


def bench_verify(rows_out: list[dict]) -> None:
    device = "cuda" if ON_GPU else "cpu"
    batch, k, vocab = ARGS.verify_batch, ARGS.verify_k, ARGS.verify_vocab
    gen = torch.Generator(device).manual_seed(0)
    p = torch.softmax(torch.randn(batch, k + 1, vocab, device=device, generator=gen) * 3, dim=-1)
    q = torch.softmax(torch.randn(batch, k, vocab, device=device, generator=gen) * 3, dim=-1)
    q = 0.5 * q + 0.5 * p[:, :k]
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
    logits = torch.log(p).to(torch.bfloat16)
    fns = {"triton": verify_drafts_triton, "torch": verify_drafts_torch}
    for mode in ("greedy", "sampling"):
        shape = dict(batch=batch, k=k, vocab=vocab, target_dtype="bf16" if mode == "greedy" else "fp32")
        target = logits if mode == "greedy" else p
        outs = {
            name: fn(drafts, target, q, mode=mode, generator=torch.Generator(device).manual_seed(1))
            for name, fn in fns.items()
        }
        same = torch.equal(outs["triton"].output_tokens, outs["torch"].output_tokens)
        print(f"verify_drafts[{mode}] triton == torch: {same}")
        results = {}
        for name, fn in fns.items():
            vgen = torch.Generator(device).manual_seed(1)
            results[name] = measure(
                lambda fn=fn, vgen=vgen, target=target, mode=mode: fn(drafts, target, q, mode=mode, generator=vgen)
            )
        add_rows(rows_out, "verify_drafts", mode, shape, results)


def add_rows(rows_out: list[dict], op: str, pass_name: str, shape: dict, results: dict) -> None:
    (t_ms, t_mem), (r_ms, r_mem) = results["triton"], results["torch"]
    speedup = r_ms / t_ms if t_ms > 0 else None
    mem_ratio = t_mem / r_mem if (t_mem is not None and r_mem) else None
    for backend, (ms, mem) in results.items():
        rows_out.append(
            {
                "op": op,
                "pass": pass_name,
                "backend": backend,
                "device": DEVICE_NAME,
                "interpreted": not ON_GPU,
                "shape": shape,
                "time_ms": round(ms, 4),
                "peak_mem_mib": None if mem is None else round(mem, 2),
                "torch_over_triton_time": None if speedup is None else round(speedup, 3),
                "triton_over_torch_mem": None if mem_ratio is None else round(mem_ratio, 3),
            }
        )
    mem_text = "n/a" if mem_ratio is None else f"{t_mem:.0f} / {r_mem:.0f} MiB (x{mem_ratio:.2f})"
    print(
        f"{op:22s} {pass_name:17s} triton {t_ms:10.3f} ms  torch {r_ms:10.3f} ms  "
        f"speedup x{speedup:.2f}  memory triton/torch {mem_text}"
    )


def main() -> None:
    if not ON_GPU and not interpreter_ready():
        raise SystemExit("no GPU and Triton's interpreter could not be enabled (was triton imported earlier?)")
    start = time.perf_counter()
    rows: list[dict] = []
    if not ARGS.skip_ce:
        bench_linear_cross_entropy(rows)
    if not ARGS.skip_verify:
        bench_verify(rows)
    out = Path(ARGS.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {len(rows)} rows to {out} in {time.perf_counter() - start:.1f} s")
    if not ON_GPU:
        print(
            "CPU smoke test only (Triton interpreter, small shapes): GPU time and memory figures are still to be "
            "measured (run this script on a CUDA machine)."
        )


if __name__ == "__main__":
    ARGS = parse_args()
    DEVICE_NAME = torch.cuda.get_device_name() if ON_GPU else "cpu (triton interpreter)"
    main()
