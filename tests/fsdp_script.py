"""Two-process CPU runs (gloo) for tests/test_fsdp.py: one launch per strategy, every variant fitted in it.

Run as ``python tests/fsdp_script.py STRATEGY OUT_DIR [PARTS]`` with STRATEGY ``ddp``, ``fsdp2`` or ``zero3``;
Lightning starts the second process itself. PARTS (comma-separated, default ``equivalence``):

- ``equivalence``: 3 optimizer steps of every variant (:data:`VARIANTS`: both architectures, recompute and
  detach_trunk on and off, a ``transformers`` trunk); rank 0 writes each one's gathered parameters, before and
  after, to ``OUT_DIR/<variant>.pt``.
- ``callbacks``: a fit (recompute on) with every callback of configs/mtp.yaml and validation; rank 0 writes the logged
  metrics to ``OUT_DIR/callbacks.json``.
- ``lifecycle`` (fsdp2): a fit of 2 steps through ``SafeCheckpoint``, resumed to 4, against an uninterrupted fit of 4
  (``resume.pt``), a consolidated checkpoint (``step4.ckpt``), then speculative predict on prompts that accept
  drafts on rank 0 and not on rank 1, and with an EOS that stops rank 0 at once (``predict.rank<N>.json``).
- ``bf16`` (fsdp2): 3 steps with bf16 parameters and fp32 reductions, and the same in fp32 (``bf16.json``).
- ``native`` (fsdp2): a glm4_moe host with native MTP layers, 2 steps, its consolidated checkpoint (``native.ckpt``)
  and gathered weights (``native_weights.pt``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_mtp import MTPMixin  # noqa: E402
from lightning_mtp.layers import Block, RMSNorm, RotaryTable  # noqa: E402

VOCAB, SEQ_LEN, BATCH, STEPS = 61, 16, 2, 3
MAX_NEW_TOKENS = 12
LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)

VARIANTS = {
    "cascaded": dict(architecture="cascaded"),
    "cascaded_recompute": dict(architecture="cascaded", recompute=True),
    "cascaded_detach": dict(architecture="cascaded", detach_trunk=True),
    "cascaded_recompute_detach_distill": dict(architecture="cascaded", recompute=True, detach_trunk=True,
                                              distill_weight=0.1),
    "parallel": dict(architecture="parallel"),
    "parallel_recompute": dict(architecture="parallel", recompute=True),
    "parallel_detach": dict(architecture="parallel", detach_trunk=True),
    "own_module": dict(architecture="cascaded", recompute=True, host="own"),
    "hf_llama": dict(architecture="cascaded", host="hf"),
    "hf_llama_recompute_detach": dict(architecture="cascaded", recompute=True, detach_trunk=True, host="hf"),
}
"""Name -> MTPConfig fields, and ``host``: ``"hf"`` for a ``transformers`` llama trunk, ``"own"`` for :class:`OwnLM`."""


class OwnLM(MTPMixin, L.LightningModule):
    """A module of one's own, as docs/distributed.md shows it: its trunk is not called through ``self(...)``, and
    FSDP2 finds its blocks by itself (the default ``mtp_trunk_blocks``: its longest ``nn.ModuleList``)."""

    def __init__(self, mtp=None, generation=None):
        super().__init__(mtp=mtp, generation=generation)
        self.embed = nn.Embedding(VOCAB, 64)
        self.blocks = nn.ModuleList(Block(64, 4, None, 128) for _ in range(2))
        self.norm = RMSNorm(64)
        self.head = nn.Linear(64, VOCAB, bias=False)
        self.rope = RotaryTable(64, 16)

    def mtp_token_embedding(self): return self.embed
    def mtp_output_head(self): return self.head
    def mtp_final_norm(self): return self.norm

    def mtp_trunk_hidden_states(self, input_ids):
        x, (cos, sin) = self.embed(input_ids), self.rope(input_ids.shape[1])
        for block in self.blocks:
            x = block(x, cos, sin)
        return x

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def make_model(host: str = "causal", generation: dict | None = None, learning_rate: float = 1e-3, **mtp):
    from lightning_mtp import MTPConfig
    from lightning_mtp.models import CausalLM, HFCausalLM, ModelConfig

    config = MTPConfig(depth=2, **mtp)
    generation = generation or {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0}
    if host == "own":
        return OwnLM(config, generation)
    if host == "hf":
        return HFCausalLM("llama", LLAMA, mtp=config, learning_rate=learning_rate, warmup_steps=0,
                          generation=generation, attn_implementation="sdpa")
    return CausalLM(ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64),
                    config, learning_rate=learning_rate, warmup_steps=0, generation=generation)


def train_data(n: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ_LEN), generator=torch.Generator().manual_seed(1))


def strategy_for(name: str, **kwargs):
    if name == "ddp":
        return "ddp"
    if name == "fsdp2":
        from lightning_mtp.strategies import FSDP2Strategy

        return FSDP2Strategy(**kwargs)
    from lightning_mtp.strategies import CPUDeepSpeedStrategy

    return CPUDeepSpeedStrategy(stage=3)


def full_parameters(module) -> dict:
    """Every parameter, whole, as CPU tensors on rank 0 (collective: every rank calls it)."""
    params = dict(module.named_parameters())
    if any(hasattr(p, "ds_id") for p in params.values()):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {name: p.detach().cpu().clone() for name, p in params.items()}
    from lightning_mtp.sharded import is_fsdp2_module

    if is_fsdp2_module(module):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {name: state[name].clone() for name in params if name in state}
    return {name: p.detach().cpu().clone() for name, p in params.items()}


def fsdp_units(module) -> list[str]:
    """Names of the FSDP2 units (``""``: the root)."""
    from torch.distributed.fsdp import FSDPModule

    return [name for name, sub in module.named_modules() if isinstance(sub, FSDPModule)]


class Weights(L.Callback):
    """The gathered parameters at the start of the fit (before any step)."""

    def __init__(self) -> None:
        self.before = None

    def on_train_start(self, trainer, module):
        self.before = full_parameters(module)


COMMON = dict(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
              precision="32-true")


def equivalence(strategy: str, out: Path) -> None:
    timings = {}
    only = os.environ.get("MTP_VARIANTS")
    for name, fields in VARIANTS.items():
        if only and name not in only.split(","):
            continue
        start = time.perf_counter()
        fields = dict(fields)
        host = fields.pop("host", "causal")
        L.seed_everything(0, verbose=False)
        model = make_model(host, **fields)
        weights = Weights()
        trainer = L.Trainer(strategy=strategy_for(strategy), max_steps=STEPS, enable_checkpointing=False,
                            callbacks=[weights], **COMMON)
        trainer.fit(model, DataLoader(train_data(), batch_size=BATCH))
        module = trainer.lightning_module
        after = full_parameters(module)
        tied = module.mtp_output_head().weight is module.mtp_token_embedding().weight
        if trainer.global_rank == 0:
            torch.save({"before": weights.before, "after": after, "units": fsdp_units(module), "tied": tied},
                       out / f"{name}.pt")
        timings[name] = round(time.perf_counter() - start, 2)
    if trainer.global_rank == 0:
        (out / "equivalence_timings.json").write_text(json.dumps(timings))


def mtp_yaml_callbacks() -> list:
    """Every callback of configs/mtp.yaml (its MTP ones with schedules shortened to a few steps)."""
    from lightning_mtp.callbacks import (
        MTPCouplingMonitor,
        MTPDepthWarmup,
        MTPDiversityRegularizer,
        MTPDraftCalibration,
        MTPWeightSchedule,
    )

    return [MTPDepthWarmup(schedule={0: 1, 2: 2}),
            MTPWeightSchedule(schedule="step", milestones={0: 0.3, 3: 0.1}, unit="steps", depth_decay=0.8,
                              distant_ramp=2),
            MTPDiversityRegularizer(weight={0: 0.0, 1: 0.02}, only_differing_targets=True),
            MTPCouplingMonitor(coupling_threshold=0.5),
            MTPDraftCalibration(max_batches=2),
            L.pytorch.callbacks.LearningRateMonitor(logging_interval="step")]


class Metrics(L.Callback):
    """Every value logged during the fit, step by step (rank 0's, as the logger sees them)."""

    def __init__(self) -> None:
        self.logged: dict = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._take(trainer, f"step{trainer.global_step}")

    def on_validation_end(self, trainer, module):
        if not trainer.sanity_checking:
            self._take(trainer, f"val{trainer.global_step}")

    def _take(self, trainer, when: str) -> None:
        self.logged[when] = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}


