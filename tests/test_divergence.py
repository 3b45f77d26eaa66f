"""A diverging fit stops at its first non-finite loss or gradient, keeps its last good checkpoint, and nothing
downstream (saving, predict, generate, export) accepts non-finite weights."""

from __future__ import annotations

import math
import re

import lightning as L
import pytest
import torch
from conftest import cli_refusal, tiny_fit_args, tiny_model, tiny_predict_args

from lightning_mtp import MTPConfig
from lightning_mtp.cli import main
from lightning_mtp.finite import TrainingDiverged


def test_a_diverging_fit_stops_with_the_step_losses_and_advice_and_keeps_its_last_good_checkpoint(tmp_path, capsys):
    # A learning rate of 30 without clipping or warmup: the loss explodes within a few steps.
    args = tiny_fit_args(tmp_path, "--trainer.max_steps", "40", "--trainer.val_check_interval", "2",
                         "--model.init_args.learning_rate", "30", "--trainer.gradient_clip_val", "null",
                         "--model.init_args.warmup_steps", "0")
    with pytest.raises(SystemExit) as stopped:
        main(args)
    assert stopped.value.code == 1  # the run failed (2 is kept for bad input)
    err = capsys.readouterr().err
    found = re.search(r"training diverged at global step (\d+): loss \S+, main \S+, depth 1 \S+, depth 2 \S+", err)
    assert found, err
    step = int(found.group(1))
    assert step < 40 and "--model.init_args.learning_rate, now 30" in err and "--trainer.gradient_clip_val" in err
    assert "--trainer.precision 32-true" not in err  # the fit ran in full precision already: no such advice
    last = tmp_path / "ckpt" / "last.ckpt"
    assert str(last) in err and "--model.init_args.init_from" in err
    checkpoint = torch.load(last, weights_only=True)
    assert checkpoint["global_step"] <= step
    assert all(torch.isfinite(t).all() for t in checkpoint["state_dict"].values())  # the last good weights


def nan_hook(grad: torch.Tensor) -> torch.Tensor:
    return torch.full_like(grad, float("nan"))


class NaNGradient(L.Callback):
    """From step ``at`` on, the embedding's gradient is NaN while the loss stays finite."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            pl_module.embed.weight.register_hook(nan_hook)


def test_a_non_finite_gradient_with_a_finite_loss_stops_the_fit_before_the_step(tmp_path):
    model = tiny_model(depth=2)
    before = {}

    class Snapshot(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            before.update({k: v.clone() for k, v in pl_module.state_dict().items()})

    trainer = L.Trainer(accelerator="cpu", max_steps=5, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, callbacks=[NaNGradient(at=2), Snapshot()],
                        default_root_dir=tmp_path)
    data = torch.utils.data.DataLoader(torch.randint(0, 61, (16, 12)), batch_size=2)
    with pytest.raises(TrainingDiverged, match=r"at global step 2: loss [0-9.]+.*gradient norm nan"):
        trainer.fit(model, data)
    for name, value in model.state_dict().items():  # the step was not applied
        torch.testing.assert_close(value, before[name], atol=0, rtol=0, msg=name)


class NaNUpdate(L.Callback):
    """After optimizer step ``at``, a weight is NaN: an update that overflowed from a finite loss and gradients."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            with torch.no_grad():
                pl_module.layers[0].mlp.down.weight[0, 0] = float("nan")


def test_an_update_that_writes_nan_stops_the_fit_as_diverged_and_says_the_weights_are_not_finite(tmp_path):
    """The step's loss and gradients were finite, so the guard let it through: the next step's report said "the step
    was not applied" over NaN weights, and a save right after was refused as bad input (exit 2)."""
    from lightning_mtp.callbacks import SafeCheckpoint

    data = torch.utils.data.DataLoader(torch.randint(0, 61, (16, 12)), batch_size=2)
    trainer = L.Trainer(accelerator="cpu", max_steps=5, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, callbacks=[NaNUpdate(at=2)], default_root_dir=tmp_path)
    with pytest.raises(TrainingDiverged, match=r"at global step 2: .*already NaN or infinite \(layers\.0\.mlp"):
        trainer.fit(tiny_model(depth=2), data)

    checkpoints = SafeCheckpoint(dirpath=str(tmp_path / "ckpt"), save_every_minutes=None)
    trainer = L.Trainer(accelerator="cpu", max_steps=5, logger=False, enable_progress_bar=False,
                        val_check_interval=1, limit_val_batches=1, num_sanity_val_steps=0,
                        callbacks=[NaNUpdate(at=2), checkpoints], default_root_dir=tmp_path)
    with pytest.raises(TrainingDiverged, match=r"by global step 2: refusing to write a checkpoint: .*NaN"):
        trainer.fit(tiny_model(depth=2), data, data)
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 1 and all(torch.isfinite(t).all() for t in last["state_dict"].values())


