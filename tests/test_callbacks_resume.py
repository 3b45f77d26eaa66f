"""Exact resume: stop a fit mid-epoch (halfway through the depth warmup) and resume it from its checkpoint with every
MTP callback and the self-distillation term active; the resumed run reproduces the uninterrupted one's losses.

Uses the real TextDataModule on a small slice of the standard library (byte tokenizer) and a tiny CausalLM."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_mtp import MTPConfig
from lightning_mtp.callbacks import (
    MTPCouplingMonitor,
    MTPDepthWarmup,
    MTPDiversityRegularizer,
    MTPDraftCalibration,
    MTPWeightSchedule,
)
from lightning_mtp.data import TextDataModule
from lightning_mtp.models import CausalLM, ModelConfig

SAVE_AT = 6  # optimizer steps before the interruption: mid epoch 2 of 4-batch epochs, depth 2 of the 1 → 2 → 3 warmup
STEPS = 8


class Recorder(Callback):
    """Per optimizer step: the training loss and the logged schedule values; per validation: the logged metrics."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.logged: dict[int, dict[str, float]] = {}
        self.val: dict[int, dict[str, float]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = float(outputs["loss"])
        self.logged[trainer.global_step] = {
            k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/mtp/")
        }

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.val[trainer.global_step] = {
                k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")
            }


def fit(tmp_path: Path, cache: Path, *, ckpt_path=None, **trainer_kwargs):
    torch.manual_seed(0)
    datamodule = TextDataModule(
        tokenizer="byte", seq_len=64, batch_size=8, max_bytes=3_000, val_fraction=0.2, cache_dir=str(cache)
    )
    model = CausalLM(
        ModelConfig(vocab_size=258, dim=32, n_layers=1, n_heads=4, max_seq_len=64),
        MTPConfig(depth=3, distill_weight=0.2),
        learning_rate=3e-3,
        warmup_steps=3,
    )
    recorder = Recorder()
    callbacks = [
        MTPDepthWarmup(schedule={0: 1, 4: 2, 7: 3}),
        # λ follows the tokens seen (8 windows of 64 tokens per step): the token counter must survive the resume
        MTPWeightSchedule(
            schedule="linear", unit="tokens", start=0.5, end=0.1, until=STEPS * 512, depth_decay=0.8, distant_ramp=6
        ),
        MTPDiversityRegularizer(weight={0: 0.0, 3: 0.2}),
        MTPCouplingMonitor(),
        MTPDraftCalibration(grid_size=7),
        recorder,
        ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=SAVE_AT, save_top_k=-1),
    ]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=2,
        val_check_interval=4,
        check_val_every_n_epoch=None,
        callbacks=callbacks,
        default_root_dir=tmp_path,
        **trainer_kwargs,
    )
    trainer.fit(model, datamodule, ckpt_path=ckpt_path)
    return trainer, model, recorder


@pytest.mark.parametrize(
    "trainer_kwargs",
    [
        pytest.param(dict(max_steps=STEPS), id="max_steps"),
        # max_epochs: configure_optimizers asks estimated_stepping_batches, which builds the train loader before the
        # loops are restored (Lightning #20550); the datamodule's own state_dict carries the position then.
        pytest.param(dict(max_epochs=2), id="max_epochs"),
    ],
)
def test_resume_mid_epoch_reproduces_the_uninterrupted_run(tmp_path, trainer_kwargs):
    cache = tmp_path / "cache"
    trainer, model, full = fit(tmp_path / "full", cache, **trainer_kwargs)
    assert trainer.num_training_batches == 4 and trainer.global_step == STEPS  # two epochs; the stop is mid-epoch
    checkpoint = tmp_path / "full" / "ckpt" / f"epoch=1-step={SAVE_AT}.ckpt"
    assert checkpoint.is_file()
    assert torch.load(checkpoint, weights_only=True)["mtp"]["active_depth"] == 2  # halfway through the warmup

    resumed_trainer, resumed, part = fit(tmp_path / "resumed", cache, ckpt_path=str(checkpoint), **trainer_kwargs)

    assert sorted(part.losses) == list(range(SAVE_AT + 1, STEPS + 1))
    for step, loss in part.losses.items():
        assert loss == pytest.approx(full.losses[step], abs=1e-6, rel=0), f"step {step}"
        for name, value in part.logged[step].items():
            assert value == pytest.approx(full.logged[step][name], abs=1e-6, rel=0), f"{name} at step {step}"
    assert {
        "train/mtp/active_depth",
        "train/mtp/lambda",
        "train/mtp/weight_depth3",
        "train/mtp/diversity",
        "train/mtp/distill",
    } <= set(part.logged[STEPS])
    # the validation after the resume, the monitor's and the calibration's metrics included
    assert part.val[STEPS] == pytest.approx(full.val[STEPS], abs=1e-6)
    assert resumed.mtp_draft_temperatures == pytest.approx(model.mtp_draft_temperatures, abs=1e-9)
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resumable_loader_continues_the_interrupted_pass(num_workers):
    from lightning_mtp.data.loading import EpochShuffleSampler, ResumableDataLoader

    def loader():
        data = torch.arange(20)
        return ResumableDataLoader(
            data, batch_size=3, drop_last=True, sampler=EpochShuffleSampler(20, seed=5), num_workers=num_workers
        )

    reference = loader()
    passes = [[b.tolist() for b in reference] for _ in range(2)]  # 6 batches per pass, a new order each pass
    assert passes[0] != passes[1]
    interrupted = loader()
    first = iter(interrupted)
    seen = [next(first).tolist() for _ in range(4)]
    state = interrupted.state_dict()
    assert state == {"epoch": 0, "batches_yielded": 4, "pass_batches": 6, "processes": 1, "batch_size": 3}
    assert seen == passes[0][:4]
    resumed = loader()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == passes[0][4:]  # the rest of the pass, nothing read twice
    assert [b.tolist() for b in resumed] == passes[1]  # then the next pass, as uninterrupted
    at_end = loader()
    at_end.load_state_dict({"epoch": 0, "batches_yielded": 6})  # saved right at the end of a pass
    assert [b.tolist() for b in at_end] == passes[1]


