"""Fit the bundled model with MTP on 2 CPU processes (DDP, gloo); every rank writes a digest of its weights.

Run by tests/test_ddp.py as ``python tests/scripts/ddp_fit.py OUT_DIR``; Lightning launches the second rank by
re-running this script.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch

from lightning_mtp import MTPConfig
from lightning_mtp.data import TextDataModule
from lightning_mtp.models import CausalLM, ModelConfig


def main(out_dir: Path) -> None:
    torch.set_num_threads(1)
    L.seed_everything(0)
    data = TextDataModule(tokenizer="byte", seq_len=24, batch_size=4, max_bytes=200_000,
                          cache_dir=str(out_dir / "cache"))
    model = CausalLM(ModelConfig(vocab_size=258, dim=32, n_layers=2, n_heads=4, max_seq_len=32),
                     MTPConfig(depth=2, architecture="cascaded"), warmup_steps=0)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=6, limit_val_batches=2,
                        val_check_interval=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=str(out_dir))
    trainer.fit(model, data)
    digest = {name: float(p.detach().double().sum()) for name, p in model.named_parameters()}
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps({"params": digest, "metrics": metrics,
                                                                          "world_size": trainer.world_size}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
