"""Native MTP layers (``MTPConfig.layout="native"``, issue #14) through training: a ``transformers`` folder imported,
fine-tuned with Lightning (the whole model, the MTP layers alone, under DeepSpeed, with every callback) and exported
again, checked with ``transformers``' ``generate(use_mtp=True)``; checkpoints of the other layout refused. The
layout's semantics, import, export and our decoding are checked in ``test_native_mtp``, whose helpers this uses.
"""

from __future__ import annotations

import json
import os

import lightning as L
import pytest
import torch

pytest.importorskip("transformers", reason="native MTP layers need the optional transformers dependency")

from safetensors import safe_open  # noqa: E402
from test_native_mtp import (  # noqa: E402
    FAMILIES,
    VOCAB,
    cyclic_batch,
    family_config,
    loaded_with_mtp,
    native_model,
    write_transformers_folder,
)

from lightning_mtp import MTPConfig  # noqa: E402
from lightning_mtp.cli import main as cli_main  # noqa: E402
from lightning_mtp.decoding import generate  # noqa: E402
from lightning_mtp.models import HFCausalLM  # noqa: E402


# ----------------------------------------------------------------------------------------------- 5. round trip
def test_round_trip_import_fine_tune_export(tmp_path):
    """A transformers folder -> import -> Trainer.fit a few steps -> export (and the CLI's export of the Lightning
    checkpoint) -> transformers loads the fine-tuned layers and use_mtp decodes like plain greedy."""
    source, exported, from_cli = tmp_path / "source", tmp_path / "exported", tmp_path / "from_cli"
    _, reference = write_transformers_folder(source, "glm4_moe", layers=2, seed=4)
    model = HFCausalLM(pretrained=str(source), mtp=MTPConfig(depth=2), learning_rate=1e-2, warmup_steps=1)
    assert model.mtp_native_report is None  # imported when the modules are built (configure_model)
    model.configure_model()
    before = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("mtp_modules.")}
    data = torch.utils.data.DataLoader(cyclic_batch(16, 24, torch.Generator().manual_seed(2)), batch_size=4)
    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(model, data)
    assert sorted(model.mtp_native_report.loaded) == [1, 2]
    tuned = {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("mtp_modules.")}
    assert not torch.equal(tuned["mtp_modules.1.eh_proj.weight"], before["mtp_modules.1.eh_proj.weight"])
    torch.testing.assert_close(before["mtp_modules.0.eh_proj.weight"], reference.layers[0].eh_proj.weight)
    model.eval()
    model.save_pretrained(str(exported))
    again = HFCausalLM(pretrained=str(exported), mtp=MTPConfig(depth=2))
    again.configure_model()
    for key, tensor in again.state_dict().items():
        if key.startswith("mtp_modules."):
            torch.testing.assert_close(tensor, tuned[key], atol=0, rtol=0)
    loaded = loaded_with_mtp(exported)
    trunk_state = model.trunk.state_dict()
    for key, tensor in loaded.state_dict().items():  # the fine-tuned trunk too
        torch.testing.assert_close(tensor, trunk_state[key], atol=0, rtol=0)
    prompt = torch.tensor([[3, 9, 15, 21]])
    plain = loaded.generate(prompt, do_sample=False, max_new_tokens=10)
    assert torch.equal(loaded.generate(prompt, do_sample=False, max_new_tokens=10, use_mtp=True), plain)
    assert torch.equal(generate(model, prompt, 10, speculative=False).sequences, plain)
    checkpoint = tmp_path / "last.ckpt"
    trainer.save_checkpoint(checkpoint)
    cli_main(["export", "--ckpt_path", str(checkpoint), "--out", str(from_cli)])
    with safe_open(str(exported / "model.safetensors"), framework="pt") as a, \
            safe_open(str(from_cli / "model.safetensors"), framework="pt") as b:
        assert set(a.keys()) == set(b.keys())
        for key in a.keys():
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key


