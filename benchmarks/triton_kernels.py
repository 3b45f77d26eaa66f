"""Time and peak memory of the Triton kernels against their torch twins.

Ops measured (each kernel vs its twin, same inputs):

- ``linear_cross_entropy``: the fused linear + cross-entropy of all depths that share the output head. Target shape:
  16k tokens, hidden 4096, vocab 128k (128256, Llama-3), D=3 MTP depths. Interpretation: the main next-token head and
  the D MTP depths all score the same 16k positions through one call, so the call sees ``16384 × (D + 1) = 65536``
  rows (N, H) against one (V, H) weight. Two passes: ``forward`` (no gradients wanted, e.g. validation) and
  ``forward+backward`` (training step; gradients are computed in the forward of both backends).
  On a GPU the same two passes also time Liger-Kernel's fused linear cross-entropy (``liger``) and Apple's Cut
  Cross-Entropy (``cce``) when they are installed (mean CE over valid rows: neither takes per-row weights, which cost
  nothing extra in ours). Each row has ``time_vs_torch_twin`` and ``mem_vs_torch_twin``.
- ``linear_cross_entropy`` gradient gate (passes ``forward-only reference``, ``no_grad``, ``inference_mode``, ``grad
  enabled (forward)``): validation calls the fused CE with the head's weight a Parameter (``requires_grad=True``)
  under ``torch.no_grad()``/``inference_mode``; that must cost what the forward alone costs. The reference calls the
  chunked pass directly with no gradient wanted (no logits materialised beyond one chunk, no gradient buffers);
  ``grad enabled (forward)`` is the same call with autograd on, which computes both gradients in its forward. Rows
  carry ``over_forward_only_time`` (≈ 1 for the two no-grad rows) and ``over_forward_only_mem``.
- ``verify_drafts``: speculative verification at batch 64, k=4, vocab 128256, ``greedy`` (bf16 logits) and
  ``sampling`` (fp32 probabilities p and q, random numbers drawn inside the call by both backends).
- ``verify_tree``: draft-tree verification at the same batch and vocab, a static tree of branching ``4,2,2,1``
  (45 nodes with the root, depth 4), candidates drawn from q without replacement; ``greedy`` (bf16 logits),
  ``sampling`` (fp32 p and q) and ``sampling (deterministic)`` (no q: the candidates are point masses).

On a GPU, time is ``triton.testing.do_bench`` (median ms) and memory is the peak of ``torch.cuda.max_memory_allocated``
above what was allocated before the call. Without a GPU the script is a smoke test: small shapes, kernels run in
Triton's interpreter (it sets ``TRITON_INTERPRET=1`` itself before triton is imported), time with
``time.perf_counter`` (median of ``--reps``; the gate's variants interleaved round by round), memory from the C
allocator (``benchmarks/memory.py``, a separate run); interpreter times say nothing about GPU speed, the torch twin's
CPU times do.

Usage::

    python benchmarks/triton_kernels.py                      # GPU if present, else the CPU smoke test (< 2 min)
    python benchmarks/triton_kernels.py --out benchmarks/results/kernels.json --tokens 16384 --depths 3
    python benchmarks/triton_kernels.py --skip-ce --skip-gate --skip-chain   # the tree-verify rows alone
    python benchmarks/triton_kernels.py --backends torch --skip-ce --skip-verify --tokens 512 --hidden 256 \
        --vocab 8192 --reps 9 --threads 1 --append    # + the twin's no-grad gate on CPU at 2048 rows
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

from memory import PeakMemory  # noqa: E402
from report import provenance  # noqa: E402

from lightning_mtp.kernels import (  # noqa: E402
    linear_cross_entropy_torch,
    linear_cross_entropy_triton,
    verify_drafts_torch,
    verify_drafts_triton,
    verify_tree_torch,
    verify_tree_triton,
)
from lightning_mtp.kernels.dispatch import interpreter_ready  # noqa: E402
from lightning_mtp.kernels.linear_cross_entropy import fused_chunked_pass  # noqa: E402
from lightning_mtp.kernels.linear_cross_entropy_torch import (  # noqa: E402
    chunked_pass,
    default_chunk_size,
    resolve_row_weights,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OUR_FNS = {"triton": linear_cross_entropy_triton, "torch": linear_cross_entropy_torch}
OURS = tuple(OUR_FNS)
EXTERNAL = ("liger", "cce")


def parse_args() -> argparse.Namespace:
    gpu_default = ON_GPU
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kernels.json"))
    parser.add_argument("--append", action="store_true", help="add this run's rows to those already in --out")
    parser.add_argument("--tokens", type=int, default=16384 if gpu_default else 16, help="positions per call")
    parser.add_argument("--depths", type=int, default=3, help="MTP depths D; rows = tokens × (D + 1)")
    parser.add_argument("--hidden", type=int, default=4096 if gpu_default else 64)
    parser.add_argument("--vocab", type=int, default=128256 if gpu_default else 1000)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16" if gpu_default else "fp32")
    parser.add_argument("--chunk-size", type=int, default=None, help="rows per logits chunk (default: Liger's rule)")
    parser.add_argument("--verify-batch", type=int, default=64 if gpu_default else 8)
    parser.add_argument("--verify-k", type=int, default=4)
    parser.add_argument("--verify-vocab", type=int, default=128256 if gpu_default else 1000)
    parser.add_argument("--tree-batch", type=int, default=64 if gpu_default else 2, help="rows of the tree verify")
    parser.add_argument("--tree-branching", default="4,2,2,1" if gpu_default else "2,1",
                        help="static draft tree of the tree verify: children per node at each depth")
    parser.add_argument("--reps", type=int, default=2, help="CPU only: timed repetitions (median)")
    parser.add_argument("--threads", type=int, default=None, help="CPU only: torch threads (default: torch's)")
    parser.add_argument("--backends", default=",".join(OURS + EXTERNAL),
                        help="comma-separated: triton, torch (the twin), liger, cce (GPU only, when installed)")
    parser.add_argument("--skip-ce", action="store_true")
    parser.add_argument("--skip-gate", action="store_true", help="skip the no-grad gradient-gate rows")
    parser.add_argument("--skip-verify", action="store_true", help="skip both verification ops (chain and tree)")
    parser.add_argument("--skip-chain", action="store_true", help="skip verify_drafts (chain verification)")
    parser.add_argument("--skip-tree", action="store_true", help="skip verify_tree (draft-tree verification)")
    args = parser.parse_args()
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    args.tree_branching = tuple(int(b) for b in args.tree_branching.split(",") if b.strip())
    unknown = sorted(set(args.backends) - set(OURS + EXTERNAL))
    if unknown:
        parser.error(f"--backends: unknown {unknown}; choose from {list(OURS + EXTERNAL)}")
    return args


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
    with PeakMemory() as peak:  # its own run: sampling after every op slows the work down
        fn()
    if reset:
        reset()
    return statistics.median(times), peak.peak_bytes / 2**20


def measure_interleaved(works: dict) -> dict:
    """``measure`` of several variants of one piece of work. On CPU the timed repetitions are interleaved (one of each
    variant per round), so that a shared machine's load falls on all variants alike; medians of ``--reps`` rounds."""
    if ON_GPU:
        return {name: measure(work) for name, work in works.items()}
    for work in works.values():
        work()  # warm-up
    times = {name: [] for name in works}
    for _ in range(max(1, ARGS.reps)):
        for name, work in works.items():
            start = time.perf_counter()
            work()
            times[name].append((time.perf_counter() - start) * 1e3)
    results = {}
    for name, work in works.items():
        with PeakMemory() as peak:
            work()
        results[name] = (statistics.median(times[name]), peak.peak_bytes / 2**20)
    return results


