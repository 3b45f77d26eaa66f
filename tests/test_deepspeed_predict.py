"""Weights of DeepSpeed ZeRO-3 fits loaded under DeepSpeed: ``predict`` from the checkpoint folder and from its
converted fp32 file under ``CPUDeepSpeedStrategy(stage=3)``, a new fit's ``init_from`` into ZeRO-3 partitions, and
checkpoints whose shards, stage or world size do not fit the run, refused before any shard is opened.

The multi-process runs are ``tests/deepspeed_script.py`` subprocesses (2 CPU processes, gloo); ``lightning-mtp`` runs
through its ``cli`` mode, which Lightning launches again for rank 1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, cli_refusal, save_checkpoint, tiny_predict_args
from test_deepspeed_checkpoint_read import zero3_fit_args

from lightning_mtp.checkpoint_files import read_checkpoint, refuse_deepspeed_layout

pytest.importorskip("deepspeed")

SCRIPT = Path(__file__).with_name("deepspeed_script.py")
RUN_TIMEOUT_S = 240
STRATEGY = "lightning_mtp.strategies.CPUDeepSpeedStrategy"


def run_script(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    try:
        return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"run timed out after {RUN_TIMEOUT_S}s (a hang?)\n{(error.stderr or b'')[-8000:]}")


@pytest.fixture(scope="module")
def zero3_fit(tmp_path_factory) -> Path:
    """Workdir of a 2-step ZeRO-3 ``lightning-mtp fit`` on 2 processes; its folder is ``ckpt/last.ckpt``."""
    workdir = tmp_path_factory.mktemp("zero3x2")
    proc = run_script("cli", *zero3_fit_args(workdir, "--trainer.devices", "2"), cwd=workdir)
    assert proc.returncode == 0 and (workdir / "ckpt" / "last.ckpt").is_dir(), proc.stderr[-8000:]
    return workdir


@pytest.fixture(scope="module")
def converted(zero3_fit) -> Path:
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    target = zero3_fit / "model.ckpt"
    convert_zero_checkpoint_to_fp32_state_dict(str(zero3_fit / "ckpt" / "last.ckpt"), str(target))
    return target


def predict_args(workdir: Path, ckpt: Path, name: str, *extra: str) -> list[str]:
    """Greedy predict of 4 held-out prompts of the fit's corpus (its data cache), into ``workdir/<name>``."""
    return tiny_predict_args(workdir, ckpt, "--data.init_args.num_predict_prompts", "4",
                             "--trainer.callbacks.init_args.output_dir", str(workdir / name), *extra)


def generations(folder: Path) -> dict[int, list[int]]:
    """Prompt index -> new tokens, over every rank's ``generations*.jsonl``."""
    rows = {}
    for file in sorted(folder.glob("generations*.jsonl")):
        for line in file.read_text().splitlines():
            record = json.loads(line)
            rows[record["index"]] = record["tokens"]
    return rows


@pytest.fixture(scope="module")
def plain_generations(zero3_fit, converted) -> dict[int, list[int]]:
    """Predict from the converted file in this process, without DeepSpeed: the reference."""
    from lightning_mtp.cli import main

    main(predict_args(zero3_fit, converted, "plain"))
    rows = generations(zero3_fit / "plain")
    assert sorted(rows) == [0, 1, 2, 3] and all(rows.values())
    return rows


@pytest.mark.parametrize("source", ["folder", "converted"])
def test_predict_under_zero3_equals_plain_decoding(zero3_fit, converted, plain_generations, source):
    """Was AttributeError ('DeepSpeedZeRoOffload' object has no attribute '_restore_from_bit16_weights') from the
    folder, FileNotFoundError ('not a valid DeepSpeed checkpoint') from the converted file. The folder is read on 2
    ranks (its shards read whole, loaded into the partitions), the file on 1."""
    ckpt, devices = (zero3_fit / "ckpt" / "last.ckpt", "2") if source == "folder" else (converted, "1")
    proc = run_script("cli", *predict_args(zero3_fit, ckpt, source, "--trainer.devices", devices,
                                           "--trainer.strategy", STRATEGY, "--trainer.strategy.init_args.stage", "3"),
                      cwd=zero3_fit)
    assert proc.returncode == 0, proc.stderr[-8000:]
    assert generations(zero3_fit / source) == plain_generations


