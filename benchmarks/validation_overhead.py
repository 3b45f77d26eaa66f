"""Validation time with every callback of ``configs/mtp.yaml`` against validation without callbacks, side by side.

The bundled ``CausalLM`` shaped as in ``configs/mtp.yaml`` (width, layers, heads, 3 cascaded depths, λ and
self-distillation) is validated with ``Trainer.validate`` on the held-out split of ``TextDataModule`` (the Python
standard library's sources), with three sets of callbacks, timed alternately in the same loop so that load on the
machine hits all of them alike:

- ``none``: no callbacks (the validation loss alone);
- ``shared``: every callback of ``configs/mtp.yaml``; the monitor and the calibration read the forward that
  ``validation_step`` computed for the loss (``MTPMixin.mtp_validation_forward``) and its cross-entropy's argmaxes;
- ``rerun``: the same callbacks, each re-running the trunk, every depth and the argmax pass on each batch, as
  before the forward was shared (``share_forward = False`` on the monitor and the calibration).

Run on the code from before the change (``--label before-...``, with that code first on ``PYTHONPATH``), the
``shared`` and ``rerun`` variants are both the old behaviour.

Reported per variant: the fastest validation epoch (``on_validation_epoch_start`` to ``on_validation_epoch_end``,
callbacks' epoch-end work included) in wall time and in the process's CPU time, their ratios to ``none``, and the
trunk forwards per batch. On a shared machine the CPU-time ratio is the steadier one (one torch thread by default).
Batches are 4 × 256 tokens (the configuration's are 16 × 256) so that a run takes minutes on two CPU cores; the
calibration's ``max_batches: 10`` of the configuration's 20 validation batches is kept. ``--tokenizer byte`` (default)
is quick to set up; ``--tokenizer bpe --vocab-size 4096`` has the configuration's vocabulary, and with it the
callbacks' own work over the vocabulary weighs more. The argmaxes of every position come from the validation loss's
cross-entropy; the callbacks compute logits only on their ``max_positions`` per batch, for the softmaxes (JS, ECE)
and the calibration's temperature grid.

Usage::

    python benchmarks/validation_overhead.py --out benchmarks/results/validation_overhead.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import lightning as L
import torch
import yaml

from lightning_mtp import MTPConfig
from lightning_mtp.callbacks import MTPCouplingMonitor, MTPDraftCalibration
from lightning_mtp.data import TextDataModule
from lightning_mtp.models import CausalLM, ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import provenance  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "mtp.yaml"
VARIANTS = ("none", "shared", "rerun")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte")
    parser.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary (the byte tokenizer has its own)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--val-batches", type=int, default=None,
                        help="validation batches per epoch (default: the config's limit_val_batches)")
    parser.add_argument("--active-depth", type=int, default=None,
                        help="active MTP depth during validation (default: all; lower it to time the warm-up phase)")
    parser.add_argument("--max-bytes", type=int, default=3_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadiest on a shared machine)")
    parser.add_argument("--cache-dir", default=".cache/lightning_mtp")
    parser.add_argument("--label", default=None,
                        help="name of this run in the results file (default: the tokenizer and vocabulary); runs "
                             "under other labels are kept, so code before a change can be run with the same script")
    parser.add_argument("--out", default="benchmarks/results/validation_overhead.json")
    return parser.parse_args()


def config_callbacks(config: dict, share_forward: bool) -> list[L.Callback]:
    """Every callback of the config, built from its class path and init args."""
    callbacks = []
    for entry in config["trainer"]["callbacks"]:
        module, _, name = entry["class_path"].rpartition(".")
        callback = getattr(importlib.import_module(module), name)(**entry.get("init_args", {}))
        if isinstance(callback, (MTPCouplingMonitor, MTPDraftCalibration)):
            callback.share_forward = share_forward
        callbacks.append(callback)
    return callbacks


class EpochTimer(L.Callback):
    """Wall time of each validation epoch and trunk forwards per batch; last in the list, so its epoch end comes
    after every other callback's."""

    trunk_calls = 0  # CausalLM.forward calls (the trunk), counted by a forward pre-hook on the model

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []
        self.trunk_calls_per_batch: list[float] = []
        self._start = self._cpu_start = 0.0
        self._calls = 0
        self._batches = 0

    @classmethod
    def count(cls, *_) -> None:
        cls.trunk_calls += 1

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self._calls, self._batches = EpochTimer.trunk_calls, 0
        self._start, self._cpu_start = time.perf_counter(), time.process_time()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._batches += 1

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        self.seconds.append(time.perf_counter() - self._start)
        self.cpu_seconds.append(time.process_time() - self._cpu_start)
        self.trunk_calls_per_batch.append((EpochTimer.trunk_calls - self._calls) / max(self._batches, 1))


