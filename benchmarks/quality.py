"""Does MTP make the main model better? The bundled CausalLM trained at equal steps and tokens with next-token loss
only and with MTP objectives, several seeds each, scored by the main head's loss on held-out text.

Objectives (every one sees the same batches in the same order for a given seed, from the same initial trunk):

- ``next_token``: no MTP loss. ``MTPConfig(depth=1, loss_weight=0.0)`` with ``mtp_active_depth = 0``: the depth
  module exists but never runs, so the loss is exactly the next-token cross-entropy and the trunk's gradient is
  exactly next-token training's (``tests/test_quality_benchmark.py`` checks both against a plain cross-entropy).
- ``mtp_d1``: D = 1, λ = 0.1 constant.
- ``mtp_d3``: D = 3, λ = 0.3, with ``MTPDepthWarmup`` and ``MTPWeightSchedule`` on ``configs/mtp.yaml``'s schedule
  scaled to the run: depth 1 → 2 at 1/6 of the steps → 3 at 1/2; λ 0.3 → 0.1 at 2/3; w_k = 0.8^(k-1) with depths
  ≥ 2 ramped in over the first 1/3.
- ``mtp_d1_distill``, ``mtp_d3_distill``: the same plus self-distillation (``MTPConfig.distill_weight``).

The seed sets the initial weights (``L.seed_everything(seed)`` right before the modules are built; the trunk is
built before the MTP modules, so every objective starts from the same trunk) and the order of the training windows
(a sampler with its own generator). The corpus split and the BPE tokenizer do not depend on the seed: every run is
scored on the same text with the same tokenizer.

Reported per run (one row of ``benchmarks/results/quality.json``, written as soon as the run finishes):

- ``val_loss_stdlib``: the main head's mean next-token cross-entropy (nats per token) over every window of
  ``TextDataModule``'s validation split (standard-library files held out by name);
- ``val_loss_thirdparty``: the same over the Python sources of an installed non-stdlib package (default
  ``jsonargparse``) that training never saw, tokenized with the run's tokenizer;
- ``tau``: for MTP runs, ``MTPCouplingMonitor``'s ``val/mtp/tau_walk_draft{D}`` on the stdlib validation split:
  teacher-forced greedy tokens per main-model forward with D drafts, bonus token counted (see the README's
  "TensorBoard names"), over the first ``--tau-windows`` windows. Not measured for ``next_token`` (its depth module
  is untrained).

Then the summary: mean ± std (sample std over seeds) per objective, and each MTP objective's paired difference to
``next_token`` (same seed, same data order), mean ± std over seeds.

Usage::

    python benchmarks/quality.py                 # the full sweep: 15 runs, 2 at a time (about 40 min on 2 busy cores)
    python benchmarks/quality.py --quick --out /tmp/quality.json   # plumbing only, tiny sizes, in-process
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality_summary import summarize, table  # noqa: E402

OBJECTIVES = {
    # name: (depth, λ, distill, depth warmup + weight schedule)
    "next_token": (1, 0.0, False, False),
    "mtp_d1": (1, 0.1, False, False),
    "mtp_d1_distill": (1, 0.1, True, False),
    "mtp_d3": (3, 0.3, False, True),
    "mtp_d3_distill": (3, 0.3, True, True),
}
"""The objectives compared; ``next_token`` runs with ``mtp_active_depth = 0`` (no MTP forward, no MTP loss)."""

COST = {"next_token": 1.0, "mtp_d1": 1.4, "mtp_d1_distill": 1.8, "mtp_d3": 1.9, "mtp_d3_distill": 2.8}
"""Rough step cost relative to ``next_token``; within a seed the costly runs start first."""

FULL = dict(
    steps=256, seeds=[0, 1, 2], objectives=list(OBJECTIVES), dim=128, layers=4, heads=4, tokenizer="bpe", vocab=2048,
    seq_len=128, batch_size=16, lr=2e-3, max_bytes=8_000_000, distill_weight=1.0, thirdparty="jsonargparse",
    thirdparty_bytes=400_000, tau_windows=256, eval_batch_size=32, jobs=2, threads=1,
)
"""The defaults of a full sweep; any flag overrides one."""

QUICK = dict(
    steps=4, seeds=[0, 1], dim=32, layers=1, heads=2, tokenizer="byte", vocab=258, seq_len=32, batch_size=4,
    max_bytes=200_000, thirdparty_bytes=20_000, tau_windows=32, eval_batch_size=16, jobs=0,
)
"""``--quick``: the same pipeline at sizes that run in seconds (a smoke test of the plumbing, not a measurement)."""


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, in-process (plumbing only)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (the same for every objective)")
    parser.add_argument("--seeds", type=int, nargs="+")
    parser.add_argument("--objectives", nargs="+", choices=list(OBJECTIVES))
    parser.add_argument("--dim", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--tokenizer", choices=["bpe", "byte"])
    parser.add_argument("--vocab", type=int, help="BPE vocabulary (data and model)")
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--max-bytes", type=int, help="bytes of the standard library read (train + val)")
    parser.add_argument("--distill-weight", type=float, help="MTPConfig.distill_weight of the *_distill objectives")
    parser.add_argument("--thirdparty", help="installed non-stdlib package whose .py sources are the unseen corpus")
    parser.add_argument("--thirdparty-bytes", type=int, help="bytes of that package read at most")
    parser.add_argument("--tau-windows", type=int, help="stdlib validation windows (the first ones) scored for tau")
    parser.add_argument("--eval-batch-size", type=int)
    parser.add_argument("--jobs", type=int, help="runs at once, each in its own process; 0: one by one in-process")
    parser.add_argument("--threads", type=int, help="torch threads per run")
    parser.add_argument("--cache-dir", default=".cache/lightning_mtp")
    parser.add_argument("--out", default="benchmarks/results/quality.json")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows of --out when its config equals this one and run only the missing ones")
    parser.add_argument("--worker", nargs=3, metavar=("CONFIG", "OBJECTIVE", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = {**FULL, **(QUICK if args.quick else {})}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.tokenizer == "byte":
        args.vocab = 258
    return args


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """Everything that decides the numbers (what ``--resume`` compares)."""
    keys = ["steps", "seeds", "objectives", "dim", "layers", "heads", "tokenizer", "vocab", "seq_len", "batch_size",
            "lr", "max_bytes", "distill_weight", "thirdparty", "thirdparty_bytes", "tau_windows", "quick"]
    config = {k: getattr(args, k) for k in keys}
    config["warmup_steps"] = warmup_steps(args.steps)
    config["d3_schedule"] = d3_schedule(args.steps)
    config["gradient_clip_val"] = 1.0
    return config


def warmup_steps(steps: int) -> int:
    return max(1, steps // 10)


def d3_schedule(steps: int) -> dict[str, Any]:
    """``configs/mtp.yaml``'s depth warmup and weight schedule (3000 steps) scaled to ``steps``."""
    at = [max(1, round(steps * f)) for f in (1 / 6, 1 / 2, 2 / 3, 1 / 3)]
    return {"depth_warmup": {0: 1, at[0]: 2, max(at[1], at[0] + 1): 3},
            "lambda_milestones": {0: 0.3, at[2]: 0.1}, "depth_decay": 0.8, "distant_ramp": at[3]}