def callbacks(strategy: str, out: Path) -> None:
    from lightning.pytorch.loggers import CSVLogger

    L.seed_everything(0, verbose=False)
    model = make_model(architecture="cascaded", recompute=True, distill_weight=0.1)
    metrics = Metrics()
    # MTPDepthWarmup leaves depth 2 without gradients at first: DDP must look for unused parameters (FSDP2 need not)
    chosen = "ddp_find_unused_parameters_true" if strategy == "ddp" else strategy_for(strategy)
    trainer = L.Trainer(strategy=chosen, max_steps=4, val_check_interval=2, limit_val_batches=2,
                        check_val_every_n_epoch=None, num_sanity_val_steps=0, enable_checkpointing=False,
                        callbacks=mtp_yaml_callbacks() + [metrics],
                        **{**COMMON, "logger": CSVLogger(out / "logs", name="callbacks")})
    data = DataLoader(train_data(), batch_size=BATCH)
    trainer.fit(model, data, DataLoader(train_data(8), batch_size=BATCH))
    if trainer.global_rank == 0:
        (out / "callbacks.json").write_text(json.dumps(metrics.logged))


def repeating_data(n: int = 8) -> torch.Tensor:
    """Rows of one token repeated: a few steps teach every depth to repeat it, so drafts get accepted on such prompts
    and not on random ones."""
    return torch.stack([torch.full((SEQ_LEN,), (7 * i) % VOCAB) for i in range(n)])