@pytest.mark.parametrize("change", ["processes", "batch_size"])
def test_a_pass_saved_part_way_is_refused_on_another_number_of_processes_or_batch_size(change):
    """Skipping the batches a pass had yielded lands where it stopped only with the rows dealt out as before: a
    checkpoint of 2 processes resumed on 1 (or another batch size) would train some rows twice and others never."""
    from torch.utils.data import DistributedSampler

    from lightning_mtp.data.loading import EpochShuffleSampler, ResumableDataLoader

    data = torch.arange(40)
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=0)
    saved = ResumableDataLoader(data, batch_size=3, sampler=sampler if change == "processes" else None)
    batches = iter(saved)
    next(batches), next(batches)
    state = saved.state_dict()
    resumed = ResumableDataLoader(data, batch_size=3 if change == "processes" else 4,
                                  sampler=EpochShuffleSampler(40, seed=0))
    resumed.load_state_dict(state)
    flag = {"processes": r"processes 2 -> 1 \(--trainer.devices", "batch_size": r"batch_size 3 -> 4 \(--data.batch"}
    with pytest.raises(ValueError, match=r"^--ckpt_path: the checkpoint was saved 2 batches into an epoch.*"
                                         + flag[change]):
        next(iter(resumed))
    at_end = ResumableDataLoader(data, batch_size=4, sampler=EpochShuffleSampler(40, seed=0))
    at_end.load_state_dict({**state, "batches_yielded": 0})  # an epoch's start: nothing to skip, taken
    assert len(next(iter(at_end))) == 4


def test_a_pass_saved_at_its_end_is_refused_where_a_pass_holds_more_batches_now():
    """An epoch's end of 2 processes resumed on 1: Lightning's restored loop goes on with that epoch from its batch
    N, over the next pass's first batches, and the next pass's others were never trained (the fit exited 0). Where
    a pass holds fewer batches now (1 -> 2 processes) the next epoch starts whole."""
    from torch.utils.data import DistributedSampler

    from lightning_mtp.data.loading import EpochShuffleSampler, ResumableDataLoader

    data = torch.arange(40)
    two = ResumableDataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=2, rank=0, seed=0))
    assert len(list(two)) == 5
    state = {**two.state_dict(), "epoch": 0, "batches_yielded": 5}  # saved at that pass's last batch
    one = ResumableDataLoader(data, batch_size=4, sampler=EpochShuffleSampler(40, seed=0))
    one.load_state_dict(state)
    with pytest.raises(ValueError, match=r"saved at the end of an epoch of 5 batches, and an epoch holds 10 now "
                                         r"\(processes 2 -> 1\)"):
        next(iter(one))
    single = ResumableDataLoader(data, batch_size=4, sampler=EpochShuffleSampler(40, seed=0))
    assert len(list(single)) == 10
    shared = ResumableDataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=2, rank=0, seed=0))
    shared.load_state_dict({**single.state_dict(), "epoch": 0, "batches_yielded": 10})
    assert len(list(shared)) == 5  # the next pass, whole


def test_the_data_modules_saved_position_reaches_the_loader_lightning_iterates(tmp_path):
    """FSDP2 and DeepSpeed restore the checkpoint after Lightning made its copy of the training loader (with the
    distributed sampler) and skip their own loader restore (Lightning #20550): the position went to the data module's
    own loader, which never runs, and the resumed epoch started over (rows trained twice, others never)."""
    from types import SimpleNamespace

    from lightning_mtp.data import TextDataModule

    data = TextDataModule(tokenizer="byte", seq_len=32, batch_size=2, max_bytes=20_000, cache_dir=str(tmp_path))
    iterated = data.train_dataloader()  # Lightning's copy (under DDP / FSDP2 / DeepSpeed: with its sampler)
    own = data.train_dataloader()  # the data module's own, built last (configure_optimizers' step estimate)
    assert own is not iterated
    data.trainer = SimpleNamespace(train_dataloader=iterated, state=SimpleNamespace(fn="fit"))
    data.load_state_dict({"train_loader": {"epoch": 1, "batches_yielded": 3, "pass_batches": len(own),
                                           "processes": 1, "batch_size": 2}})
    assert iterated.state_dict()["epoch"] == 1 and iterated.state_dict()["batches_yielded"] == 3
