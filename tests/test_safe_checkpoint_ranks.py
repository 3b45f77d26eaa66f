"""``SafeCheckpoint`` in a 2-process fit: SIGTERM to every rank (a scheduler, ``docker stop``) or to one rank only
stops all ranks at the same batch, saves ``last.ckpt`` once and exits 143, with no rank waiting forever.

A real ``lightning-mtp fit`` (DDP, gloo on CPU, the tiny byte-level model) in its own process group, signalled as a
scheduler does: ``kill -TERM -<group>``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, tiny_fit_args

TIMEOUT = 120  # s from the signal to the exit of every process; a hang fails the test instead of hanging pytest


def _start_fit(workdir: Path) -> subprocess.Popen:
    """``python -m lightning_mtp.cli fit`` on 2 DDP processes, leader of a new process group; Lightning starts rank 1
    as its child by re-running the same command. Validates (and so saves ``last.ckpt``) every 5 steps."""
    args = tiny_fit_args(workdir, "--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.max_steps",
                         "100000", "--trainer.val_check_interval", "5", "--data.init_args.tokenizer", "byte",
                         "--model.init_args.model.vocab_size", "258")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]),
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT"):  # a launcher above must not leak in
        env.pop(name, None)
    return subprocess.Popen([sys.executable, "-m", "lightning_mtp.cli", *args], env=env, cwd=str(workdir),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(path: Path, process: subprocess.Popen, seconds: float) -> None:
    """Until ``path`` exists (training is under way); fails with the fit's stderr if it ended first."""
    deadline = time.monotonic() + seconds
    while not path.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), process.stderr.read() if process.poll() is not None else f"no {path.name} in {seconds} s"


def _rank1_pid(process: subprocess.Popen) -> int:
    """The pid of rank 1: the one child process of rank 0 (the dataloaders run in the main processes)."""
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds rank 1 through /proc")
@pytest.mark.parametrize("target", ["every rank", "rank 1 only"])
def test_sigterm_stops_every_rank_at_the_same_batch_and_saves_last(tmp_path, target):
    process = _start_fit(tmp_path)
    last = tmp_path / "ckpt" / "last.ckpt"
    try:
        _wait_for(last, process, 240)  # the validation at step 5 saved it: both ranks are training
        if target == "every rank":
            os.killpg(process.pid, signal.SIGTERM)  # as a scheduler or `docker stop` does
        else:
            os.kill(_rank1_pid(process), signal.SIGTERM)
        try:
            _, stderr = process.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            _, stderr = process.communicate()
            pytest.fail(f"the fit hung after SIGTERM to {target}:\n{stderr[-3000:]}")
        deadline = time.monotonic() + 30  # rank 1 exits on its own, beside rank 0
        while _group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        rank1_alive = _group_alive(process.pid)
    finally:
        if _group_alive(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 143, stderr[-3000:]
    assert not rank1_alive, "rank 1 still running 30 s after rank 0 exited"
    stopped = re.findall(r"SIGTERM: stopped at step (\d+); saved", stderr)
    assert len(stopped) == 1, stderr[-3000:]  # told once, by rank 0
    assert torch.load(last, weights_only=True)["global_step"] == int(stopped[0]) >= 5
    assert not list(last.parent.glob(".*partial"))