def external_providers() -> dict:
    """Liger-Kernel's and Cut Cross-Entropy's fused linear cross-entropy (mean over valid rows), where installed and
    asked for; GPU only. Each takes our providers' arguments and ignores row weights and chunk size."""
    providers = {}
    wanted = [name for name in EXTERNAL if name in ARGS.backends]
    if not ON_GPU:
        if wanted:
            print(f"skipping {wanted}: GPU only")
        return providers
    if "liger" in wanted:
        try:
            from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

            liger_loss = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
            providers["liger"] = lambda h, w, t, *_: liger_loss(w, h, t)  # Liger takes (weight, input, target)
        except Exception as error:  # not installed, or an API we do not know
            print(f"skipping liger: {type(error).__name__}: {error}")
    if "cce" in wanted:
        try:
            from cut_cross_entropy import linear_cross_entropy as cce_loss

            providers["cce"] = lambda h, w, t, *_: cce_loss(h, w, t, ignore_index=-100, reduction="mean")
        except Exception as error:
            print(f"skipping cce: {type(error).__name__}: {error}")
    return providers


def loss_of(out) -> torch.Tensor:
    """The scalar loss of any provider's output (ours: a NamedTuple with ``loss``; Liger: a tensor, a tuple or an
    output object depending on its version; CCE: a tensor)."""
    if hasattr(out, "loss"):
        return out.loss
    return out[0] if isinstance(out, tuple) else out


