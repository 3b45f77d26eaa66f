"""A 2-process DDP fit on CPU (gloo): both ranks train the MTP heads and end with identical weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_two_process_ddp_fit_on_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests/scripts/ddp_fit.py"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world_size"] == 2 for r in ranks)
    assert ranks[0]["params"].keys() == ranks[1]["params"].keys()
    assert any(name.startswith("mtp_modules.1.") for name in ranks[0]["params"])
    for name, value in ranks[0]["params"].items():
        assert abs(value - ranks[1]["params"][name]) <= 1e-6 * max(1.0, abs(value)), name
    metrics = ranks[0]["metrics"]
    assert {"val/mtp/loss_depth1", "val/mtp/loss_depth2", "val/main/loss"} <= metrics.keys()
    assert all(v == v for v in metrics.values())  # no NaN


def test_validation_on_two_processes_reports_what_one_process_does(tmp_path):
    """Lightning's sampler evens the processes' shares by repeating the first held-out rows, which the token-weighted
    ``val/`` means counted twice (``validate`` gave val/loss 3.19957 on 2 processes, 3.20514 on 1); and
    ``MTPCouplingMonitor`` aborted (a gloo collective mismatch) when one process had nothing to score for a depth."""
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    from ddp_validation import text_setup

    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("LOCAL_RANK", None)
    env.pop("PL_GLOBAL_SEED", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests/scripts/ddp_validation.py"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    model, data = text_setup(tmp_path / "cache")
    data.setup("validate")
    assert len(data.val_dataset) % 2 == 1  # the shares are evened out by padding
    import lightning as L

    one = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False).validate(model, data, verbose=False)[0]
    for name in ("val/loss", "val/main/loss", "val/main/acc", "val/mtp/loss_depth2"):
        assert abs(metrics["text"][name] - one[name]) < 1e-5, (name, metrics["text"][name], one[name])
    assert "val/mtp/accept_depth2" in metrics["monitor"] and "val/mtp/accept_depth1" in metrics["monitor"]


def test_predict_on_two_processes_writes_every_prompt_once_as_one_process_does(tiny_checkpoint, tmp_path):
    """Five prompts at batch 1 on two processes: Lightning's predict sampler gave them 3 and 2 batches, and the
    writer's per-batch stop check (a collective) failed on the process with none left (exit 1, rank 0's outputs lost).
    Now every prompt is written once, as one process decodes it; the folder holds one ``generations.jsonl`` and one
    ``stats.json`` as after one process (it held a ``generations.rank<N>.jsonl`` and ``stats.rank<N>.json`` per
    process, the stats counting the padding row); a run's folder drops an earlier run's files of another layout; and
    sampling draws one stream per process (the same seed on both gave their n-th rows the same samples)."""
    from conftest import tiny_predict_args

    workdir, ckpt = tiny_checkpoint
    cli = str(Path(sys.executable).with_name("lightning-mtp"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    env.pop("PL_GLOBAL_SEED", None)

    def run(out: Path, prompts: list[str], devices: int, *extra: str) -> dict[int, list[list[int]]]:
        file = tmp_path / f"{out.name}.txt"
        file.write_text("\n".join(prompts) + "\n")
        args = tiny_predict_args(workdir, ckpt, "--data.init_args.predict_prompts", str(file),
                                 "--data.init_args.batch_size", "1", "--trainer.callbacks.init_args.output_dir",
                                 str(out), "--trainer.devices", str(devices),
                                 *(["--trainer.strategy", "ddp"] if devices > 1 else []), *extra)
        proc = subprocess.run([cli, *args], env=env, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows: dict[int, list[list[int]]] = {}
        for path in out.glob("generations*.jsonl"):
            for line in path.read_text().splitlines():
                record = json.loads(line)
                rows.setdefault(record["index"], []).append(record["tokens"])
        return rows

    texts = ["def f(x):", "import os", "class A:", "for i in", "return x"]
    out = tmp_path / "out"
    # a fixed chain: `auto` decides from timings and from the calls each process saw before, so its drafts (not its
    # tokens) differ between one process and two, and so would the stats compared below
    chain = ("--model.init_args.generation.speculative", "true")
    one = run(out, texts, 1, *chain)
    one_lines = (out / "generations.jsonl").read_text().splitlines()
    one_stats = json.loads((out / "stats.json").read_text())
    (out / "stats.rank1.json").write_text("{}")  # an earlier run's file of another layout: the next run removes it
    two = run(out, texts, 2, *chain)  # into the same folder
    assert sorted(two) == [0, 1, 2, 3, 4] and all(len(v) == 1 for v in two.values())
    assert two == one
    # one process's layout: every prompt once, in prompt order, and the stats of the prompts (not of the padding)
    assert sorted(p.name for p in out.iterdir()) == ["generations.jsonl", "stats.json"]
    assert (out / "generations.jsonl").read_text().splitlines() == one_lines
    two_stats = json.loads((out / "stats.json").read_text())
    assert two_stats.keys() == one_stats.keys()
    for name in ("calls", "rows", "total_new_tokens", "row_forwards", "main_forwards", "drafted_per_depth",
                 "accepted_per_depth", "accepted_length_histogram", "tau", "generation"):
        assert two_stats[name] == one_stats[name], (name, two_stats[name], one_stats[name])

    sampled = run(tmp_path / "sampled", ["def f(x):"] * 4, 2, "--model.init_args.generation.temperature", "1.0",
                  "--model.init_args.generation.seed", "0")
    assert sorted(sampled) == [0, 1, 2, 3]
    assert sampled[0] != sampled[1] and sampled[2] != sampled[3]  # rank 0 has rows 0 and 2, rank 1 rows 1 and 3


def _tear_down_on_rank(rank: int, port: int, folder: str) -> None:
    import torch.distributed as dist

    from lightning_mtp.cli import tear_down_process_group

    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    tear_down_process_group()
    Path(folder, f"rank{rank}").write_text(json.dumps(dist.is_initialized()))


def test_a_command_on_several_processes_tears_its_process_group_down(tmp_path):
    """``lightning-mtp`` destroys the process group of a run on several processes before the interpreter exits (left
    to the exit, a joinable gloo thread once aborted a finished 2-process predict: "terminate called without an active
    exception", exit status -6): every process waits for the others, then none holds a group."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_tear_down_on_rank, args=(port, str(tmp_path)), nprocs=2, join=True)
    assert [json.loads((tmp_path / f"rank{r}").read_text()) for r in (0, 1)] == [False, False]
