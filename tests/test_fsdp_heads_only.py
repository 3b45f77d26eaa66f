"""A frozen trunk's checkpoint (``--model.init_args.freeze_trunk true``: the MTP weights only) written under FSDP2
resumes under FSDP2: Lightning's FSDP2 load writes the weights into the shards strictly before any module hook could
fill in the trunk's keys (``FSDP2Strategy.load_checkpoint``, ``HFCausalLM.mtp_keys_not_saved``).

A real ``lightning-mtp fit --config finetune --config fsdp`` on 2 gloo processes, then the same command with
``--ckpt_path``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from conftest import REPO  # noqa: E402
from model_folders import chat_records, model_folder, write_jsonl  # noqa: E402


def test_a_frozen_trunk_checkpoint_written_under_fsdp2_resumes_under_fsdp2(tmp_path):
    folder = model_folder(tmp_path / "model")
    corpus = write_jsonl(tmp_path / "chat.jsonl", chat_records(40))
    args = ["fit", "--config", "finetune", "--config", "fsdp", "--trainer.devices", "2",
            "--model.init_args.pretrained", str(folder), "--model.init_args.freeze_trunk", "true",
            "--data.init_args.corpus", str(corpus), "--data.init_args.seq_len", "64",
            "--data.init_args.batch_size", "2", "--data.init_args.num_proc", "1",
            "--data.init_args.cache_dir", str(tmp_path / "cache"),
            "--trainer.val_check_interval", "1000", "--trainer.limit_val_batches", "1", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path),
            "--trainer.callbacks.init_args.dirpath", str(tmp_path / "ckpt"), "--model.init_args.warmup_steps", "1"]
    env = dict(os.environ, PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(name, None)
    last = tmp_path / "ckpt" / "last.ckpt"
    for steps, resume in ((2, []), (3, ["--ckpt_path", str(last)])):
        run = subprocess.run([sys.executable, "-m", "lightning_mtp.cli", *args, "--trainer.max_steps", str(steps),
                              *resume], env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-4000:]  # the resume failed: a trunk key missing in the checkpoint
        checkpoint = torch.load(last, weights_only=True)
        assert checkpoint["global_step"] == steps and checkpoint["mtp_heads_only"]
        assert not any(key.startswith("trunk.") for key in checkpoint["state_dict"])