def ce_inputs():
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
    return hidden, weight, targets, row_weights, shape


def bench_linear_cross_entropy(rows_out: list[dict]) -> None:
    hidden, weight, targets, row_weights, shape = ce_inputs()
    fns = {name: fn for name, fn in OUR_FNS.items() if name in ARGS.backends}
    fns.update(external_providers())

    losses = {}
    for name, fn in fns.items():
        weights = row_weights if name in OURS else None  # external providers: mean over valid rows
        try:
            losses[name] = loss_of(fn(hidden, weight, targets, weights, -100, ARGS.chunk_size)).float().item()
        except Exception as error:  # an external provider that does not take these inputs
            print(f"skipping {name}: {type(error).__name__}: {error}")
    fns = {name: fn for name, fn in fns.items() if name in losses}
    print("linear_cross_entropy loss:", "  ".join(f"{name} {loss:.6f}" for name, loss in losses.items()))

    for pass_name in ("forward", "forward+backward"):
        results = {}
        for name, fn in fns.items():
            h = hidden.detach().requires_grad_(pass_name != "forward")
            w = weight.detach().requires_grad_(pass_name != "forward")
            weights = row_weights if name in OURS else None

            def reset(h=h, w=w):
                h.grad = w.grad = None

            if pass_name == "forward":

                def work(fn=fn, h=h, w=w, weights=weights):
                    with torch.no_grad():
                        fn(h, w, targets, weights, -100, ARGS.chunk_size)

            else:

                def work(fn=fn, h=h, w=w, weights=weights):
                    loss_of(fn(h, w, targets, weights, -100, ARGS.chunk_size)).backward()

            try:
                results[name] = measure(work, reset)
            except Exception as error:  # an external provider's failure must not lose our rows
                if name in OURS:
                    raise
                print(f"skipping {name} ({pass_name}): {type(error).__name__}: {error}")
            reset()
        add_rows(rows_out, "linear_cross_entropy", pass_name, shape, results)


GATE_PASSES = ("forward-only reference", "no_grad", "inference_mode", "grad enabled (forward)")


def bench_grad_gate(rows_out: list[dict]) -> None:
    """The fused CE on a Parameter weight and a requires-grad hidden, with autograd off and on, against the forward
    alone (the chunked pass asked for no gradient, on detached inputs)."""
    hidden, weight, targets, row_weights, shape = ce_inputs()
    chunk = ARGS.chunk_size or default_chunk_size(*hidden.shape, weight.shape[0])
    passes = {"triton": fused_chunked_pass, "torch": chunked_pass}
    h, w = hidden.detach().requires_grad_(), torch.nn.Parameter(weight.detach())
    for name in [b for b in OURS if b in ARGS.backends]:
        fn = OUR_FNS[name]

        def reference(name=name):
            weights = resolve_row_weights(targets, row_weights, -100)
            row_loss, _, _, _ = passes[name](hidden, weight, targets, weights, -100, chunk, False, False)
            (row_loss * weights).sum()

        def call(context, fn=fn):
            with context():
                fn(h, w, targets, row_weights, -100, ARGS.chunk_size)

        works = {
            "forward-only reference": reference,
            "no_grad": lambda call=call: call(torch.no_grad),
            "inference_mode": lambda call=call: call(torch.inference_mode),
            "grad enabled (forward)": lambda call=call: call(torch.enable_grad),
        }
        results = measure_interleaved(works)
        ref_ms, ref_mem = results["forward-only reference"]
        for pass_name, (ms, mem) in results.items():
            rows_out.append(
                {
                    "op": "linear_cross_entropy",
                    "pass": pass_name,
                    "backend": name,
                    "device": DEVICE_NAME,
                    "interpreted": not ON_GPU and name == "triton",
                    "shape": dict(shape, weight="Parameter", hidden_requires_grad=True),
                    "time_ms": round(ms, 4),
                    "peak_mem_mib": round(mem, 2),
                    "over_forward_only_time": round(ms / ref_ms, 3) if ref_ms > 0 else None,
                    "over_forward_only_mem": round(mem / ref_mem, 3) if ref_mem else None,
                }
            )
        print(
            f"{'linear_cross_entropy':22s} grad gate {name:6s} "
            + "  ".join(f"{p} {results[p][0]:.3f} ms / {results[p][1]:.1f} MiB" for p in GATE_PASSES)
            + f"  no_grad / forward-only x{results['no_grad'][0] / ref_ms:.2f}"
        )


