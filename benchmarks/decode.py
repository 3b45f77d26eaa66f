"""Self-speculative decoding against plain decoding of the same model, in one run.

Rows (``benchmarks/results/decode.json``), all on the same model and prompts (held-out files of the corpus):

- greedy, batch 1 and batch 8: plain, then speculative with 1..D drafts, then the dynamic draft-length policies;
- sampling at T = 1, batch 1: plain against speculative with D drafts.

Each row has ``mode``, ``decoder``, ``policy``, ``batch_size``, ``draft_tokens``, ``tau`` (tokens per main-model
forward, bonus token counted), ``acceptance_per_depth``, ``tokens_per_s`` and ``speedup`` (over plain decoding of the
same mode and batch size). Greedy rows also say whether the output equals plain decoding token for token
(``lossless``). The timing is the median over ``--repeats`` interleaved repeats.

The summary (``decode_summary.json``) explains the speedup from measurement, in units of a plain decoding step
(``benchmarks/decode_costs.py``): inside real decoding at batch 1, a speculative step's main forward, drafting and
the rest (acceptance, bookkeeping, Python); in isolation at batch 1 and 8, a (k+1)-token verify forward and drafting
through k modules; and the weight bytes a step reads. The speedup is the forwards saved divided by the cost of a
step; the targets are checked and reported.

Usage::

    python benchmarks/decode.py --ckpt model.ckpt                  # a trained checkpoint
    python benchmarks/decode.py --train-seconds 3600               # train with benchmarks/decode_model.yaml first
    python benchmarks/decode.py --train-seconds 60 --max-new-tokens 32 --prompts 4   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from decode_costs import cost_breakdown, explain, in_situ_breakdown, weight_bytes  # noqa: E402

from lightning_mtp.decoding import GenerationConfig, generate  # noqa: E402
from lightning_mtp.decoding.stats import DecodeStats  # noqa: E402

TARGETS = {
    "batch 1 greedy speedup at D=3": 2.0,
    "batch 1 greedy tau at D=3": 2.5,
    "batch 8 greedy speedup (best k/policy)": 1.3,
    "batch 1 T=1 sampling speedup (best k)": 1.5,
}


# ----------------------------------------------------------------------------------------------- model and data
def train(config: Path, seconds: float, ckpt: Path, extra: list[str], resume: Optional[Path] = None):
    """Fit CausalLM on TextDataModule with the project's CLI config for ``seconds`` and save it to ``ckpt``.

    ``resume``: a checkpoint this script saved, to continue exactly where it stopped (optimizer, schedule, data
    order; ``seconds`` then counts the earlier sittings' time too, as Lightning's ``max_time`` does).
    Returns (model, datamodule, training info)."""
    import lightning as L

    from lightning_mtp.cli import MTPLightningCLI

    hours, rest = divmod(int(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    args = ["--config", str(config), "--trainer.max_time", f"00:{hours:02d}:{minutes:02d}:{secs:02d}",
            "--trainer.default_root_dir", str(ckpt.parent / "train"), *extra]
    cli = MTPLightningCLI(L.LightningModule, L.LightningDataModule, subclass_mode_model=True,
                          subclass_mode_data=True, run=False, args=args, auto_configure_optimizers=False,
                          save_config_kwargs={"overwrite": True})
    start = time.perf_counter()
    cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=None if resume is None else str(resume))
    info = {"train_seconds": time.perf_counter() - start, "train_steps": cli.trainer.global_step,
            "train_args": extra, "resumed_from": None if resume is None else str(resume)}
    print(f"trained for {info['train_seconds']:.0f}s, {info['train_steps']} steps", flush=True)
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    cli.trainer.save_checkpoint(ckpt)
    print(f"saved {ckpt}", flush=True)
    return cli.model, cli.datamodule, info


def load(ckpt: Path, config: Path):
    """The checkpoint's model, and a datamodule from its saved hyperparameters (else from the config)."""
    import yaml

    from lightning_mtp.data import TextDataModule
    from lightning_mtp.models import load_causal_lm

    model = load_causal_lm(str(ckpt))
    saved = torch.load(ckpt, map_location="cpu", weights_only=True).get("datamodule_hyper_parameters")
    if saved is None:
        saved = yaml.safe_load(config.read_text())["data"].get("init_args", {})
    return model, TextDataModule(**{k: v for k, v in saved.items() if not k.startswith("_")})


