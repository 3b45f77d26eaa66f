"""Checkpoints carry MTP metadata, load with weights_only, and a depth mismatch is reported, never silent."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_mtp import MTPConfig
from lightning_mtp.checkpointing import load_weights
from lightning_mtp.models import CausalLM, ModelConfig

MODEL = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, max_seq_len=32)


def fit_and_save(tmp_path, depth, name="model.ckpt", architecture="cascaded"):
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**MODEL), MTPConfig(depth=depth, architecture=architecture), warmup_steps=0)
    data = torch.utils.data.DataLoader(torch.randint(0, 61, (8, 12)), batch_size=4)
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=tmp_path, accelerator="cpu")
    trainer.fit(model, data)
    path = tmp_path / name
    trainer.save_checkpoint(path)
    return model, path


def test_metadata_is_plain_and_loads_with_weights_only(tmp_path):
    model, path = fit_and_save(tmp_path, depth=2)
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["mtp"]["depth"] == 2 and checkpoint["mtp"]["architecture"] == "cascaded"
    assert checkpoint["mtp"]["config"]["loss_weight"] == 0.3
    loaded = CausalLM.load_from_checkpoint(path, weights_only=True)
    assert loaded.mtp_config.depth == 2 and loaded.mtp_load_report.clean
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    assert loaded.lm_head.weight is loaded.embed.weight  # tying survives the round trip


def test_loading_another_depth_reports_new_and_dropped_weights(tmp_path):
    _, path = fit_and_save(tmp_path, depth=3)
    with pytest.warns(UserWarning, match=r"dropped weights: mtp_modules\.2 \(depth 3\)"):
        shallower = CausalLM.load_from_checkpoint(path, weights_only=True, mtp=MTPConfig(depth=2))
    report = shallower.mtp_load_report
    assert report.checkpoint_depth == 3 and not report.new
    assert all(key.startswith("mtp_modules.2.") for key in report.dropped)

    with pytest.warns(UserWarning, match=r"new \(freshly initialised\) weights: mtp_modules\.3 \(depth 4\)"):
        deeper = CausalLM.load_from_checkpoint(path, weights_only=True, mtp=MTPConfig(depth=4))
    assert all(key.startswith("mtp_modules.3.") for key in deeper.mtp_load_report.new)
    saved = torch.load(path, weights_only=True)["state_dict"]
    assert torch.equal(deeper.state_dict()["mtp_modules.0.eh_proj.weight"], saved["mtp_modules.0.eh_proj.weight"])


def test_plain_checkpoint_without_mtp_weights_loads_with_report(tmp_path):
    model, path = fit_and_save(tmp_path, depth=1)
    plain = {k: v for k, v in model.state_dict().items() if not k.startswith("mtp_")}
    plain_path = tmp_path / "plain.pt"
    torch.save(plain, plain_path)
    fresh = CausalLM(ModelConfig(**MODEL), MTPConfig(depth=2))
    fresh.configure_model()
    with pytest.warns(UserWarning, match="new"):
        report = load_weights(fresh, str(plain_path))
    assert report.checkpoint_depth == 0 and len(report.new) > 0 and not report.dropped
    assert torch.equal(fresh.layers[0].attn.qkv.weight, model.layers[0].attn.qkv.weight)


def test_resuming_a_fit_with_another_depth_is_refused_clearly(tmp_path):
    _, path = fit_and_save(tmp_path, depth=2)
    model = CausalLM(ModelConfig(**MODEL), MTPConfig(depth=3), warmup_steps=0)
    data = torch.utils.data.DataLoader(torch.randint(0, 61, (8, 12)), batch_size=4)
    trainer = L.Trainer(max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=tmp_path, accelerator="cpu")
    with pytest.raises(ValueError, match=r"cannot resume this fit.*--model\.init_from"):
        trainer.fit(model, data, ckpt_path=path)


def test_init_from_starts_a_new_fit_from_another_depths_weights(tmp_path):
    source, path = fit_and_save(tmp_path, depth=1)
    model = CausalLM(ModelConfig(**MODEL), MTPConfig(depth=2), warmup_steps=0, init_from=str(path))
    data = torch.utils.data.DataLoader(torch.randint(0, 61, (8, 12)), batch_size=4)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=tmp_path, accelerator="cpu")
    with pytest.warns(UserWarning, match="new"):
        trainer.fit(model, data)
    assert model.mtp_load_report.checkpoint_depth == 1
    assert any(k.startswith("mtp_modules.1.") for k in model.mtp_load_report.new)


def test_architecture_mismatch_with_other_shapes_fails_clearly(tmp_path):
    _, path = fit_and_save(tmp_path, depth=1)
    with pytest.raises(ValueError, match="another model width"):
        CausalLM.load_from_checkpoint(path, weights_only=True, model=ModelConfig(**{**MODEL, "dim": 64, "n_heads": 4}))


def test_init_from_starts_from_its_own_schedule_not_the_old_runs(tmp_path):
    """A checkpoint saved mid-warmup (λ 0.05, depth weights changed, active depth 1 of 2) starts a new fit with the new
    config's λ, weights and every depth active, so depth 2 trains even without an MTPDepthWarmup callback."""
    model, path = fit_and_save(tmp_path, depth=2)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["mtp"].update(loss_weight=0.05, depth_weights=[1.0, 0.25], active_depth=1, draft_temperatures=[0.8, 0.9])
    torch.save(checkpoint, path)

    fresh = CausalLM(ModelConfig(**MODEL), MTPConfig(depth=2, loss_weight=0.3))
    fresh.configure_model()
    load_weights(fresh, str(path))
    assert (fresh.mtp_loss_weight, fresh.mtp_depth_weights, fresh.mtp_active_depth) == (0.3, [1.0, 1.0], 2)
    assert fresh.mtp_draft_temperatures == [0.8, 0.9]  # a calibration of these weights, kept with them
    out = fresh.compute_lm_loss(torch.randint(0, 61, (2, 12)))
    assert out.depth_losses[1] > 0

    # load_from_checkpoint (predict, or weights for a new fit) does not continue the old schedule either ...
    loaded = CausalLM.load_from_checkpoint(path, weights_only=True)
    assert (loaded.mtp_loss_weight, loaded.mtp_active_depth) == (0.3, 2)
    # ... only a resumed fit does (tests/test_callbacks_resume.py checks the resumed run step by step).