def prompts() -> torch.Tensor:
    """Rank 0 decodes rows 0 and 2 (repeated tokens: drafts accepted), rank 1 rows 1 and 3 (random: rejected)."""
    random = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    return torch.stack([torch.full((5,), 7), random[0], torch.full((5,), 14), random[1]])


class StopAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def lifecycle(strategy: str, out: Path) -> None:
    """4 steps straight, and 2 of 4 steps saved by ``SafeCheckpoint`` then resumed to 4; the consolidated checkpoint;
    then predict across ranks."""
    from lightning_mtp.callbacks import SafeCheckpoint

    data = DataLoader(repeating_data(), batch_size=BATCH)
    fits = {}
    for name, ckpt in (("straight", None), ("first", None), ("resumed", out / "safe" / "last.ckpt")):
        L.seed_everything(0, verbose=False)
        model = make_model(architecture="cascaded", recompute=True, learning_rate=1e-2)
        # the first fit stops after 2 of its 4 steps (same learning-rate schedule); SafeCheckpoint saves every step
        save = [SafeCheckpoint(dirpath=out / "safe", save_every_minutes=1e-9), StopAt(2)] if name == "first" else []
        trainer = L.Trainer(strategy=strategy_for(strategy), max_steps=4, callbacks=save,
                            enable_checkpointing=bool(save), **COMMON)
        trainer.fit(model, data, ckpt_path=ckpt)
        fits[name] = full_parameters(trainer.lightning_module)
    trainer.save_checkpoint(out / "step4.ckpt")
    if trainer.global_rank == 0:
        torch.save({**fits, "global_step": trainer.global_step}, out / "resume.pt")
    predict(trainer, out)


