"""What ``lightning-mtp`` takes from a checkpoint and what it refuses (``lightning_mtp.cli_checkpoint``).

One tiny BPE model is fitted through the real CLI (module fixture); every test then drives the real CLI against its
checkpoint: the tokenizer travels with the checkpoint, given flags that contradict it are refused, ``last.ckpt`` is the
newest run's.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import cli_refusal, tiny_fit_args, tiny_predict_args

from lightning_mtp.cli import main
from lightning_mtp.cli_checkpoint import conflicts, flatten, given_keys, is_given


@pytest.fixture
def trained(tiny_checkpoint):
    return tiny_checkpoint


def _generations(workdir):
    lines = (workdir / "predictions" / "generations.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_checkpoint_carries_its_tokenizer_and_data_settings(trained):
    _, ckpt = trained
    checkpoint = torch.load(ckpt, weights_only=True)
    record = checkpoint["tokenizer"]
    assert record["kind"] == "bpe" and record["vocab_size"] == 300 and record["json"].startswith("{")
    assert record["data"]["max_bytes"] == 120000 and record["data"]["vocab_size"] == 300
    from lightning_mtp.data import tokenizer_from_spec

    assert tokenizer_from_spec(record).fingerprint == record["fingerprint"]


def test_predict_needs_no_data_flags_and_uses_the_checkpoints_tokenizer(trained, tmp_path):
    workdir, ckpt = trained
    main(tiny_predict_args(tmp_path, ckpt))
    records = _generations(tmp_path)
    assert len(records) == 2 and all(len(r["tokens"]) <= 6 for r in records)
    from lightning_mtp.data import tokenizer_from_spec

    tokenizer = tokenizer_from_spec(torch.load(ckpt, weights_only=True)["tokenizer"])
    assert [r["completion"] for r in records] == [tokenizer.decode(r["tokens"]) for r in records]


def test_predict_with_other_max_bytes_keeps_the_checkpoints_tokenizer(trained, tmp_path):
    """The same BPE vocabulary on other data would train other merges; the checkpoint's tokenizer is used instead
    (no tokenizer is trained, and the completions decode with the checkpoint's)."""
    _, ckpt = trained
    main(tiny_predict_args(tmp_path, ckpt, "--data.init_args.max_bytes", "60000"))
    from lightning_mtp.data import tokenizer_from_spec

    tokenizer = tokenizer_from_spec(torch.load(ckpt, weights_only=True)["tokenizer"])
    records = _generations(tmp_path)
    assert len(records) == 2
    assert [r["completion"] for r in records] == [tokenizer.decode(r["tokens"]) for r in records]
    assert not (tmp_path / "cache" / "tokenizers").exists()


@pytest.mark.parametrize("flags, named", [
    (("--data.init_args.tokenizer", "byte"), "--data.init_args.tokenizer"),
    (("--data.init_args.vocab_size", "400"), "--data.init_args.vocab_size"),
    (("--model.init_args.mtp.depth", "3"), "--model.init_args.mtp.depth"),
    (("--model.mtp.architecture", "parallel"), "--model.init_args.mtp.architecture"),
    (("--model.init_args.model.dim", "64"), "--model.init_args.model.dim"),
])
def test_predict_refuses_flags_that_contradict_the_checkpoint(trained, tmp_path, capsys, flags, named):
    _, ckpt = trained
    err = cli_refusal(tiny_predict_args(tmp_path, ckpt, *flags), capsys)
    assert named in err and "the checkpoint has" in err


def test_predict_refuses_a_depth_flag_equal_to_the_default(trained, tmp_path, capsys):
    """depth 1 is MTPConfig's default: given explicitly against a depth-2 checkpoint it is still a conflict."""
    _, ckpt = trained
    err = cli_refusal(tiny_predict_args(tmp_path, ckpt, "--model.init_args.mtp.depth", "1"), capsys)
    assert "--model.init_args.mtp.depth is 1, but the checkpoint has 2" in err


def test_predict_without_weights_is_refused_unless_asked_for(tmp_path, capsys):
    args = tiny_predict_args(tmp_path, "x")
    at = args.index("--ckpt_path")
    del args[at:at + 2]
    err = cli_refusal(args, capsys)
    assert "--ckpt_path" in err and "--random_weights true" in err
    args += ["--random_weights", "true", "--data.init_args.tokenizer", "byte", "--data.init_args.max_bytes", "60000",
             "--data.init_args.seq_len", "32", "--model.init_args.model.vocab_size", "258",
             "--model.init_args.model.dim", "32", "--model.init_args.model.n_layers", "1"]
    main(args)
    assert len(_generations(tmp_path)) == 2


def test_resume_refuses_another_depth_and_points_to_init_from(trained, tmp_path, capsys):
    _, ckpt = trained
    err = cli_refusal(tiny_fit_args(tmp_path, "--ckpt_path", str(ckpt), "--trainer.max_steps", "5",
                                    "--model.init_args.mtp.depth", "3"), capsys)
    assert "--model.init_args.mtp.depth is 3, but the checkpoint has 2" in err and "init_from" in err


def test_resume_refuses_other_data(trained, tmp_path, capsys):
    _, ckpt = trained
    err = cli_refusal(tiny_fit_args(tmp_path, "--ckpt_path", str(ckpt), "--trainer.max_steps", "5",
                                    "--model.init_args.mtp.depth", "2", "--data.init_args.max_bytes", "60000"), capsys)
    assert "--data.init_args.max_bytes is 60000, but the checkpoint has 120000" in err
    # the advice is about the data: the tokenizer's (the first words, before) confused a seed or seq_len change
    assert "keeps the data settings it was trained with" in err and "trained with the tokenizer" not in err


def test_resume_continues_with_the_checkpoints_depth(trained, tmp_path):
    workdir, ckpt = trained
    main(tiny_fit_args(tmp_path, "--ckpt_path", str(ckpt), "--trainer.max_steps", "4", "--model.init_args.mtp.depth",
                       "2"))
    resumed = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == 4 and resumed["mtp"]["depth"] == 2


def test_init_from_refuses_another_tokenizer(trained, tmp_path, capsys):
    _, ckpt = trained
    err = cli_refusal(tiny_fit_args(tmp_path, "--model.init_args.init_from", str(ckpt),
                                    "--data.init_args.tokenizer", "byte"), capsys)
    assert "--data.init_args.tokenizer" in err and "init_from" in err


def test_a_later_config_files_null_unsets_what_an_earlier_one_set(tmp_path):
    # `--config deepspeed_zero3 --config finetune`: finetune's `tokenizer: null` undoes zero3's `tokenizer: bpe`, so
    # a resume takes the checkpoint's tokenizer instead of refusing a tokenizer nobody gave
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text("data:\n  init_args:\n    tokenizer: bpe\n    seq_len: 8\n")
    second.write_text("data:\n  init_args:\n    tokenizer: null\n")
    given = given_keys(["--config", str(first), "--config", str(second)], [str(first), str(second)])
    assert "data.tokenizer" not in given and "data.seq_len" in given
    later = given_keys(["--config", str(second), "--config", str(first)], [str(second), str(first)])
    assert "data.tokenizer" in later
    flagged = given_keys(["--config", str(second), "--data.init_args.tokenizer", "null"], [str(second)])
    assert "data.tokenizer" in flagged


def test_given_keys_reads_flags_and_config_files(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  class_path: X\n  init_args:\n    mtp:\n      depth: 2\ndata:\n  init_args:\n"
                      "    seq_len: 8\n")
    given = given_keys(["--config", str(config), "--model.init_args.model.dim=64"], [str(config)])
    assert {"model.class_path", "model.mtp.depth", "data.seq_len", "model.model.dim"} <= given
    assert is_given("model.mtp.depth", {"model.mtp"}) and not is_given("model.mtp.depth", {"model"})
    saved = flatten({"mtp": {"depth": 2, "architecture": "cascaded"}}, "model")
    assert conflicts(saved, {"model.mtp.depth": 3, "model.mtp.architecture": "cascaded"}, given) == [
        ("model.mtp.depth", 3, 2)]
    assert conflicts(saved, {"model.mtp.depth": 3}, set()) == []


def test_validate_uses_the_checkpoints_tokenizer_and_split(trained, tmp_path, capsys):
    """``validate --ckpt_path`` on a fresh cache trains no tokenizer: it evaluates with the checkpoint's."""
    _, ckpt = trained
    args = tiny_fit_args(tmp_path, "--ckpt_path", str(ckpt), "--model.init_args.mtp.depth", "2")
    args[0] = "validate"
    main(args)
    assert "val/main/loss" in capsys.readouterr().out
    assert not (tmp_path / "cache" / "tokenizers").exists() and (tmp_path / "cache" / "tokens").exists()


@pytest.mark.parametrize("subcommand", ["validate", "test"])
def test_validate_and_test_need_only_the_checkpoint(tiny_checkpoint, tmp_path, capsys, subcommand):
    """README: `predict`, `validate`, `test` and `export` need only --ckpt_path (was: validate.model required)."""
    workdir, ckpt = tiny_checkpoint
    main([subcommand, "--ckpt_path", str(ckpt), "--trainer.limit_val_batches", "1", "--trainer.limit_test_batches",
          "1", "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu",
          "--data.init_args.cache_dir", str(workdir / "cache")])
    assert f"{'val' if subcommand == 'validate' else 'test'}/loss" in capsys.readouterr().out


def test_two_paths_to_the_same_folder_are_the_same_setting(tmp_path, monkeypatch):
    from lightning_mtp.cli_checkpoint import same

    (tmp_path / "model").mkdir()
    monkeypatch.chdir(tmp_path)
    assert same("model", str(tmp_path / "model")) and same("./model/", str(tmp_path / "model"))
    assert not same("model", str(tmp_path)) and not same("bpe", "byte")


def test_ckpt_path_last_resumes_the_checkpoint_callbacks_last_file(tmp_path, capsys):
    """``--ckpt_path last`` (Lightning's word) is the config's checkpoint folder's last.ckpt; before there is one, a
    fit starts anew (one command for a job a scheduler requeues) and predict is refused."""
    from conftest import tiny_fit_args

    from lightning_mtp.cli import main

    main(tiny_fit_args(tmp_path, "--ckpt_path", "last"))
    assert "a new fit starts" in capsys.readouterr().err
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 3
    main(tiny_fit_args(tmp_path, "--trainer.max_steps", "5", "--ckpt_path", "last"))
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 5


def test_ckpt_path_last_takes_the_newest_last_file_beside_a_version_counters(tmp_path):
    """With enable_version_counter a second fit writes last-v1.ckpt beside the first's last.ckpt; `last` resumed the
    first fit's file (Lightning's own "last" takes the newest)."""
    import time

    from conftest import tiny_fit_args

    from lightning_mtp.cli import main

    counter = ("--trainer.callbacks.init_args.enable_version_counter", "true")
    main(tiny_fit_args(tmp_path, *counter))  # 3 steps: last.ckpt
    time.sleep(0.05)
    main(tiny_fit_args(tmp_path, *counter, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2"))
    folder = tmp_path / "ckpt"
    assert torch.load(folder / "last-v1.ckpt", weights_only=True)["global_step"] == 2
    main(tiny_fit_args(tmp_path, *counter, "--trainer.max_steps", "4", "--ckpt_path", "last"))
    newest = max(folder.glob("last*.ckpt"), key=lambda p: p.stat().st_mtime)
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 3  # the first fit's, untouched
    checkpoint = torch.load(newest, weights_only=True)
    assert checkpoint["global_step"] == 4 and checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"][
        "completed"] == 4  # two more steps on the second fit's two


def test_a_new_fit_into_a_folder_holding_an_earlier_fits_last_ckpt_is_refused(tmp_path, capsys):
    """Rerunning a stopped fit's command without ``--ckpt_path`` would replace its ``last.ckpt`` at the first save:
    refused before the fit starts; the file is untouched (a ``Trainer`` of one's own: test_safe_checkpoint)."""
    from conftest import tiny_fit_args

    from lightning_mtp.cli import main

    main(tiny_fit_args(tmp_path))
    last = tmp_path / "ckpt" / "last.ckpt"
    before = last.read_bytes()
    with pytest.raises(SystemExit) as refused:
        main(tiny_fit_args(tmp_path, "--trainer.max_steps", "1", "--trainer.val_check_interval", "1"))
    assert refused.value.code == 2
    message = capsys.readouterr().err
    assert "earlier fit" in message and "--ckpt_path last" in message and "dirpath" in message
    assert last.read_bytes() == before