def test_init_from_loads_into_zero3_partitions(tmp_path):
    """Was ``MTP weight ... has shape (32, 64) in the checkpoint but (0,)``: a new ZeRO-3 fit on 2 processes starts
    from the checkpoint's weights (gathered before step 0, bit for bit) and its first loss is the plain model's."""
    sys.path.insert(0, str(SCRIPT.parent))
    from deepspeed_script import make_model

    from lightning_mtp.models import load_causal_lm

    torch.manual_seed(123)  # other weights than the fit's own initialisation (seed 0)
    source = make_model()
    source.configure_model()
    with torch.no_grad():
        for param in source.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    ckpt = save_checkpoint(source, tmp_path / "source.ckpt")
    proc = run_script("init_from", "3", str(tmp_path), ckpt, cwd=tmp_path)
    assert proc.returncode == 0 and (tmp_path / "init_from.pt").is_file(), proc.stderr[-8000:]
    record = torch.load(tmp_path / "init_from.pt", weights_only=True)
    expected = dict(source.named_parameters())
    assert set(record["weights"]) == set(expected)
    for name, value in record["weights"].items():
        torch.testing.assert_close(value, expected[name].detach(), rtol=0, atol=0, msg=name)
    plain = load_causal_lm(ckpt)
    with torch.no_grad():
        reference = plain.compute_lm_loss(record["batch"]).loss
    torch.testing.assert_close(record["loss"], reference, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ mismatched resumes
def test_a_missing_shard_is_refused_before_any_rank_reads(zero3_fit, tmp_path, capsys):
    """Was FileNotFoundError on rank 1 and gloo connection errors on rank 0."""
    broken = tmp_path / "broken.ckpt"
    shutil.copytree(zero3_fit / "ckpt" / "last.ckpt", broken)
    (broken / "checkpoint" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(ValueError, match=r"is incomplete: its DeepSpeed ZeRO-3 fit ran on 2 processes, but "
                                         r"checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt is missing"):
        read_checkpoint(broken)
    err = cli_refusal(zero3_fit_args(tmp_path, "--trainer.devices", "2", "--ckpt_path", str(broken)), capsys)
    assert "--ckpt_path" in err and "incomplete" in err


def test_resuming_on_another_world_size_or_stage_is_refused(zero3_fit):
    folder = zero3_fit / "ckpt" / "last.ckpt"
    refuse_deepspeed_layout(folder, stage=3, world_size=2, fitting=True)  # the same run: fine
    refuse_deepspeed_layout(folder, stage=2, world_size=1, fitting=False)  # predict reads the shards whole: fine
    with pytest.raises(ValueError, match=r"--ckpt_path .* on 2 processes, but this fit runs on 1.*--trainer.devices 2"):
        refuse_deepspeed_layout(folder, stage=3, world_size=1, fitting=True)
    with pytest.raises(ValueError, match=r"ZeRO stage 3 checkpoint, but this fit runs ZeRO stage 2.*"
                                         r"--trainer.strategy.init_args.stage 3"):
        refuse_deepspeed_layout(folder, stage=2, world_size=2, fitting=True)


def fake_zero2_folder(folder: Path, world: int, shards: int) -> Path:
    """The files of a ZeRO-2 checkpoint folder (the module states' DeepSpeed record, ``shards`` optimizer files)."""
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "latest").write_text("checkpoint")
    record = {"ds_config": {"zero_optimization": {"stage": 2}}, "dp_world_size": world, "mp_world_size": 1,
              "global_step": 3}
    torch.save(record, folder / "checkpoint" / "mp_rank_00_model_states.pt")
    for rank in range(shards):
        torch.save({}, folder / "checkpoint" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return folder


def test_zero2_folders_are_checked_alike(tmp_path):
    whole = fake_zero2_folder(tmp_path / "whole", world=2, shards=2)
    assert read_checkpoint(whole)["global_step"] == 3
    refuse_deepspeed_layout(whole, stage=1, world_size=2, fitting=True)  # ZeRO-1 and 2 write the same files
    with pytest.raises(ValueError, match=r"ZeRO stage 2 checkpoint, but this fit runs ZeRO stage 3.*"
                                         r"--trainer.strategy.init_args.stage 2"):
        refuse_deepspeed_layout(whole, stage=3, world_size=2, fitting=True)
    with pytest.raises(ValueError, match=r"on 2 processes, but this fit runs on 4.*--trainer.devices 2"):
        refuse_deepspeed_layout(whole, stage=2, world_size=4, fitting=True)
    with pytest.raises(ValueError, match=r"zero_pp_rank_1_mp_rank_00_optim_states.pt is missing"):
        read_checkpoint(fake_zero2_folder(tmp_path / "part", world=2, shards=1))


@pytest.mark.parametrize(("case", "flags", "expected"), [
    ("devices", ["--trainer.devices", "1"], r"on 2 processes, but this fit runs on 1: .*--trainer.devices 2"),
    ("stage", ["--trainer.devices", "2", "--trainer.strategy.init_args.stage", "2"],
     r"ZeRO stage 3 checkpoint, but this fit runs ZeRO stage 2.*--trainer.strategy.init_args.stage 3"),
    ("file", ["--trainer.devices", "1"], r"is a single checkpoint file, but a DeepSpeed fit resumes from the "
                                         r"checkpoint folder it wrote.*--model.init_args.init_from"),
], ids=["devices", "stage", "file"])
def test_a_resume_that_cannot_load_is_refused_on_every_rank(zero3_fit, converted, tmp_path, case, flags, expected):
    """Were ZeRORuntimeException ('DP world size'), a bare AssertionError on every rank, and FileNotFoundError ('not
    a valid DeepSpeed checkpoint'): now one line and exit status 2 from each rank, before a shard is opened."""
    import re

    ckpt = converted if case == "file" else zero3_fit / "ckpt" / "last.ckpt"
    proc = run_script("cli", *zero3_fit_args(tmp_path, "--trainer.max_steps", "4", "--ckpt_path", str(ckpt), *flags),
                      cwd=tmp_path)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lightning-mtp: error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-8000:]
    assert len(errors) == int(flags[1]) and all(re.search(expected, line) for line in errors), errors