def predict(trainer, out: Path) -> None:
    """Greedy speculative predict of one prompt per batch, different prompts per rank; then again with EOS = rank 0's
    first new token, so that rank 0 stops at once and runs padding steps while rank 1 decodes on."""
    module, rank = trainer.lightning_module, trainer.global_rank
    rows = list(range(rank, len(prompts()), trainer.world_size))  # what the distributed sampler gives this rank
    loader = DataLoader(prompts(), batch_size=1)
    record = {"rows": rows}
    for name in ("plain", "eos"):
        predictions = trainer.predict(module, loader)
        record[name] = {
            "eos": module.mtp_generate_kwargs.get("eos_token_id"),
            "tokens": [t for p in predictions for t in p["tokens"]],
            "main_forwards": [p["stats"].main_forwards for p in predictions],
            "row_forwards": [p["stats"].row_forwards for p in predictions],
            "accepted": [p["stats"].accepted_per_depth for p in predictions],
        }
        first = torch.tensor(record["plain"]["tokens"][0][0])
        module.mtp_generate_kwargs["eos_token_id"] = int(trainer.strategy.broadcast(first, src=0))
    (out / f"predict.rank{rank}.json").write_text(json.dumps(record))


class ComputeDtype(L.Callback):
    """The dtype the trunk's first block computes in (its output's), read during the first training step."""

    def __init__(self) -> None:
        self.dtype = None

    def on_train_start(self, trainer, module):
        def hook(block, args, output):
            self.dtype = self.dtype or str(output.dtype)

        self.handle = module.mtp_trunk_blocks()[0].register_forward_hook(hook)

    def on_train_end(self, trainer, module):
        self.handle.remove()


def bf16(strategy: str, out: Path) -> None:
    """The same 3 steps in fp32 and with bf16 parameters and fp32 reductions: the losses of every step."""
    record = {}
    for name, kwargs in (("fp32", {}), ("bf16", {"param_dtype": "bfloat16", "reduce_dtype": "float32"})):
        L.seed_everything(0, verbose=False)
        model = make_model(architecture="cascaded", recompute=True)
        losses, dtype = Losses(), ComputeDtype()
        trainer = L.Trainer(strategy=strategy_for(strategy, **kwargs), max_steps=STEPS, enable_checkpointing=False,
                            callbacks=[losses, dtype], **COMMON)
        trainer.fit(model, DataLoader(train_data(), batch_size=BATCH))
        record[name] = {"losses": losses.values, "compute_dtype": dtype.dtype,
                        "sharded_dtype": str(next(trainer.lightning_module.parameters()).dtype)}
    if trainer.global_rank == 0:
        (out / "bf16.json").write_text(json.dumps(record))


class Losses(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.values.append(float(outputs["loss"]))


GLM4_MOE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=64, num_nextn_predict_layers=2,
                eos_token_id=None, pad_token_id=0)


def native(strategy: str, out: Path) -> None:
    """A glm4_moe host with native MTP layers: 2 steps, its consolidated checkpoint and its gathered weights."""
    from lightning_mtp import MTPConfig
    from lightning_mtp.models import HFCausalLM

    L.seed_everything(0, verbose=False)
    model = HFCausalLM("glm4_moe", GLM4_MOE, mtp=MTPConfig(depth=2), learning_rate=1e-2, warmup_steps=0)
    trainer = L.Trainer(strategy=strategy_for(strategy), max_steps=2, enable_checkpointing=False, **COMMON)
    trainer.fit(model, DataLoader(train_data(), batch_size=BATCH))
    trainer.save_checkpoint(out / "native.ckpt")
    weights = full_parameters(trainer.lightning_module)
    if trainer.global_rank == 0:
        torch.save(weights, out / "native_weights.pt")


def main() -> None:
    strategy, out = sys.argv[1], Path(sys.argv[2])
    parts = sys.argv[3].split(",") if len(sys.argv) > 3 else ["equivalence"]
    out.mkdir(parents=True, exist_ok=True)
    for part in parts:
        parts_by_name = {"equivalence": equivalence, "callbacks": callbacks, "lifecycle": lifecycle, "bf16": bf16,
                         "native": native}
        parts_by_name[part](strategy, out)
    if torch.distributed.is_initialized():  # tear down before exit (a joinable gloo thread can abort the process)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "zero3":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed.comm.torch

        deepspeed.comm.torch.build_shm_op = lambda: None  # plain gloo collectives; no C++ build on first use
    main()