def bench_verify(rows_out: list[dict]) -> None:
    device = "cuda" if ON_GPU else "cpu"
    batch, k, vocab = ARGS.verify_batch, ARGS.verify_k, ARGS.verify_vocab
    gen = torch.Generator(device).manual_seed(0)
    p = torch.softmax(torch.randn(batch, k + 1, vocab, device=device, generator=gen) * 3, dim=-1)
    q = torch.softmax(torch.randn(batch, k, vocab, device=device, generator=gen) * 3, dim=-1)
    q = 0.5 * q + 0.5 * p[:, :k]
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
    logits = torch.log(p).to(torch.bfloat16)
    fns = {name: fn for name, fn in {"triton": verify_drafts_triton, "torch": verify_drafts_torch}.items()
           if name in ARGS.backends}
    for mode in ("greedy", "sampling"):
        shape = dict(batch=batch, k=k, vocab=vocab, target_dtype="bf16" if mode == "greedy" else "fp32")
        target = logits if mode == "greedy" else p
        outs = {
            name: fn(drafts, target, q, mode=mode, generator=torch.Generator(device).manual_seed(1))
            for name, fn in fns.items()
        }
        if len(outs) == 2:
            same = torch.equal(outs["triton"].output_tokens, outs["torch"].output_tokens)
            print(f"verify_drafts[{mode}] triton == torch: {same}")
        results = {}
        for name, fn in fns.items():
            vgen = torch.Generator(device).manual_seed(1)
            results[name] = measure(
                lambda fn=fn, vgen=vgen, target=target, mode=mode: fn(drafts, target, q, mode=mode, generator=vgen)
            )
        add_rows(rows_out, "verify_drafts", mode, shape, results)