def test_unreadable_checkpoints_name_the_path_and_flag(tmp_path):
    from lightning_mtp.checkpoint_files import read_checkpoint

    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    _, good = fit_and_save(tmp_path, depth=1)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    text = tmp_path / "notes.ckpt"
    text.write_text("not a checkpoint\n")
    cases = ((tmp_path / "missing.ckpt", "does not exist"), (empty, "empty file"), (truncated, "cannot be read"),
             (text, "cannot be read"), (tmp_path, "not a DeepSpeed checkpoint"))
    for path, why in cases:
        with pytest.raises(ValueError, match=why) as info:
            read_checkpoint(path, "--model.init_args.init_from")
        assert "--model.init_args.init_from" in str(info.value) and str(path) in str(info.value)
        assert "weights_only=False" not in str(info.value) and info.value.__cause__ is None


def resume(tmp_path, path, model, callbacks=(), max_steps=4):
    data = torch.utils.data.DataLoader(torch.randint(0, 61, (8, 12)), batch_size=4)
    trainer = L.Trainer(max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=tmp_path, accelerator="cpu", callbacks=list(callbacks))
    trainer.fit(model, data, ckpt_path=path)
    return trainer


def test_resuming_with_another_loss_weight_or_depth_weights_is_refused_not_ignored(tmp_path):
    """The resume restores the fit's λ and w: a module built with other ones trained with the checkpoint's, silently
    (the CLI refused the flags; Python did not)."""
    _, path = fit_and_save(tmp_path, depth=2)
    for change in (dict(loss_weight=0.9), dict(depth_weights=[1.0, 0.25])):
        model = CausalLM(ModelConfig(**MODEL), MTPConfig(depth=2, **change), warmup_steps=0)
        with pytest.raises(ValueError, match=f"MTPConfig.{next(iter(change))}.*init_from"):
            resume(tmp_path, path, model)
    resume(tmp_path, path, CausalLM(ModelConfig(**MODEL), MTPConfig(depth=2), warmup_steps=0))  # the same: resumes


