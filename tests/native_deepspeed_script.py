"""One process: a tiny glm4_moe host with native MTP layers fine-tuned under DeepSpeed ZeRO (CPU, gloo) with the
weight schedule and depth warmup callbacks, then exported; writes ``result.json`` (run by
``tests/test_native_fine_tune.py``).

Usage: ``python tests/native_deepspeed_script.py STAGE OUT_DIR``
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_mtp import MTPConfig
from lightning_mtp.callbacks import MTPDepthWarmup, MTPWeightSchedule
from lightning_mtp.models import HFCausalLM
from lightning_mtp.strategies import CPUDeepSpeedStrategy

CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
              n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=128, num_nextn_predict_layers=2,
              eos_token_id=None, pad_token_id=0)


def main() -> None:
    stage, out = int(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, verbose=False)
    model = HFCausalLM("glm4_moe", CONFIG, mtp=MTPConfig(depth=2), learning_rate=1e-2, warmup_steps=0)
    model.configure_model()
    assert model.mtp_config.layout == "native"
    before = {name: p.detach().clone() for name, p in model.mtp_modules.named_parameters()}
    data = DataLoader(torch.randint(0, 128, (8, 24), generator=torch.Generator().manual_seed(0)), batch_size=4)
    trainer = L.Trainer(strategy=CPUDeepSpeedStrategy(stage=stage), accelerator="cpu", devices=1, max_steps=3,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, precision="32-true",
                        callbacks=[MTPDepthWarmup(schedule={0: 1, 1: 2}),
                                   MTPWeightSchedule(milestones={0: 0.3, 2: 0.1})])
    trainer.fit(model, data)
    module = trainer.lightning_module
    import deepspeed

    params = list(module.mtp_modules.parameters())
    with deepspeed.zero.GatheredParameters(params) if stage == 3 else contextlib.nullcontext():
        changed = sorted({name.split(".")[0] for name, p in module.mtp_modules.named_parameters()
                          if not torch.equal(p.detach().cpu(), before[name])})
        if stage != 3:
            module.save_pretrained(str(out / "exported"))
    loss = float(trainer.callback_metrics["train_loss"])
    (out / "result.json").write_text(json.dumps({"changed": changed, "loss": loss,
                                                 "active_depth": module.mtp_active_depth}))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
