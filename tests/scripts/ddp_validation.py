"""Validate on 2 CPU processes (DDP, gloo): the metrics a user reads must equal one process's.

Run by tests/test_ddp.py as ``python tests/scripts/ddp_validation.py OUT_DIR``; rank 0 writes ``metrics.json``:
``text``: ``val/`` metrics of a ``TextDataModule`` whose held-out windows do not split evenly over 2 processes;
``monitor``: ``MTPCouplingMonitor``'s metrics where process 1's only row scores too few tokens for depth 2.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_mtp import MTPConfig
from lightning_mtp.callbacks import MTPCouplingMonitor
from lightning_mtp.data import TextDataModule
from lightning_mtp.models import CausalLM, ModelConfig


def text_setup(cache: Path) -> tuple[CausalLM, TextDataModule]:
    """The model and data of the ``text`` case (also built by the test, for its one-process reference)."""
    torch.manual_seed(0)
    data = TextDataModule(tokenizer="byte", seq_len=32, batch_size=4, max_bytes=20_000, cache_dir=str(cache))
    model = CausalLM(ModelConfig(vocab_size=258, dim=32, n_layers=2, n_heads=4, max_seq_len=32), MTPConfig(depth=2))
    return model, data


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


def trainer(out_dir: Path, **kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out_dir), **kwargs)


def main(out_dir: Path) -> None:
    torch.set_num_threads(1)
    model, data = text_setup(out_dir / "cache")
    text = trainer(out_dir).validate(model, data, verbose=False)[0]
    torch.manual_seed(0)
    ids = torch.randint(3, 64, (2, 16))
    labels = ids[1].clone()
    labels[:-2] = -100  # process 1's row scores 2 tokens: no position for depth 2's acceptance there
    rows = Rows([{"input_ids": ids[0], "labels": ids[0].clone()}, {"input_ids": ids[1], "labels": labels}])
    model = CausalLM(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=64), MTPConfig(depth=2))
    monitor = trainer(out_dir, callbacks=[MTPCouplingMonitor()]).validate(model, DataLoader(rows, batch_size=1),
                                                                           verbose=False)[0]
    if torch.distributed.get_rank() == 0:
        (out_dir / "metrics.json").write_text(json.dumps({"text": text, "monitor": monitor}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