def test_non_finite_weights_are_never_saved_nor_decoded(tmp_path):
    model = tiny_model(depth=2)
    with torch.no_grad():
        model.layers[0].mlp.down.weight[0, 0] = float("nan")
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.strategy.connect(model)
    with pytest.raises(ValueError, match=r"refusing to write a checkpoint: .*layers\.0\.mlp\.down\.weight"):
        trainer.save_checkpoint(tmp_path / "nan.ckpt")
    assert not (tmp_path / "nan.ckpt").exists()
    with pytest.raises(ValueError, match=r"generate: CausalLM's weights hold NaN .*layers\.0\.mlp\.down\.weight"):
        model.generate(torch.tensor([[1, 2, 3]]), 4, speculative=False)


def test_predict_and_export_refuse_a_checkpoint_with_non_finite_weights(tiny_checkpoint, tmp_path, capsys):
    checkpoint = torch.load(tiny_checkpoint[1], weights_only=True)
    name = next(k for k in checkpoint["state_dict"] if k.startswith("layers."))
    checkpoint["state_dict"][name] = checkpoint["state_dict"][name] * float("inf")
    broken = tmp_path / "diverged.ckpt"
    torch.save(checkpoint, broken)
    err = cli_refusal(tiny_predict_args(tmp_path, broken), capsys)
    assert f"--ckpt_path {broken}" in err and "NaN or infinite" in err and name in err
    assert not (tmp_path / "predictions").exists()
    err = cli_refusal(["export", "--ckpt_path", str(broken), "--out", str(tmp_path / "exported")], capsys)
    assert "NaN or infinite" in err


@pytest.mark.parametrize("field", ["loss_weight", "distill_weight", "mlp_ratio"])
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_non_finite_mtp_config_values_are_refused_in_python(field, value):
    with pytest.raises(ValueError, match=rf"MTPConfig\.{field} \(--model\.mtp\.{field}\) must be a finite number"):
        MTPConfig(**{field: value})
    with pytest.raises(ValueError, match=r"MTPConfig\.depth_weights .* finite"):
        MTPConfig(depth=2, depth_weights=[1.0, value])


def test_a_16_true_fit_that_diverges_is_told_to_use_mixed_precision(tmp_path, capsys):
    """Under ``16-true`` AdamW diverges at the first step whatever the learning rate (its eps 1e-8 and small squared
    gradients are 0 in float16): the advice was only a lower learning rate and a longer warmup."""
    args = tiny_fit_args(tmp_path, "--trainer.max_steps", "3", "--trainer.precision", "16-true",
                         "--model.init_args.learning_rate", "1e-6")
    with pytest.raises(SystemExit) as stopped:
        main(args)
    err = capsys.readouterr().err
    assert stopped.value.code == 1 and "training diverged" in err, err[-2000:]
    assert "--trainer.precision 16-mixed or bf16-mixed instead of 16-true" in err


def test_per_depth_losses_keep_their_precision_when_the_default_dtype_is_bfloat16():
    """``bf16-true`` sets torch's default dtype to bfloat16: the per-depth losses were gathered into a tensor of the
    default dtype, so the logged ``train/mtp/loss_depth{k}`` were rounded (5.5625 for 5.5648)."""
    model = tiny_model()
    ids = torch.randint(3, 61, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = model.compute_lm_loss(ids).depth_losses
    torch.set_default_dtype(torch.bfloat16)
    try:
        depth_losses = model.compute_lm_loss(ids).depth_losses
    finally:
        torch.set_default_dtype(torch.float32)
    assert depth_losses.dtype == torch.float32
    torch.testing.assert_close(depth_losses, expected)


def test_resuming_a_float32_fit_under_bf16_true_is_refused_naming_the_flag(tmp_path, capsys):
    """The float32 weights and AdamW states were rounded to bfloat16 without a word (the next checkpoint bfloat16)."""
    main(tiny_fit_args(tmp_path, "--trainer.max_steps", "2"))
    err = cli_refusal(tiny_fit_args(tmp_path, "--trainer.max_steps", "4", "--trainer.precision", "bf16-true",
                                    "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt")), capsys)
    assert "--trainer.precision bf16-true: the checkpoint's weights are float32" in err