# ----------------------------------------------------------------------------------------------------- data


def make_datamodule(args: argparse.Namespace):
    from lightning_mtp.data import TextDataModule

    # seed 1234 (the default) fixes the split; the run's seed only orders the training windows (make_train_loader)
    datamodule = TextDataModule(tokenizer=args.tokenizer, vocab_size=args.vocab, seq_len=args.seq_len,
                                batch_size=args.batch_size, max_bytes=args.max_bytes, cache_dir=args.cache_dir)
    datamodule.prepare_data()
    datamodule.setup("fit")
    return datamodule


def thirdparty_corpus(package: str, max_bytes: int) -> tuple[list[str], dict[str, Any]]:
    """The ``.py`` sources of an installed package, sorted by path, whole files until ``max_bytes``."""
    from lightning_mtp.data import cap_bytes, find_corpus_files, read_texts, stdlib_root

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"--thirdparty {package!r}: not an installed package")
    root = Path(list(spec.submodule_search_locations)[0])
    if root.resolve().is_relative_to(stdlib_root().resolve()) and "site-packages" not in root.parts:
        raise SystemExit(f"--thirdparty {package!r} is part of the standard library ({root}); name a third-party one")
    budget = cap_bytes(find_corpus_files(str(root)), max_bytes)
    files = [f for f, n in budget.items() if n == f.stat().st_size]  # whole files only
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = None
    info = {"package": package, "version": version, "files": len(files), "bytes": sum(budget[f] for f in files)}
    return read_texts(files), info


