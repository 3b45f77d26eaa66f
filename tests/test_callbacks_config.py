"""configs/mtp.yaml, the documented full example, builds every MTP callback through the real CLI and trains."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from lightning_mtp.callbacks import (
    MTPCouplingMonitor,
    MTPDepthWarmup,
    MTPDiversityRegularizer,
    MTPDraftCalibration,
    MTPWeightSchedule,
)
from lightning_mtp.cli import MTPLightningCLI, main

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "mtp.yaml"
MTP_CALLBACKS = (MTPDepthWarmup, MTPWeightSchedule, MTPDiversityRegularizer, MTPCouplingMonitor, MTPDraftCalibration)


def tiny_overrides(tmp_path: Path) -> list[str]:
    return [
        "--trainer.max_steps=3",
        "--trainer.val_check_interval=3",
        "--trainer.log_every_n_steps=1",
        "--trainer.limit_val_batches=1",
        "--trainer.accelerator=cpu",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}",
        "--model.init_args.model.vocab_size=258",
        "--model.init_args.model.dim=32",
        "--model.init_args.model.n_layers=1",
        "--model.init_args.model.max_seq_len=32",
        "--data.init_args.tokenizer=byte",
        "--data.init_args.seq_len=32",
        "--data.init_args.batch_size=4",
        "--data.init_args.max_bytes=8000",
        "--data.init_args.val_fraction=0.2",
        f"--data.init_args.cache_dir={tmp_path / 'cache'}",
    ]


def test_config_builds_every_mtp_callback_with_typed_schedules():
    cli = MTPLightningCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=["--config", str(CONFIG)],
        run=False,
        auto_configure_optimizers=False,
    )
    found = {type(c): c for c in cli.trainer.callbacks if isinstance(c, MTP_CALLBACKS)}
    assert set(found) == set(MTP_CALLBACKS)
    assert found[MTPDepthWarmup].schedule == {0: 1, 500: 2, 1500: 3}
    assert found[MTPWeightSchedule].loss_weight(1999) == 0.3 and found[MTPWeightSchedule].loss_weight(2000) == 0.1
    assert found[MTPDiversityRegularizer].weight(500) == 0.02
    assert cli.model.mtp_config.distill_weight > 0 and "distill" in cli.model._mtp_loss_terms


def test_fit_from_the_config(tmp_path):
    main(["fit", "--config", str(CONFIG), *tiny_overrides(tmp_path)])
    (last,) = (tmp_path / "logs").rglob("last.ckpt")  # ModelCheckpoint writes next to the TensorBoard logs
    checkpoint = torch.load(last, weights_only=True)
    states = checkpoint["callbacks"]
    assert sum(key.startswith(tuple(c.__name__ for c in MTP_CALLBACKS)) for key in states) == len(MTP_CALLBACKS)
    assert checkpoint["mtp"]["active_depth"] == 1  # step 3 of the {0: 1, 500: 2, 1500: 3} warmup
    assert checkpoint["mtp"]["draft_temperatures"] != [1.0, 1.0, 1.0]  # calibrated on the validation at step 3
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in (tmp_path / "logs").rglob("events.out.tfevents.*")}
    tags = set(EventAccumulator(str(events)).Reload().Tags()["scalars"])
    expected = {
        "train/mtp/active_depth",
        "train/mtp/lambda",
        "train/mtp/weight_depth3",
        "train/mtp/diversity_weight",
        "train/mtp/distill",
        "val/mtp/coupling_depth1",
        "val/mtp/js_depth2",
        "val/mtp/accept_depth2",
        "val/mtp/accept_chained_depth3",
        "val/mtp/tau_draft3",
        "val/mtp/ece_depth1",
        "val/mtp/temperature_depth3",
        "val/mtp/draft_kl_depth1",
    }
    assert expected <= tags, sorted(expected - tags)
