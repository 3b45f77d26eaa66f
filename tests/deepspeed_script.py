"""Two-process DeepSpeed run on CPU for tests/test_deepspeed.py: fit, gradient check, checkpoint, resume, predict.

Run as ``python tests/deepspeed_script.py STAGE OUT_DIR``; Lightning launches the second process itself. Rank 0 writes
``OUT_DIR/result.json``, every rank ``OUT_DIR/predict.rank<N>.json``.

Two more modes (tests/test_deepspeed_predict.py):

- ``python tests/deepspeed_script.py cli ARGS...``: ``lightning-mtp ARGS...`` (with ``--trainer.devices 2`` Lightning
  launches this script again for rank 1, so both ranks get the plain-gloo patch below);
- ``python tests/deepspeed_script.py init_from STAGE OUT_DIR CKPT``: one step of a new 2-process fit of
  :func:`make_model` from ``CKPT`` (``init_from``); rank 0 writes the gathered weights before the step, the step's
  batch and its loss to ``OUT_DIR/init_from.pt``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_mtp.strategies import CPUDeepSpeedStrategy  # noqa: E402

VOCAB, SEQ_LEN, BATCH = 61, 16, 2
SHARED = "embed.weight"  # tied with lm_head.weight
MAX_NEW_TOKENS = 12


def make_model(**kwargs):
    from lightning_mtp import MTPConfig
    from lightning_mtp.models import CausalLM, ModelConfig

    return CausalLM(
        ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, max_seq_len=64),
        MTPConfig(depth=2),
        learning_rate=1e-2, warmup_steps=0,
        generation={"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0},
        **kwargs,
    )


def train_data(n: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ_LEN), generator=torch.Generator().manual_seed(1))


def prompts(n: int = 4) -> torch.Tensor:
    # Different prompts per rank (the distributed sampler splits them): ranks accept different numbers of drafts.
    return torch.randint(0, VOCAB, (n, 5), generator=torch.Generator().manual_seed(2))


def full_state(module) -> dict:
    """Every parameter, gathered under ZeRO-3 (collective: all ranks call it)."""
    import deepspeed

    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: p.detach().clone() for name, p in params.items()}


class GradientProbe(L.Callback):
    """Step 0: the shared weight's and an MTP weight's full gradients, and a plain single-process reference."""

    def __init__(self, out: Path) -> None:
        self.out, self.batch, self.weights = out, None, None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 0 and self.weights is None:
            self.batch, self.weights = batch.clone(), full_state(module)

    def on_after_backward(self, trainer, module):
        if trainer.global_step != 0 or self.batch is None:
            return
        from deepspeed.utils import safe_get_full_grad

        names = [SHARED, "mtp_modules.0.eh_proj.weight", "layers.0.attn.wq.weight"]
        params = dict(module.named_parameters())
        names = [n for n in names if n in params]
        grads = {n: safe_get_full_grad(params[n]) for n in names}
        if trainer.global_rank == 0:
            reference = make_model()
            reference.configure_model()
            reference.load_state_dict(self.weights, strict=False)
            batch = self.batch
            reference.compute_lm_loss(batch).loss.backward()
            ref = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
            # The MTP depths' own share of the shared weight's gradient (must be nonzero: both paths reach it).
            reference.zero_grad()
            reference.compute_mtp_loss(reference(batch), batch).loss.backward()
            report = {
                "names": names,
                "max_abs_diff": {n: float((grads[n].float() - ref[n].float()).abs().max()) for n in names},
                "ref_norm": {n: float(ref[n].norm()) for n in names},
                "mtp_part_norm_shared": float(dict(reference.named_parameters())[SHARED].grad.norm()),
            }
            (self.out / "grads.json").write_text(json.dumps(report))
        self.batch = None


class FirstStepProbe(L.Callback):
    """Rank 0 saves the gathered weights before step 0, the step's batch and its loss (``init_from`` mode)."""

    def __init__(self, out: Path) -> None:
        self.out, self.record = out, {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 0 and not self.record:
            self.record = {"weights": full_state(module), "batch": batch.clone()}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if "loss" not in self.record:
            self.record["loss"] = outputs["loss"].detach().clone()
            if trainer.global_rank == 0:
                torch.save(self.record, self.out / "init_from.pt")


def init_from_main() -> None:
    """A new 2-process fit (1 step) of :func:`make_model` that starts from ``CKPT`` (``init_from``)."""
    stage, out, ckpt = int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy=CPUDeepSpeedStrategy(stage=stage), max_steps=1, use_distributed_sampler=False,
                        accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, precision="32-true",
                        callbacks=[FirstStepProbe(out)])
    trainer.fit(make_model(init_from=ckpt), DataLoader(train_data(), batch_size=BATCH))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def main() -> None:
    stage, out = int(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    common = dict(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                  enable_checkpointing=False, precision="32-true")
    # Same data on both ranks for the fit, so that the averaged gradient equals the single-process one.
    data = DataLoader(train_data(), batch_size=BATCH)
    L.seed_everything(0, verbose=False)
    model = make_model()
    trainer = L.Trainer(strategy=CPUDeepSpeedStrategy(stage=stage), max_steps=2, use_distributed_sampler=False,
                        callbacks=[GradientProbe(out)], **common)
    trainer.fit(model, data)
    ckpt = out / "step2.ckpt"
    trainer.save_checkpoint(ckpt)
    losses_first = float(trainer.callback_metrics["train_loss"])

    # Resume in a fresh model and trainer: 2 more steps.
    model = make_model()
    trainer = L.Trainer(strategy=CPUDeepSpeedStrategy(stage=stage), max_steps=4, use_distributed_sampler=False,
                        **common)
    trainer.fit(model, data, ckpt_path=ckpt)
    resumed_step = trainer.global_step
    final = out / "step4.ckpt"
    trainer.save_checkpoint(final)
    weights = full_state(trainer.lightning_module)

    # Predict, greedy speculative, on different prompts per rank (one prompt per batch), so that ranks accept
    # different numbers of drafts. Then again with EOS = rank 0's first new token: rank 0 stops at once and must run
    # padding steps while rank 1 decodes on.
    module, rank = trainer.lightning_module, trainer.global_rank
    rows = list(range(rank, len(prompts()), trainer.world_size))
    loader = DataLoader(prompts()[rows], batch_size=1)
    record = {"rows": rows}
    for name in ("plain", "eos"):
        predictions = trainer.predict(module, loader)
        record[name] = {
            "eos": module.mtp_generate_kwargs.get("eos_token_id"),
            "tokens": [t for p in predictions for t in p["tokens"]],
            "main_forwards": [p["stats"].main_forwards for p in predictions],
            "row_forwards": [p["stats"].row_forwards for p in predictions],
        }
        first = torch.tensor(record["plain"]["tokens"][0][0])
        module.mtp_generate_kwargs["eos_token_id"] = int(trainer.strategy.broadcast(first, src=0))
    (out / f"predict.rank{rank}.json").write_text(json.dumps(record))
    if rank == 0:
        torch.save(weights, out / "gathered_weights.pt")
        (out / "result.json").write_text(json.dumps({
            "first_fit_loss": losses_first, "resumed_global_step": resumed_step,
            "world_size": trainer.world_size,
        }))
    # Tear the process group down before the interpreter exits: left to shutdown, a still-joinable gloo thread was
    # seen to abort the process ("terminate called without an active exception") after all the work was done.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.comm.torch

    # DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce on first use (a C++ build, about a minute);
    # plain gloo collectives are enough here.
    deepspeed.comm.torch.build_shm_op = lambda: None
    if sys.argv[1] == "cli":
        from lightning_mtp.cli import main as cli_main

        cli_main(sys.argv[2:])
    elif sys.argv[1] == "init_from":
        init_from_main()
    else:
        main()
