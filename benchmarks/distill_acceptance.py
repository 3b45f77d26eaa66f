"""Does self-distillation raise acceptance? The same short run of the bundled CausalLM on the default corpus, without
and with the self-distillation term (``MTPConfig.distill_weight``), then the coupling monitor's teacher-forced
acceptance and τ on the held-out split.

Both runs share the seed, the initial weights and the batch order; only the loss differs. Reported per depth k:
``accept_depth{k}`` (depth k's argmax equals the main model's at i+k), ``accept_chained_depth{k}`` (depths 1..k all
matched), ``tau_draft{n}`` / ``tau_walk_draft{n}`` (tokens per main-model forward with n drafts, bonus token counted;
see ``MTPCouplingMonitor``), and the validation losses, which show what the distillation costs the MTP cross-entropy.

Usage::

    python benchmarks/distill_acceptance.py --out benchmarks/results/distill_acceptance.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch

from lightning_mtp import MTPConfig
from lightning_mtp.callbacks import MTPCouplingMonitor
from lightning_mtp.data import TextDataModule
from lightning_mtp.models import CausalLM, ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import provenance  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--distill-weight", type=float, default=1.0)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-bytes", type=int, default=2_000_000)
    parser.add_argument("--val-batches", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    parser.add_argument("--cache-dir", default=".cache/lightning_mtp")
    parser.add_argument("--out", default="benchmarks/results/distill_acceptance.json")
    return parser.parse_args()


def run(args: argparse.Namespace, datamodule: TextDataModule, distill_weight: float) -> dict:
    L.seed_everything(1234, verbose=False)
    model = CausalLM(
        ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                    max_seq_len=args.seq_len),
        MTPConfig(depth=args.depth, distill_weight=distill_weight),
        learning_rate=args.lr, warmup_steps=args.steps // 10,
    )
    trainer = L.Trainer(
        max_steps=args.steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=args.val_batches,
        num_sanity_val_steps=0, val_check_interval=args.steps, check_val_every_n_epoch=None,
        callbacks=[MTPCouplingMonitor(coupling_threshold=1.0)], gradient_clip_val=1.0,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule)
    elapsed = time.perf_counter() - start
    metrics = {k: round(float(v), 4) for k, v in sorted(trainer.callback_metrics.items()) if k.startswith("val/")}
    return {"distill_weight": distill_weight, "train_seconds": round(elapsed, 1), "metrics": metrics}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    datamodule = TextDataModule(tokenizer="bpe", vocab_size=args.vocab, seq_len=args.seq_len,
                                batch_size=args.batch_size, max_bytes=args.max_bytes, cache_dir=args.cache_dir)
    start = time.perf_counter()
    datamodule.prepare_data()
    datamodule.setup("fit")
    prepare = time.perf_counter() - start
    runs = [run(args, datamodule, 0.0), run(args, datamodule, args.distill_weight)]
    keys = [k for k in runs[0]["metrics"] if k.startswith(("val/mtp/accept", "val/mtp/tau"))]
    result = {
        "command": "python benchmarks/distill_acceptance.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "cache_dir")),
        "config": vars(args),
        "data": {"train_tokens": int(len(datamodule.train_tokens)), "val_tokens": int(len(datamodule.val_tokens)),
                 "vocab_size": datamodule.vocab_size, "prepare_seconds": round(prepare, 1)},
        "machine": provenance(__file__)["machine"],
        "before": runs[0],
        "after": runs[1],
        "acceptance": {k: {"before": runs[0]["metrics"][k], "after": runs[1]["metrics"][k]} for k in keys},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    width = max(len(k) for k in keys)
    print(f"{'metric':{width}}  before  after")
    for k in keys:
        print(f"{k:{width}}  {result['acceptance'][k]['before']:6.3f}  {result['acceptance'][k]['after']:6.3f}")
    for name in ("val/main/loss", "val/mtp/loss_depth1", f"val/mtp/loss_depth{args.depth}"):
        print(f"{name:{width}}  {runs[0]['metrics'][name]:6.3f}  {runs[1]['metrics'][name]:6.3f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