def test_resuming_a_warmup_without_its_callback_trains_every_depth_with_a_warning(tmp_path):
    """Saved at active depth 1 of 2 under a warmup, resumed without it: depth 1 stayed active for the rest of the fit
    (nothing raises it any more)."""
    from lightning_mtp.callbacks import MTPDepthWarmup

    _, path = fit_and_save(tmp_path, depth=2)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["mtp"]["active_depth"] = 1
    torch.save(checkpoint, path)
    model = CausalLM(ModelConfig(**MODEL), MTPConfig(depth=2), warmup_steps=0)
    with pytest.warns(UserWarning, match="resumed at MTP depth 1 of 2.*all 2 depths train"):
        resume(tmp_path, path, model)
    assert model.mtp_active_depth == 2
    warmed = CausalLM(ModelConfig(**MODEL), MTPConfig(depth=2), warmup_steps=0)
    resume(tmp_path, path, warmed, [MTPDepthWarmup(schedule={0: 1, 3: 2})], max_steps=3)
    assert warmed.mtp_active_depth == 1  # the warmup continues: step 2 is still at depth 1


def test_heads_of_another_architecture_are_not_loaded_where_their_names_agree(tmp_path):
    """Cascaded modules' block weights share names with parallel heads' but read other inputs: loaded into them,
    the report said only eh_proj / norms were dropped."""
    _, path = fit_and_save(tmp_path, depth=2)
    fresh = CausalLM(ModelConfig(**MODEL), MTPConfig(depth=2, architecture="parallel"))
    fresh.configure_model()
    before = {k: v.clone() for k, v in fresh.state_dict().items() if k.startswith("mtp_")}
    with pytest.warns(UserWarning, match="none of its MTP weights is loaded"):
        report = load_weights(fresh, str(path))
    assert set(report.new) == set(before) and all(k.startswith("mtp_") for k in report.dropped)
    for key, value in before.items():
        assert torch.equal(fresh.state_dict()[key], value), key
    saved = torch.load(path, weights_only=True)["state_dict"]
    assert torch.equal(fresh.embed.weight, saved["embed.weight"])  # the trunk still loads
    with pytest.warns(UserWarning, match="none of its MTP weights is loaded"):  # (load_state_dict: missing keys)
        loaded = CausalLM.load_from_checkpoint(path, weights_only=True, mtp=MTPConfig(depth=2, architecture="parallel"))
    assert torch.equal(loaded.embed.weight, saved["embed.weight"])


def test_a_weight_schedule_resumed_with_a_moved_milestone_keeps_counting_the_fits_tokens(tmp_path):
    """Its state is stored under its arguments: with a milestone moved, the tokens seen restarted at 0 (λ held 0.3
    past the new milestone, the distant ramp started over)."""
    from lightning_mtp.callbacks import MTPWeightSchedule

    def schedule(milestone):
        return MTPWeightSchedule(schedule="step", milestones={0: 0.3, milestone: 0.1}, unit="tokens")

    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**MODEL), MTPConfig(depth=2), warmup_steps=0)
    data = torch.utils.data.DataLoader(torch.randint(0, 61, (8, 12)), batch_size=4)
    first = schedule(1000)
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=tmp_path, accelerator="cpu", callbacks=[first])
    trainer.fit(model, data)
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    assert first.tokens_seen == 96  # 2 batches of 4 x 12

    moved = schedule(50)  # passed (96 tokens): λ 0.1 from the first resumed step
    resumed = CausalLM(ModelConfig(**MODEL), MTPConfig(depth=2), warmup_steps=0)
    with pytest.warns(UserWarning, match="other arguments than the checkpoint's fit.*96 tokens"):
        resume(tmp_path, tmp_path / "model.ckpt", resumed, [moved], max_steps=3)
    assert moved.tokens_seen == 96 + 48 and moved.current_loss_weight == 0.1
