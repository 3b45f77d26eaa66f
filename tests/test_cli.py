"""Every file under configs/ parses with the real CLI, and bad data/model combinations fail before training."""

from __future__ import annotations

import re
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


def _refused(args, capsys) -> str:
    """Run the CLI, expect the one-line refusal (exit status 2), return it."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_data_vocabulary_larger_than_model_fails_naming_both_flags(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    err = _refused(_fit_args(tmp_path, "--data.init_args.tokenizer", "byte", "--model.init_args.model.vocab_size",
                             "200"), capsys)
    assert re.search(r"--data\.vocab_size.*--model\.vocab_size", err)


def test_sequence_shorter_than_depth_plus_two_fails_naming_flags(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    err = _refused(_fit_args(tmp_path, "--data.init_args.seq_len", "3", "--model.init_args.mtp.depth", "2"), capsys)
    assert re.search(r"--data\.seq_len=3.*--model\.mtp\.depth", err)


def test_missing_corpus_fails_before_training(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    err = _refused(_fit_args(tmp_path, "--data.init_args.corpus", str(tmp_path / "nope")), capsys)
    assert "--data.corpus" in err


def test_bad_depth_on_cli_fails_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    err = _refused(_fit_args(tmp_path, "--model.init_args.mtp.depth", "0"), capsys)
    last = err.strip().splitlines()[-1]
    assert last == "lightning-mtp: error: MTPConfig.depth (--model.mtp.depth) must be >= 1, got 0"
    assert len(err.strip().splitlines()) <= 3