def thirdparty_tokens(args: argparse.Namespace, tokenizer) -> tuple[Any, dict[str, Any]]:
    from lightning_mtp.data import tokenize_documents

    texts, info = thirdparty_corpus(args.thirdparty, args.thirdparty_bytes)
    ids = tokenize_documents(texts, tokenizer)
    return ids, {**info, "tokens": int(ids.size)}


def make_train_loader(datamodule, seed: int, steps: int):
    """Shuffled training windows whose order depends on ``seed`` only (not on the global RNG or the objective)."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    dataset = datamodule.train_dataset
    generator = torch.Generator().manual_seed(seed)
    sampler = RandomSampler(dataset, num_samples=steps * datamodule.batch_size, generator=generator)
    return DataLoader(dataset, batch_size=datamodule.batch_size, sampler=sampler, drop_last=True)


# ----------------------------------------------------------------------------------------------------- one run


def build_model(args: argparse.Namespace, objective: str, seed: int):
    """The model of one run, with its weights initialised from ``seed`` (trunk first, then the MTP modules)."""
    import lightning as L

    from lightning_mtp import MTPConfig
    from lightning_mtp.models import CausalLM, ModelConfig

    depth, loss_weight, distill, _ = OBJECTIVES[objective]
    model = CausalLM(
        ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                    max_seq_len=args.seq_len),
        MTPConfig(depth=depth, loss_weight=loss_weight, distill_weight=args.distill_weight if distill else 0.0),
        learning_rate=args.lr, warmup_steps=warmup_steps(args.steps),
    )
    L.seed_everything(seed, verbose=False)
    model.configure_model()
    if objective == "next_token":
        model.mtp_active_depth = 0  # no MTP forward and no MTP loss: plain next-token training
    return model


def schedule_callbacks(args: argparse.Namespace, objective: str) -> list:
    from lightning_mtp.callbacks import MTPDepthWarmup, MTPWeightSchedule

    if not OBJECTIVES[objective][3]:
        return []
    s = d3_schedule(args.steps)
    return [MTPDepthWarmup(schedule=s["depth_warmup"]),
            MTPWeightSchedule(schedule="step", milestones=s["lambda_milestones"], unit="steps",
                              depth_decay=s["depth_decay"], distant_ramp=s["distant_ramp"])]


def main_head_loss(model, tokens, seq_len: int, batch_size: int) -> tuple[float, int]:
    """(mean next-token cross-entropy of the main head in nats, targets scored) over non-overlapping windows."""
    import torch
    import torch.nn.functional as F

    from lightning_mtp.data import TokenWindowDataset

    dataset = TokenWindowDataset(tokens, seq_len)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(dataset), batch_size):
            ids = torch.stack([dataset[i]["input_ids"] for i in range(start, min(start + batch_size, len(dataset)))])
            logits = model.logits(model(ids[:, :-1]))  # (B, T-1, V)
            total += float(F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum"))
            count += ids[:, 1:].numel()
    return total / count, count


def teacher_forced_tau(model, datamodule, args: argparse.Namespace) -> dict[str, float]:
    """``MTPCouplingMonitor``'s validation metrics over the first ``tau_windows`` windows of the stdlib validation
    split."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_mtp.callbacks import MTPCouplingMonitor

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=math.ceil(args.tau_windows / args.eval_batch_size),
                        callbacks=[MTPCouplingMonitor(coupling_threshold=1.0)])
    loader = DataLoader(datamodule.val_dataset, batch_size=args.eval_batch_size, shuffle=False)
    trainer.validate(model, dataloaders=loader, verbose=False)
    return {k: float(v) for k, v in sorted(trainer.callback_metrics.items()) if k.startswith("val/")}


