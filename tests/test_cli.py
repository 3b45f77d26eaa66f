"""Every file under configs/ parses with the real CLI, and bad data/model combinations fail before training.

Also: bundled configs by name, short class names, help for nested config fields, and the refused
``--optimizer`` / ``--lr_scheduler``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_mtp import cli_checkpoint as ckpt_rules
from lightning_mtp.cli import main
from lightning_mtp.cli_configs import bundled_configs, resolve_config_args

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted(REPO.joinpath("configs").glob("*.yaml"))


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
    assert re.search(r"--data\.vocab_size.*--model\.init_args\.model\.vocab_size", err)


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


def _printed(args, capsys) -> str:
    """Run the CLI up to a ``--print_config`` or ``--*.help`` exit (status 0), return what it printed."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    assert exit_info.value.code in (0, None), captured.err
    return captured.out


# ----------------------------------------------------------------- bundled configs by name
def test_bundled_configs_are_the_repository_configs():
    assert {name: Path(str(path)) for name, path in bundled_configs().items()} == {p.stem: p for p in CONFIGS}


@pytest.mark.parametrize("args", [["fit", "--config", "quickstart"], ["predict", "--config=predict.yaml"],
                                  ["fit", "--config", "configs/quickstart.yaml"]],
                         ids=["bare-name", "equals-and-suffix", "the-docs-path-from-another-folder"])
def test_bare_config_name_resolves_to_the_bundled_config(args, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no configs/ here: the name must come from the package
    printed = _printed([*args, "--print_config"], capsys)
    assert "class_path: lightning_mtp.models.CausalLM" in printed
    assert ("default_root_dir: outputs/quickstart" in printed) == (args[0] == "fit")


def test_a_file_of_that_name_wins_over_the_bundled_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    text = (REPO / "configs" / "quickstart.yaml").read_text()
    local = re.sub(r"max_steps: \d+", "max_steps: 7", text)
    assert local != text
    (tmp_path / "quickstart.yaml").write_text(local)
    assert "max_steps: 7" in _printed(["fit", "--config", "quickstart.yaml", "--print_config"], capsys)


def test_unknown_config_name_is_refused_naming_the_bundled_configs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    err = _refused(["fit", "--config", "quickstrat"], capsys)
    assert "--config quickstrat: no such file" in err
    assert all(config.stem in err for config in CONFIGS)


def test_checkpoint_rules_read_the_resolved_config_file():
    args = resolve_config_args(["fit", "--config", "quickstart", "--model.init_args.mtp.depth", "3"])
    assert ckpt_rules.config_files(args) == [str(REPO / "configs" / "quickstart.yaml")]
    given = ckpt_rules.given_keys(args, ckpt_rules.config_files(args))
    assert {"model.mtp.depth", "model.model.dim", "data.vocab_size"} <= given


# ----------------------------------------------------------------- short class names and help
@pytest.mark.parametrize("subcommand", ["fit", "predict"])
@pytest.mark.parametrize("model", ["CausalLM", "HFCausalLM"])
def test_model_help_by_short_name_shows_the_nested_config_fields(subcommand, model, capsys):
    printed = " ".join(_printed([subcommand, "--model.help", model], capsys).split())  # the help wraps long lines
    assert f"Help for --model.help=lightning_mtp.models.{model}" in printed
    assert "--model.learning_rate" in printed and "AdamW peak learning rate" in printed
    # MTPConfig and GenerationConfig fields, with their docstrings
    assert "--model.mtp.depth" in printed and "how many extra future tokens are predicted" in printed
    assert "--model.generation.max_new_tokens" in printed and "Tokens to generate after each prompt" in printed


@pytest.mark.parametrize(
    "flag, name",
    [("--data.help", "TextDataModule"), ("--trainer.callbacks.help", "MTPDepthWarmup"),
     ("--trainer.callbacks.help", "MTPWeightSchedule"), ("--trainer.callbacks.help", "MTPDiversityRegularizer"),
     ("--trainer.callbacks.help", "MTPCouplingMonitor"), ("--trainer.callbacks.help", "MTPDraftCalibration"),
     ("--trainer.callbacks.help", "PredictionWriter")],
)
def test_help_by_short_name_of_our_classes(flag, name, capsys):
    printed = " ".join(_printed(["fit", flag, name], capsys).split())  # the help wraps long lines
    assert re.search(rf"Help for {re.escape(flag)}=lightning_mtp\.[\w.]+\.{name}\b", printed)


def test_short_class_names_in_a_config_resolve(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "short.yaml").write_text(
        "model: {class_path: CausalLM, init_args: {mtp: {depth: 2}}}\n"
        "data: {class_path: TextDataModule}\n"
        "trainer:\n  callbacks:\n"
        "    - {class_path: MTPDepthWarmup, init_args: {schedule: {0: 1, 10: 2}}}\n"
        "    - {class_path: MTPCouplingMonitor}\n"
    )
    printed = _printed(["fit", "--config", "short.yaml", "--print_config"], capsys)
    for path in ("lightning_mtp.models.CausalLM", "lightning_mtp.data.TextDataModule",
                 "lightning_mtp.callbacks.MTPDepthWarmup", "lightning_mtp.callbacks.MTPCouplingMonitor"):
        assert f"class_path: {path}" in printed


# ----------------------------------------------------------------- optimizer flags
@pytest.mark.parametrize(
    "extra",
    [["--optimizer", "Adam"], ["--optimizer.lr=0.1"], ["--lr_scheduler", "StepLR"], ["--config", "optimizer.yaml"]],
    ids=["optimizer", "optimizer-arg", "lr_scheduler", "in-a-config"],
)
def test_optimizer_flags_are_refused_naming_the_model_settings(extra, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "optimizer.yaml").write_text("optimizer: {class_path: torch.optim.SGD, init_args: {lr: 0.1}}\n")
    err = _refused(["fit", "--config", "quickstart", *extra], capsys)
    assert len(err.strip().splitlines()) == 1
    assert re.search(r"--(optimizer|lr_scheduler) is not supported", err)
    for flag in ("--model.init_args.learning_rate", "--model.init_args.weight_decay", "--model.init_args.warmup_steps"):
        assert flag in err
