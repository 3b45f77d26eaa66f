"""Every file under configs/ parses with the real CLI, and bad data/model combinations fail before training."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_mtp.cli import main

CONFIGS = sorted(Path(__file__).resolve().parents[1].joinpath("configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses(config, capsys):
    subcommand = "predict" if config.name.startswith("predict") else "fit"
    with pytest.raises(SystemExit) as exit_info:
        main([subcommand, "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "class_path" in printed and "trainer" in printed


def _fit_args(tmp_path, *extra):
    return [
        "fit", "--config", "configs/quickstart.yaml",
        "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--trainer.logger", "false",
        "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]", "--trainer.default_root_dir",
        str(tmp_path), "--data.init_args.max_bytes", "300000", "--data.init_args.cache_dir", str(tmp_path / "cache"),
        "--data.init_args.seq_len", "32", "--data.init_args.batch_size", "2", *extra,
    ]


def test_data_vocabulary_larger_than_model_fails_naming_both_flags(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    with pytest.raises(ValueError, match=r"--data\.vocab_size.*--model\.vocab_size"):
        main(_fit_args(tmp_path, "--data.init_args.tokenizer", "byte", "--model.init_args.model.vocab_size", "200"))


def test_sequence_shorter_than_depth_plus_two_fails_naming_flags(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    with pytest.raises(ValueError, match=r"--data\.seq_len=3.*--model\.mtp\.depth"):
        main(_fit_args(tmp_path, "--data.init_args.seq_len", "3", "--model.init_args.mtp.depth", "2"))


def test_missing_corpus_fails_before_training(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    with pytest.raises((ValueError, SystemExit)) as info:
        main(_fit_args(tmp_path, "--data.init_args.corpus", str(tmp_path / "nope")))
    assert "--data.corpus" in str(info.value) or isinstance(info.value, SystemExit)


def test_bad_depth_on_cli_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    with pytest.raises((ValueError, SystemExit)):
        main(_fit_args(tmp_path, "--model.init_args.mtp.depth", "0"))