def static_tree(branching: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """Parents and depths of a static tree in breadth-first order (root first)."""
    parents, depths, frontier = [0], [0], [0]
    for level, width in enumerate(branching, start=1):
        children = [node for node in frontier for _ in range(width)]
        frontier = list(range(len(parents), len(parents) + len(children)))
        parents += children
        depths += [level] * len(children)
    return parents, depths


def bench_verify_tree(rows_out: list[dict]) -> None:
    device = "cuda" if ON_GPU else "cpu"
    batch, vocab, branching = ARGS.tree_batch, ARGS.verify_vocab, ARGS.tree_branching
    parents, depths = static_tree(branching)
    size = len(parents)
    gen = torch.Generator(device).manual_seed(0)
    p = torch.softmax(torch.randn(batch, size, vocab, device=device, generator=gen) * 3, dim=-1)
    q = torch.softmax(torch.randn(batch, size, vocab, device=device, generator=gen) * 3, dim=-1)
    q = 0.5 * q + 0.5 * p
    tokens = torch.zeros(batch, size, dtype=torch.long, device=device)
    for node in range(size):  # each node's candidates: drawn from its q without replacement
        kids = [i for i in range(1, size) if parents[i] == node]
        if kids:
            tokens[:, kids] = torch.multinomial(q[:, node], len(kids), replacement=False, generator=gen)
    parents_t = torch.tensor(parents, device=device).expand(batch, -1)
    depths_t = torch.tensor(depths, device=device).expand(batch, -1)
    logits = torch.log(p).to(torch.bfloat16)
    fns = {name: fn for name, fn in {"triton": verify_tree_triton, "torch": verify_tree_torch}.items()
           if name in ARGS.backends}
    passes = {"greedy": (logits, None, "greedy"), "sampling": (p, q, "sampling"),
              "sampling (deterministic)": (p, None, "sampling")}
    for pass_name, (target, draft_probs, mode) in passes.items():
        shape = dict(batch=batch, nodes=size, branching=list(branching), depth=len(branching), vocab=vocab,
                     target_dtype="bf16" if mode == "greedy" else "fp32")

        def call(fn, seed=1, target=target, draft_probs=draft_probs, mode=mode, gen=None):
            return fn(tokens, parents_t, depths_t, target, draft_probs, mode=mode, max_depth=len(branching),
                      generator=gen or torch.Generator(device).manual_seed(seed))

        outs = {name: call(fn) for name, fn in fns.items()}
        if len(outs) == 2:
            same = all(torch.equal(a, b) for a, b in zip(outs["triton"], outs["torch"]))
            accepted = outs["torch"].num_accepted.float().mean().item()
            print(f"verify_tree[{pass_name}] triton == torch: {same}  (mean accepted {accepted:.2f})")
            shape["triton_equals_torch"] = same
        results = {}
        for name, fn in fns.items():
            vgen = torch.Generator(device).manual_seed(1)
            results[name] = measure(lambda fn=fn, vgen=vgen, call=call: call(fn, gen=vgen))
        add_rows(rows_out, "verify_tree", pass_name, shape, results)


def add_rows(rows_out: list[dict], op: str, pass_name: str, shape: dict, results: dict) -> None:
    """One row per backend. ``torch_over_triton_time`` and ``triton_over_torch_mem`` compare the kernel with its twin
    (same value on both rows of a pass); ``time_vs_torch_twin`` and ``mem_vs_torch_twin`` put each backend, Liger
    and CCE included, against the twin."""
    twin_ms, twin_mem = results.get("torch", (None, None))
    kernel_ms, kernel_mem = results.get("triton", (None, None))
    speedup = twin_ms / kernel_ms if (kernel_ms and twin_ms is not None) else None
    mem_ratio = kernel_mem / twin_mem if (kernel_mem is not None and twin_mem) else None
    for backend, (ms, mem) in results.items():
        rows_out.append(
            {
                "op": op,
                "pass": pass_name,
                "backend": backend,
                "device": DEVICE_NAME,
                "interpreted": not ON_GPU and backend == "triton",
                "shape": shape,
                "time_ms": round(ms, 4),
                "peak_mem_mib": None if mem is None else round(mem, 2),
                "torch_over_triton_time": None if speedup is None else round(speedup, 3),
                "triton_over_torch_mem": None if mem_ratio is None else round(mem_ratio, 3),
                "time_vs_torch_twin": round(ms / twin_ms, 3) if twin_ms else None,
                "mem_vs_torch_twin": round(mem / twin_mem, 3) if (mem is not None and twin_mem) else None,
            }
        )
    text = "  ".join(f"{name} {ms:10.3f} ms" + ("" if mem is None else f" {mem:8.1f} MiB")
                     for name, (ms, mem) in results.items())
    ratio = "" if speedup is None else f"  twin/kernel time x{speedup:.2f}"
    ratio += "" if mem_ratio is None else f"  kernel/twin memory x{mem_ratio:.2f}"
    print(f"{op:22s} {pass_name:17s} {text}{ratio}")


def main() -> None:
    if not ON_GPU and not interpreter_ready():
        raise SystemExit("no GPU and Triton's interpreter could not be enabled (was triton imported earlier?)")
    if ARGS.threads and not ON_GPU:
        torch.set_num_threads(ARGS.threads)
    start = time.perf_counter()
    rows: list[dict] = []
    if not ARGS.skip_ce:
        bench_linear_cross_entropy(rows)
    if not ARGS.skip_gate:
        bench_grad_gate(rows)
    if not ARGS.skip_verify and not ARGS.skip_chain:
        bench_verify(rows)
    if not ARGS.skip_verify and not ARGS.skip_tree:
        bench_verify_tree(rows)
    meta = provenance(__file__, device=DEVICE_NAME)  # this run's command line and machine, on each of its rows
    rows = [{**row, **meta} for row in rows]
    out = Path(ARGS.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if ARGS.append and out.exists():
        rows = json.loads(out.read_text()) + rows
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {len(rows)} rows to {out} in {time.perf_counter() - start:.1f} s")
    if not ON_GPU and "triton" in ARGS.backends:
        print(
            "CPU smoke test only (Triton interpreter, small shapes): GPU time and memory figures are still to be "
            "measured (run this script on a CUDA machine)."
        )


if __name__ == "__main__":
    ARGS = parse_args()
    DEVICE_NAME = torch.cuda.get_device_name() if ON_GPU else "cpu (triton interpreter)"
    main()