def train_and_evaluate(args: argparse.Namespace, objective: str, seed: int, datamodule, thirdparty) -> dict[str, Any]:
    import lightning as L

    model = build_model(args, objective, seed)
    trainer = L.Trainer(
        max_steps=args.steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        gradient_clip_val=1.0, callbacks=schedule_callbacks(args, objective),
    )
    start = time.perf_counter()
    trainer.fit(model, train_dataloaders=make_train_loader(datamodule, seed, args.steps))
    train_seconds = time.perf_counter() - start
    if trainer.global_step != args.steps:
        raise RuntimeError(f"{objective} seed {seed}: trained {trainer.global_step} steps, expected {args.steps}")
    start = time.perf_counter()
    stdlib_loss, stdlib_targets = main_head_loss(model, datamodule.val_tokens, args.seq_len, args.eval_batch_size)
    thirdparty_loss, thirdparty_targets = main_head_loss(model, thirdparty, args.seq_len, args.eval_batch_size)
    depth = model.mtp_config.depth
    row = {
        "objective": objective, "seed": seed, "steps": trainer.global_step,
        "tokens": trainer.global_step * args.batch_size * args.seq_len,
        "val_loss_stdlib": round(stdlib_loss, 5), "val_loss_thirdparty": round(thirdparty_loss, 5), "tau": None,
        "depth": depth, "final_active_depth": model.mtp_active_depth, "final_lambda": model.mtp_loss_weight,
        "targets_stdlib": stdlib_targets, "targets_thirdparty": thirdparty_targets,
    }
    if objective != "next_token":
        monitor = teacher_forced_tau(model, datamodule, args)
        row["tau"] = round(monitor[f"val/mtp/tau_walk_draft{depth}"], 4)
        row["tau_walk_by_draft"] = [round(monitor[f"val/mtp/tau_walk_draft{n}"], 4) for n in range(1, depth + 1)]
        row["accept_chained_by_depth"] = [round(monitor[f"val/mtp/accept_chained_depth{k}"], 4)
                                          for k in range(1, depth + 1)]
        # the mixin's own val/main/loss on those windows (a cross-check of main_head_loss on a prefix of the split)
        row["val_main_loss_tau_windows"] = round(monitor["val/main/loss"], 5)
    row["train_seconds"] = round(train_seconds, 1)
    row["eval_seconds"] = round(time.perf_counter() - start, 1)
    return row


def setup_process(threads: int) -> None:
    import torch

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore", message=r".*(num_workers|does not have many workers).*")
    import logging

    import lightning  # noqa: F401  (registers its loggers)

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("lightning"):  # the per-fit banners (GPU/TPU available, tips) of 15 fits
            logging.getLogger(name).setLevel(logging.WARNING)


def worker(config_path: str, objective: str, seed: int) -> None:
    """One run in its own process (``--jobs N``): reads the resolved arguments, prints its row as JSON."""
    args = argparse.Namespace(**json.loads(Path(config_path).read_text(encoding="utf-8")))
    setup_process(args.threads)
    datamodule = make_datamodule(args)
    tokens, _ = thirdparty_tokens(args, datamodule.tokenizer)
    row = train_and_evaluate(args, objective, seed, datamodule, tokens)
    print("ROW " + json.dumps(row), flush=True)


# ----------------------------------------------------------------------------------------------------- summary