def lightning_layout_checkpoint(tmp_path) -> None:
    """``tmp_path / "lightning.ckpt"``: a Lightning checkpoint of a glm4_moe host with lightning-layout MTP modules."""
    model = HFCausalLM("glm4_moe", family_config("glm4_moe", 1), mtp=MTPConfig(layout="lightning"))
    model.configure_model()
    trainer = L.Trainer(max_steps=0, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.strategy.connect(model)
    trainer.save_checkpoint(tmp_path / "lightning.ckpt")


def test_cli_export_refuses_a_lightning_layout_checkpoint(tmp_path, capsys):
    lightning_layout_checkpoint(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["export", "--ckpt_path", str(tmp_path / "lightning.ckpt"), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "layout='lightning'" in err and "Traceback" not in err


def test_a_checkpoint_of_another_layout_is_refused(tmp_path):
    lightning_layout_checkpoint(tmp_path)
    assert HFCausalLM.load_from_checkpoint(tmp_path / "lightning.ckpt", weights_only=True).mtp_config.layout == \
        "lightning"
    with pytest.raises(ValueError, match="layout 'lightning', but this model's are 'native'.*--model.mtp.layout"):
        HFCausalLM.load_from_checkpoint(tmp_path / "lightning.ckpt", weights_only=True, mtp=MTPConfig(depth=1))
    # written before layouts existed: no layout recorded, lightning modules
    checkpoint = torch.load(tmp_path / "lightning.ckpt", weights_only=True)
    for config in (checkpoint["hyper_parameters"]["mtp"], checkpoint["mtp"]["config"]):
        config.pop("layout")
    torch.save(checkpoint, tmp_path / "old.ckpt")
    with pytest.raises(ValueError, match="layout 'lightning'"):
        HFCausalLM.load_from_checkpoint(tmp_path / "old.ckpt", weights_only=True)


def test_cli_fit_then_export_a_native_glm4_moe(tmp_path):
    """``lightning-mtp fit`` with a glm4_moe trunk (native layout by default), then ``lightning-mtp export``: the
    folder decodes with ``generate(use_mtp=True)`` like plain greedy."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + 1\n" * 40)
    tiny = dict(vocab_size=258, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                max_position_embeddings=128)
    overrides = [arg for key, value in tiny.items() for arg in (f"--model.init_args.config.{key}", str(value))]
    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "hf_llama.yaml")
    cli_main(["fit", "--config", config, "--model.init_args.model_type", "glm4_moe", *overrides,
              "--trainer.accelerator", "cpu", "--trainer.max_steps", "2", "--trainer.logger", "false",
              "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "1",
              "--trainer.val_check_interval", "2", "--trainer.default_root_dir", str(tmp_path),
              "--data.init_args.tokenizer", "byte", "--data.init_args.corpus", str(corpus),
              "--data.init_args.seq_len", "16", "--data.init_args.batch_size", "4",
              "--data.init_args.val_fraction", "0.3", "--data.init_args.cache_dir", str(tmp_path / "cache")])
    checkpoints = sorted((tmp_path / "checkpoints").glob("*.ckpt"))
    assert checkpoints
    hparams = torch.load(checkpoints[-1], weights_only=True)["hyper_parameters"]
    assert hparams["mtp"]["layout"] == "native" and hparams["mtp"]["depth"] == 2
    cli_main(["export", "--ckpt_path", str(checkpoints[-1]), "--out", str(tmp_path / "exported")])
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["num_nextn_predict_layers"] == 2
    loaded = loaded_with_mtp(tmp_path / "exported")
    prompt = torch.tensor([[100, 101, 102, 32]])
    plain = loaded.generate(prompt, do_sample=False, max_new_tokens=6)
    assert torch.equal(loaded.generate(prompt, do_sample=False, max_new_tokens=6, use_mtp=True), plain)


def test_heads_only_fine_tune_of_a_frozen_trunk_exports_from_its_checkpoint(tmp_path):
    """Retrofit on a native folder: freeze_trunk fine-tunes the imported layers, the checkpoint holds the heads only,
    and ``lightning-mtp export`` rebuilds the trunk from the folder and writes the tuned layers."""
    write_transformers_folder(tmp_path / "source", "deepseek_v3", layers=1)
    model = HFCausalLM(pretrained=str(tmp_path / "source"), mtp=MTPConfig(depth=1), freeze_trunk=True,
                       learning_rate=1e-2, warmup_steps=1)
    data = torch.utils.data.DataLoader(cyclic_batch(8, 24, torch.Generator().manual_seed(2)), batch_size=4)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(model, data)
    trainer.save_checkpoint(tmp_path / "heads.ckpt")
    assert torch.load(tmp_path / "heads.ckpt", weights_only=True)["mtp_heads_only"]
    cli_main(["export", "--ckpt_path", str(tmp_path / "heads.ckpt"), "--out", str(tmp_path / "out")])
    again = HFCausalLM(pretrained=str(tmp_path / "out"), mtp=MTPConfig(depth=1))
    again.configure_model()
    for key, tensor in model.mtp_modules.state_dict().items():
        torch.testing.assert_close(again.mtp_modules.state_dict()[key], tensor, atol=0, rtol=0)
    loaded = loaded_with_mtp(tmp_path / "out")
    prompt = torch.tensor([[1, 2, 3, 4]])
    plain = loaded.generate(prompt, do_sample=False, max_new_tokens=6)
    assert torch.equal(loaded.generate(prompt, do_sample=False, max_new_tokens=6, use_mtp=True), plain)


@pytest.mark.parametrize("stage", [2, 3])
def test_native_layers_fine_tune_under_deepspeed_with_callbacks(tmp_path, stage):
    """One CPU process (gloo) under ZeRO-2/3, with depth warmup and the weight schedule: both native depths train
    (depth 2 once warmed up), and ZeRO-2's module exports a folder with the MTP layers."""
    pytest.importorskip("deepspeed")
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("native_deepspeed_script.py")
    env = {**os.environ, "PYTHONPATH": str(script.parents[1]), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29650 + stage), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0"}
    proc = subprocess.run([sys.executable, str(script), str(stage), str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and (tmp_path / "result.json").is_file(), proc.stderr[-6000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["changed"] == ["0", "1"] and result["active_depth"] == 2 and result["loss"] == result["loss"]
    if stage == 2:
        with safe_open(str(tmp_path / "exported" / "model.safetensors"), framework="pt") as handle:
            assert {"model.layers.2.eh_proj.weight", "model.layers.3.eh_proj.weight"} <= set(handle.keys())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_native_layers_fit_with_every_callback(tmp_path, family):
    """The five callbacks of configs/mtp.yaml (depth warmup, weight schedule, diversity, coupling monitor, draft
    calibration) run on native layers through training and validation, and the fitted temperatures are set."""
    from torch.utils.data import DataLoader

    from lightning_mtp.callbacks import (
        MTPCouplingMonitor,
        MTPDepthWarmup,
        MTPDiversityRegularizer,
        MTPDraftCalibration,
        MTPWeightSchedule,
    )

    model = native_model(family, 2)
    data = torch.randint(0, VOCAB, (8, 24), generator=torch.Generator().manual_seed(0))
    callbacks = [MTPDepthWarmup(schedule={0: 1, 1: 2}), MTPWeightSchedule(milestones={0: 0.3, 2: 0.1}),
                 MTPDiversityRegularizer(weight=0.02), MTPCouplingMonitor(), MTPDraftCalibration()]
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                        val_check_interval=3, check_val_every_n_epoch=None, limit_val_batches=1,
                        num_sanity_val_steps=0, callbacks=callbacks)
    trainer.fit(model, DataLoader(data, batch_size=4), DataLoader(data[:4], batch_size=4))
    metrics = trainer.callback_metrics
    assert model.mtp_active_depth == 2 and torch.isfinite(metrics["train_loss"])
    assert "val/mtp/temperature_depth2" in metrics and len(model.mtp_draft_temperatures) == 2
    assert any(key.startswith("val/mtp/") and "coupling" in key for key in metrics), sorted(metrics)