def held_out_prompts(datamodule, count: int, length: int) -> list[torch.Tensor]:
    """The first ``length`` tokens of ``count`` windows spread over the held-out files."""
    datamodule.setup("predict")
    windows = datamodule.val_dataset
    stride = max(1, len(windows) // count)
    return [windows[i * stride]["input_ids"][:length].clone() for i in range(min(count, len(windows)))]


# ----------------------------------------------------------------------------------------------- runs
def run_mode(model, prompts: list[torch.Tensor], batch_size: int, max_new_tokens: int, seed: int, **kwargs):
    """Decode every prompt (in batches); returns (new tokens per prompt, combined stats dict)."""
    outputs, stats = [], []
    generator = torch.Generator().manual_seed(seed)
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        width = max(len(p) for p in chunk)
        input_ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, prompt in enumerate(chunk):
            input_ids[row, : len(prompt)] = prompt
            mask[row, : len(prompt)] = 1
        out = generate(model, input_ids, max_new_tokens, attention_mask=mask, generator=generator, **kwargs)
        outputs += [out.new_tokens[b, : out.num_new_tokens[b]].tolist() for b in range(len(chunk))]
        stats.append(out.stats)
    return outputs, DecodeStats.combine(stats)


def modes(depth: int, batch_sizes: list[int], compiled: bool = True) -> list[dict]:
    rows = []
    for batch in batch_sizes:
        rows.append(dict(mode="greedy", decoder="plain", policy="-", batch_size=batch, draft_tokens=0,
                         kwargs=dict(speculative=False)))
        for k in range(1, depth + 1):
            rows.append(dict(mode="greedy", decoder="speculative", policy="fixed", batch_size=batch, draft_tokens=k,
                             kwargs=dict(draft_tokens=k)))
        for name, extra in (("confidence", dict(draft_confidence_threshold=0.3)),
                            ("adaptive", dict(adaptive_draft_tokens=True))):
            rows.append(dict(mode="greedy", decoder="speculative", policy=name, batch_size=batch, draft_tokens=depth,
                             kwargs=dict(draft_tokens=depth, **extra)))
    rows.append(dict(mode="sampling", decoder="plain", policy="-", batch_size=1, draft_tokens=0,
                     kwargs=dict(speculative=False, temperature=1.0)))
    for k in range(1, depth + 1):
        rows.append(dict(mode="sampling", decoder="speculative", policy="fixed", batch_size=1, draft_tokens=k,
                         kwargs=dict(draft_tokens=k, temperature=1.0)))
    if compiled:  # torch.compile'd step forwards (GenerationConfig.compile): plain and speculative, batch 1
        rows.append(dict(mode="greedy-compiled", decoder="plain", policy="-", batch_size=1, draft_tokens=0,
                         kwargs=dict(speculative=False, compile=True)))
        rows.append(dict(mode="greedy-compiled", decoder="speculative", policy="fixed", batch_size=1,
                         draft_tokens=depth, kwargs=dict(draft_tokens=depth, compile=True)))
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for batch, marker in ((1, "o"), (8, "s")):
        fixed = [r for r in rows if r["mode"] == "greedy" and r["batch_size"] == batch and r["policy"] == "fixed"]
        if not fixed:
            continue
        ks = [r["draft_tokens"] for r in fixed]
        axes[0].plot(ks, [r["speedup"] for r in fixed], marker=marker, label=f"greedy, batch {batch}")
        axes[1].plot(ks, [r["tau"] for r in fixed], marker=marker, label=f"greedy, batch {batch}")
    sampling = [r for r in rows if r["mode"] == "sampling" and r["decoder"] == "speculative"]
    if sampling:
        ks = [r["draft_tokens"] for r in sampling]
        axes[0].plot(ks, [r["speedup"] for r in sampling], marker="*", ms=10, label="sampling T=1, batch 1")
        axes[1].plot(ks, [r["tau"] for r in sampling], marker="*", ms=10, label="sampling T=1, batch 1")
    axes[0].axhline(1.0, color="gray", lw=0.8)
    depths = sorted({r["draft_tokens"] for r in rows if r["draft_tokens"]})
    for ax in axes:
        ax.set_xticks(depths)
    axes[0].set(xlabel="draft tokens k", ylabel="speedup over plain decoding", title="tokens/s speedup")
    axes[1].set(xlabel="draft tokens k", ylabel="tau (tokens / main forward, bonus counted)", title="tau")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ----------------------------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, help="trained CausalLM checkpoint (else train one first)")
    parser.add_argument("--config", type=Path, default=ROOT / "benchmarks" / "decode_model.yaml",
                        help="LightningCLI fit config of the benchmark model")
    parser.add_argument("--train-seconds", type=float, default=3600.0, help="training budget without --ckpt")
    parser.add_argument("--train-arg", action="append", default=[],
                        help="extra LightningCLI training argument (repeatable): --train-arg=--trainer.max_steps=500")
    parser.add_argument("--resume", type=Path, help="continue training a checkpoint this script saved (same config)")
    parser.add_argument("--train-only", action="store_true", help="stop after training and saving the checkpoint")
    parser.add_argument("--save-ckpt", type=Path, default=ROOT / ".cache" / "lightning_mtp" / "benchmarks" /
                        "decode_model.ckpt", help="where the trained checkpoint goes (reuse it with --ckpt)")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts (batch 8 uses 8 of them)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the median time is reported")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: batch-1 decoding of a small model gains little from more, "
                             "and an oversubscribed shared machine makes multi-threaded timings meaningless)")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="skip the torch.compile rows (mode greedy-compiled)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    if args.ckpt is None:
        model, datamodule, training = train(args.config, args.train_seconds, args.save_ckpt, args.train_arg,
                                            args.resume)
        ckpt = args.save_ckpt
        if args.train_only:
            return []
    else:
        model, datamodule = load(args.ckpt, args.config)
        ckpt, training = args.ckpt, None
    model = model.to("cpu", torch.float32).eval()
    depth = model.mtp_config.depth
    prompts = held_out_prompts(datamodule, args.prompts, args.prompt_tokens)
    if len(prompts) < args.prompts:
        print(f"only {len(prompts)} held-out windows for prompts", flush=True)
    batch_sizes = [1, 8]
    plan = modes(depth, batch_sizes, args.compile)
    # Generation must fit: shorten the budget on small-context models rather than fail.
    max_new = min(args.max_new_tokens, model.max_context - max(len(p) for p in prompts))
    print(f"{len(prompts)} prompts of {args.prompt_tokens} tokens, {max_new} new tokens, D={depth}, "
          f"{torch.get_num_threads()} threads", flush=True)

    run_mode(model, prompts[:1], 1, 8, 0)  # warm-up
    compile_seconds = None
    if args.compile:  # compile every shape the compiled rows meet before timing them (reported separately)
        start = time.perf_counter()
        for row in plan:
            if row["kwargs"].get("compile"):
                run_mode(model, prompts, row["batch_size"], max_new, seed=0, **row["kwargs"])
        compile_seconds = time.perf_counter() - start
    times = {i: [] for i in range(len(plan))}
    results = {}
    for repeat in range(args.repeats):
        for i, row in enumerate(plan):
            outputs, stats = run_mode(model, prompts, row["batch_size"], max_new, seed=repeat, **row["kwargs"])
            times[i].append(stats["elapsed_s"])
            results.setdefault(i, (outputs, stats))
    rows = []
    for i, row in enumerate(plan):
        outputs, stats = results[i]
        elapsed = statistics.median(times[i])
        record = {key: row[key] for key in ("mode", "decoder", "policy", "batch_size", "draft_tokens")}
        record.update(
            tau=stats["tau"],
            acceptance_per_depth=stats["acceptance_per_depth"],
            accepted_length_histogram=stats["accepted_length_histogram"],
            tokens_per_s=stats["total_new_tokens"] / elapsed,
            new_tokens=stats["total_new_tokens"],
            main_forwards=stats["main_forwards"],
            seconds=elapsed,
            seconds_per_step=elapsed / max(1, stats["main_forwards"]),
            drafts_per_step=sum(stats["drafted_per_depth"]) / max(1, sum(stats["accepted_length_histogram"])),
            outputs=outputs,
        )
        rows.append(record)
    for row in rows:
        plain = next(r for r in rows if r["mode"] == row["mode"] and r["batch_size"] == row["batch_size"]
                     and r["decoder"] == "plain")
        row["speedup"] = row["tokens_per_s"] / plain["tokens_per_s"]
        row["plain_seconds_per_step"] = plain["seconds_per_step"]
        row["plain_main_forwards"] = plain["main_forwards"]
        if row["mode"].startswith("greedy"):
            eager_plain = next(r for r in rows if r["mode"] == "greedy" and r["batch_size"] == row["batch_size"]
                               and r["decoder"] == "plain")
            row["lossless"] = row["outputs"] == eager_plain["outputs"]
            row["speedup_over_eager_plain"] = row["tokens_per_s"] / eager_plain["tokens_per_s"]
    costs = {batch: cost_breakdown(model, prompts[:batch], depth) for batch in batch_sizes}
    weights = weight_bytes(model)
    situ = in_situ_breakdown(model, prompts, depth, max_new)
    notes = explain(rows, costs, situ, depth, weights)
    for row in rows:
        row.pop("outputs")

    def find(mode, batch, k=None):
        """The speculative row at k drafts (fixed), or the fastest speculative row of any k and policy; eager or
        compiled (each against plain decoding run the same way)."""
        candidates = [r for r in rows if r["mode"] in (mode, f"{mode}-compiled") and r["batch_size"] == batch
                      and r["decoder"] == "speculative" and (k is None or (r["draft_tokens"] == k
                                                                            and r["policy"] == "fixed"))]
        return max(candidates, key=lambda r: r["speedup"], default=None)

    measured = {
        "batch 1 greedy speedup at D=3": find("greedy", 1, 3),
        "batch 1 greedy tau at D=3": find("greedy", 1, 3),
        "batch 8 greedy speedup (best k/policy)": find("greedy", 8),
        "batch 1 T=1 sampling speedup (best k)": find("sampling", 1),
    }
    targets = {}
    for name, goal in TARGETS.items():
        row = measured[name]
        value = None if row is None else (row["tau"] if "tau" in name else row["speedup"])
        where = None if row is None else {"mode": row["mode"], "draft_tokens": row["draft_tokens"],
                                          "policy": row["policy"]}
        targets[name] = {"target": goal, "measured": value, "met": value is not None and value >= goal, "at": where}
    best = {}
    for batch in batch_sizes:
        candidates = [r for r in rows if r["mode"] == "greedy" and r["batch_size"] == batch
                      and r["decoder"] == "speculative"]
        top = max(candidates, key=lambda r: r["tokens_per_s"])
        best[f"batch {batch}"] = {"policy": top["policy"], "draft_tokens": top["draft_tokens"],
                                  "speedup": top["speedup"]}
    summary = {
        "checkpoint": str(ckpt),
        "training": training,
        "threads": torch.get_num_threads(),
        "prompts": len(prompts),
        "max_new_tokens": max_new,
        "depth": depth,
        "architecture": model.mtp_config.architecture,
        "costs_s": {f"batch_{batch}": cost for batch, cost in costs.items()},
        "weight_bytes": weights,
        "in_situ_costs_s": situ,
        "explanation": notes,
        "targets": targets,
        "fastest_greedy_policy": best,
        "default_policy": GenerationConfig().to_kwargs(),
        "compile_seconds": compile_seconds,
    }
    (args.out / "decode.json").write_text(json.dumps(rows, indent=1))
    (args.out / "decode_summary.json").write_text(json.dumps(summary, indent=1))
    plot(rows, args.out / "decode.png")

    print(f"{'mode':15} {'decoder':12} {'policy':10} {'B':>2} {'k':>2} {'tau':>5} {'tok/s':>8} {'speedup':>7}  "
          "accept/depth")
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_depth"])
        flag = "" if r.get("lossless", True) else "  NOT LOSSLESS"
        print(f"{r['mode']:15} {r['decoder']:12} {r['policy']:10} {r['batch_size']:>2} {r['draft_tokens']:>2} "
              f"{r['tau']:5.2f} {r['tokens_per_s']:8.1f} {r['speedup']:7.2f}  {acc}{flag}")
    for batch, cost in costs.items():
        print(f"\ncost of one step (batch {batch}, seconds):", json.dumps({k: round(v, 5) for k, v in cost.items()}))
    for line in notes:
        print(line)
    print()
    for name, result in targets.items():
        value = "n/a" if result["measured"] is None else f"{result['measured']:.2f}"
        print(f"{'MET   ' if result['met'] else 'MISSED'} {name}: {value} (target >= {result['target']}; "
              f"at {result['at']})")
    print(f"\nwrote {args.out / 'decode.json'}, {args.out / 'decode_summary.json'}, {args.out / 'decode.png'}")
    return rows


if __name__ == "__main__":
    main()