def write_result(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def command_line(argv: Optional[list[str]]) -> str:
    given = sys.argv[1:] if argv is None else argv
    return " ".join(["python benchmarks/quality.py", *given]).strip()


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]))
        return {}
    setup_process(args.threads)
    config = run_config(args)
    out = Path(args.out)
    rows: list[dict[str, Any]] = []
    if args.resume and out.is_file():
        previous = json.loads(out.read_text(encoding="utf-8"))
        if json.loads(json.dumps(previous.get("config"))) == json.loads(json.dumps(config)):
            rows = previous.get("rows", [])
            print(f"resuming: {len(rows)} rows from {out}")
        else:
            print(f"--resume: {out} was written with another config; starting afresh")

    start = time.perf_counter()
    datamodule = make_datamodule(args)
    tokens, thirdparty_info = thirdparty_tokens(args, datamodule.tokenizer)
    import torch

    result = {
        "command": command_line(argv),
        "config": config,
        "data": {"stdlib_train_tokens": int(len(datamodule.train_tokens)),
                 "stdlib_val_tokens": int(len(datamodule.val_tokens)), "vocab_size": datamodule.vocab_size,
                 "thirdparty": thirdparty_info, "prepare_seconds": round(time.perf_counter() - start, 1)},
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "cpus": os.cpu_count(), "threads_per_run": args.threads, "runs_at_once": max(args.jobs, 1)},
        "tau_source": "MTPCouplingMonitor val/mtp/tau_walk_draft{D} on the first tau_windows windows of the stdlib "
                      "validation split (teacher-forced, greedy, bonus token counted)",
        "rows": rows,
    }
    done = {(r["objective"], r["seed"]) for r in rows}
    todo = [(o, s) for s in args.seeds for o in sorted(args.objectives, key=lambda o: -COST[o]) if (o, s) not in done]
    print(f"{len(todo)} runs: {args.steps} steps of {args.batch_size} x {args.seq_len} tokens each; "
          f"stdlib train {result['data']['stdlib_train_tokens']} / val {result['data']['stdlib_val_tokens']} tokens, "
          f"{args.thirdparty} {thirdparty_info['tokens']} tokens", flush=True)

    def finished(row: dict[str, Any]) -> None:
        rows.append(row)
        rows.sort(key=lambda r: (args.objectives.index(r["objective"]), r["seed"]))
        result["summary"] = summarize(rows, [o for o in args.objectives if any(r["objective"] == o for r in rows)])
        write_result(out, result)
        print(f"[{time.perf_counter() - start:6.0f}s] {row['objective']:<15} seed {row['seed']}: stdlib "
              f"{row['val_loss_stdlib']:.4f}  third-party {row['val_loss_thirdparty']:.4f}  tau {row['tau']}  "
              f"({row['train_seconds']:.0f}s train, {row['eval_seconds']:.0f}s eval)", flush=True)

    failures = []
    if args.jobs == 0:
        for objective, seed in todo:
            finished(train_and_evaluate(args, objective, seed, datamodule, tokens))
    else:
        failures = run_in_processes(args, todo, finished)
    result["summary"] = summarize(rows, [o for o in args.objectives if any(r["objective"] == o for r in rows)])
    result["total_seconds"] = round(time.perf_counter() - start, 1)
    write_result(out, result)
    print()
    print(table(result["summary"]))
    print(f"\nwrote {out} ({len(rows)} rows, {result['total_seconds']:.0f}s)")
    if failures:
        raise SystemExit(f"{len(failures)} run(s) failed: {failures}")
    return result


def run_in_processes(args: argparse.Namespace, todo: list[tuple[str, int]], finished) -> list[str]:
    """Each run in its own process, ``args.jobs`` at a time; ``finished(row)`` is called in the main thread."""
    failures = []
    with tempfile.TemporaryDirectory(prefix="quality-") as tmp:
        config_path = Path(tmp) / "args.json"
        config_path.write_text(json.dumps(vars(args)), encoding="utf-8")
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
               "TOKENIZERS_PARALLELISM": "false"}

        def launch(objective: str, seed: int) -> subprocess.CompletedProcess:
            command = [sys.executable, os.path.abspath(__file__), "--worker", str(config_path), objective, str(seed)]
            return subprocess.run(command, capture_output=True, text=True, env=env)

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = {pool.submit(launch, o, s): (o, s) for o, s in todo}
            for future in as_completed(futures):
                objective, seed = futures[future]
                proc = future.result()
                lines = [line for line in proc.stdout.splitlines() if line.startswith("ROW ")]
                if proc.returncode or not lines:
                    failures.append(f"{objective} seed {seed}")
                    print(f"{objective} seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}",
                          file=sys.stderr, flush=True)
                    continue
                finished(json.loads(lines[-1][4:]))
    return failures


if __name__ == "__main__":
    main()
