"""One optimizer step on 2 CPU processes (DDP, gloo) with 2 accumulated batches of padded records of very different
lengths; each rank saves the step's gradients and the rows it trained on.

Run by tests/test_step_tokens.py as ``python tests/scripts/ddp_step_tokens.py CORPUS OUT_DIR``; Lightning launches
the second rank by re-running this script.
"""

import sys
from pathlib import Path

import lightning as L
import torch

from lightning_mtp import MTPConfig
from lightning_mtp.data import TextDataModule
from lightning_mtp.models import CausalLM, ModelConfig


def build_model() -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(ModelConfig(vocab_size=258, dim=32, n_layers=2, n_heads=4, max_seq_len=64), MTPConfig(depth=2),
                    warmup_steps=0)


class FirstStep(L.Callback):
    """The weights the fit starts from, the rows of its first optimizer step and that step's gradients."""

    def __init__(self):
        self.rows, self.grads, self.initial = [], None, None

    def on_train_start(self, trainer, pl_module):
        # (a launcher may reseed between building the model and configure_model: the reference takes these)
        self.initial = {name: value.detach().clone() for name, value in pl_module.state_dict().items()}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.grads is None:
            self.rows += [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None}


def main(corpus: str, out_dir: Path) -> None:
    torch.set_num_threads(1)
    data = TextDataModule(corpus=corpus, tokenizer="byte", seq_len=64, batch_size=2, packing=False, num_proc=1,
                          cache_dir=str(out_dir / "cache"), val_fraction=0.1)
    probe = FirstStep()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=1, accumulate_grad_batches=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[probe],
                        default_root_dir=str(out_dir))
    trainer.fit(build_model(), data)
    fell_back = trainer.lightning_module._mtp_step_tokens.warned  # per-batch means: the loader held no window
    torch.save({"rows": probe.rows, "grads": probe.grads, "fell_back": fell_back, "initial": probe.initial},
               out_dir / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