def validate(model: CausalLM, dataloader, config: dict, variant: str, timer: EpochTimer, val_batches: int) -> None:
    callbacks = [] if variant == "none" else config_callbacks(config, share_forward=variant == "shared")
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=variant != "none",
                        limit_val_batches=val_batches, callbacks=[*callbacks, timer])
    trainer.validate(model, dataloader, verbose=False)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    config = yaml.safe_load(CONFIG.read_text())
    val_batches = args.val_batches or config["trainer"]["limit_val_batches"]
    datamodule = TextDataModule(tokenizer=args.tokenizer, vocab_size=args.vocab_size, seq_len=args.seq_len,
                                batch_size=args.batch_size, max_bytes=args.max_bytes, cache_dir=args.cache_dir)
    datamodule.prepare_data()
    datamodule.setup("validate")
    dataloader = datamodule.val_dataloader()
    model_args = config["model"]["init_args"]
    L.seed_everything(1234, verbose=False)
    model = CausalLM(
        ModelConfig(**{**model_args["model"], "vocab_size": datamodule.vocab_size, "max_seq_len": args.seq_len}),
        MTPConfig(**model_args["mtp"]),
    )
    model.configure_model()
    if args.active_depth is not None:
        model.mtp_active_depth = args.active_depth
    timers = {variant: EpochTimer() for variant in VARIANTS}
    hook = model.register_forward_pre_hook(EpochTimer.count)
    for repeat in range(args.repeats + 1):  # the first round warms up allocator and kernels, and is not kept
        for variant in VARIANTS:
            validate(model, dataloader, config, variant, timers[variant], val_batches)
        if repeat == 0:
            for timer in timers.values():
                timer.seconds.clear()
                timer.cpu_seconds.clear()
                timer.trunk_calls_per_batch.clear()
        print(f"round {repeat}: " + ", ".join(f"{v} {timers[v].seconds[-1]:.2f} s" for v in VARIANTS if
                                              timers[v].seconds), flush=True)
    hook.remove()
    base, base_cpu = min(timers["none"].seconds), min(timers["none"].cpu_seconds)
    rows = {}
    for variant in VARIANTS:
        timer = timers[variant]
        rows[variant] = {
            "epoch_s": min(timer.seconds),
            "ratio_to_none": min(timer.seconds) / base,
            "epoch_cpu_s": min(timer.cpu_seconds),
            "cpu_ratio_to_none": min(timer.cpu_seconds) / base_cpu,
            "epoch_s_all": timer.seconds,
            "trunk_forwards_per_batch": timer.trunk_calls_per_batch[-1],
        }
        print(f"{variant:>7}: {rows[variant]['epoch_s']:.2f} s, {rows[variant]['ratio_to_none']:.3f}x no callbacks "
              f"(CPU time {rows[variant]['cpu_ratio_to_none']:.3f}x), "
              f"{rows[variant]['trunk_forwards_per_batch']:.1f} trunk forwards per batch")
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "label")}
    settings.update(val_batches=val_batches, vocab=datamodule.vocab_size, threads=torch.get_num_threads(),
                    model=model_args["model"], mtp=model_args["mtp"])
    label = args.label or (args.tokenizer if args.tokenizer == "byte" else f"bpe{datamodule.vocab_size}")
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results.setdefault("runs", {})[label] = {
        **provenance(__file__),  # this run's command line and machine
        "settings": settings,
        "shares_forward": hasattr(MTPCouplingMonitor, "share_forward"),  # False: code from before the change
        "variants": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {label!r} to {out}")


if __name__ == "__main__":
    main()
