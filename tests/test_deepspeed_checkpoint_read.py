"""Reading a DeepSpeed ZeRO-3 checkpoint folder: ``lightning-mtp fit`` on 1 CPU process writes it (ZeRO-3 names
its module states ``zero_pp_rank_0_mp_rank_00_model_states.pt``, ZeRO-1/2 ``mp_rank_00_model_states.pt``), then the
CLI resumes from it, ``read_checkpoint`` reads its metadata, and a truncated shard is refused up front."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, cli_refusal, tiny_fit_args

from lightning_mtp.checkpoint_files import read_checkpoint

pytest.importorskip("deepspeed")

RUN_TIMEOUT_S = 240
ZERO3 = json.dumps({"class_path": "lightning_mtp.strategies.CPUDeepSpeedStrategy", "init_args": {"stage": 3}})


def zero3_fit_args(workdir: Path, *extra: str) -> list[str]:
    """The tiny fit (byte tokenizer, 1 layer, width 32, depth 2) under ZeRO-3 on 1 CPU process."""
    return tiny_fit_args(workdir, "--trainer.strategy", ZERO3, "--trainer.precision", "32-true",
                         "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
                         "--data.init_args.tokenizer", "byte", "--model.init_args.model.vocab_size", "258",
                         "--model.init_args.mtp.depth", "2", *extra)


def run_cli(args: list[str]) -> subprocess.CompletedProcess:
    """``lightning-mtp`` in a subprocess (DeepSpeed sets up its own process group), with plain gloo collectives:
    DeepSpeed's CPU accelerator would otherwise compile a shared-memory all-reduce on first use."""
    code = ("import deepspeed.comm.torch as t; t.build_shm_op = lambda: None; from lightning_mtp.cli import main; "
            f"main({args!r})")
    env = {**os.environ, "PYTHONPATH": REPO, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def zero3_folder(tmp_path_factory) -> Path:
    """The ``last.ckpt`` folder of a 2-step ZeRO-3 ``lightning-mtp fit`` on 1 process."""
    workdir = tmp_path_factory.mktemp("zero3")
    proc = run_cli(zero3_fit_args(workdir))
    folder = workdir / "ckpt" / "last.ckpt"
    assert proc.returncode == 0 and folder.is_dir(), proc.stderr[-8000:]
    return folder


def test_zero3_folder_names_its_module_states_per_rank(zero3_folder):
    names = {p.name for p in (zero3_folder / "checkpoint").iterdir()}
    assert "zero_pp_rank_0_mp_rank_00_model_states.pt" in names
    assert "mp_rank_00_model_states.pt" not in names


def test_read_checkpoint_reads_the_zero3_metadata_without_placeholder_weights(zero3_folder):
    checkpoint = read_checkpoint(zero3_folder)
    assert checkpoint["global_step"] == 2
    assert checkpoint["mtp"]["depth"] == 2
    assert checkpoint["tokenizer"]["kind"] == "byte"
    assert checkpoint["hyper_parameters"]["model"]["vocab_size"] == 258
    # Rank 0's ``module`` holds empty partitions under ZeRO-3: never handed out as weights.
    assert "module" not in checkpoint and "state_dict" not in checkpoint


def test_a_zero3_fit_resumes_from_its_folder(zero3_folder, tmp_path):
    """The CLI reads the folder's metadata and Lightning's DeepSpeed strategy loads the shards: 2 more steps."""
    dirpath = tmp_path / "ckpt"
    proc = run_cli(zero3_fit_args(tmp_path, "--trainer.max_steps", "4", "--trainer.callbacks.init_args.dirpath",
                                  str(dirpath), "--ckpt_path", str(zero3_folder)))
    assert proc.returncode == 0, proc.stderr[-8000:]
    assert read_checkpoint(dirpath / "last.ckpt")["global_step"] == 4


def test_predict_without_deepspeed_is_told_how_to_convert_and_the_converted_file_reads(zero3_folder, tmp_path,
                                                                                         capsys):
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    from lightning_mtp.checkpoint_files import refuse_deepspeed_folder

    with pytest.raises(ValueError, match=r"DeepSpeed checkpoint folder.*convert_zero_checkpoint_to_fp32_state_dict"):
        refuse_deepspeed_folder(zero3_folder, "--ckpt_path", "predict")
    for command in (["predict", "--config", os.path.join(REPO, "configs", "predict.yaml")], ["export"]):
        extra = ["--out", str(tmp_path / "exported")] if command == ["export"] else []
        err = cli_refusal([*command, "--ckpt_path", str(zero3_folder), *extra], capsys)  # was IsADirectoryError
        assert "is a DeepSpeed checkpoint folder" in err and "convert_zero_checkpoint_to_fp32_state_dict" in err
    # a fit without DeepSpeed resuming it (IsADirectoryError before): resume under DeepSpeed, or convert and init_from
    err = cli_refusal(tiny_fit_args(tmp_path, "--ckpt_path", str(zero3_folder)), capsys)
    assert "is a DeepSpeed checkpoint folder" in err and "deepspeed_zero3" in err and "init_from" in err
    target = tmp_path / "model.ckpt"
    convert_zero_checkpoint_to_fp32_state_dict(str(zero3_folder), str(target))
    refuse_deepspeed_folder(target)  # a file: nothing to refuse
    checkpoint = read_checkpoint(target)
    state = checkpoint["state_dict"]
    assert {"embed.weight", "lm_head.weight"} <= set(state) and any(k.startswith("mtp_modules.1.") for k in state)
    assert all(value.numel() > 0 for value in state.values())
    assert checkpoint["global_step"] == 2 and checkpoint["tokenizer"]["kind"] == "byte"


def test_a_truncated_shard_is_refused_up_front(zero3_folder, tmp_path, capsys):
    broken = tmp_path / "broken.ckpt"
    shutil.copytree(zero3_folder, broken)
    shard = broken / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"cannot be read: its shard checkpoint/zero_pp_rank_0_mp_rank_00_optim"):
        read_checkpoint(broken)
    err = cli_refusal(zero3_fit_args(tmp_path, "--ckpt_path", str(broken)), capsys)
    assert "--ckpt_path" in err and "truncated" in err


def test_a_folder_that_is_no_checkpoint_is_still_refused_clearly(tmp_path):
    (tmp_path / "checkpoint").mkdir()
    with pytest.raises(ValueError, match="is a directory but not a DeepSpeed checkpoint.*nor a sharded FSDP2 one"):
        read_checkpoint(tmp_path)
    torch.save({"x": torch.zeros(1)}, tmp_path / "checkpoint" / "other.pt")
    with pytest.raises(ValueError, match="zero_pp_rank_0_mp_rank_00_model_states.pt"):
        read_checkpoint(tmp_path)


def test_init_from_a_deepspeed_folder_is_told_how_to_convert(zero3_folder, make_tiny_model):
    """Its module states hold no weights (ZeRO-3's are empty partitions): never loaded as if they were."""
    from lightning_mtp.checkpointing import load_weights

    with pytest.raises(ValueError, match=r"init_from .*DeepSpeed checkpoint folder.*for a new fit from its weights, "
                                         r"convert it"):
        load_weights(make_tiny_model(depth=2), str(zero3_folder))
