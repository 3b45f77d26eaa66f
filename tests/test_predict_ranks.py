"""``PredictionWriter`` under several processes, with the processes stood in for (the collective that gathers their
shares on rank 0 is replaced): the folder ends as after one process, or per process with a message where the rows
carry no prompt index, and never holds files of two runs. ``tests/test_ddp.py`` runs the real two-process predict."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

import lightning_mtp.prediction_writer as prediction_writer
from lightning_mtp.decoding.stats import DecodeStats
from lightning_mtp.prediction_writer import PredictionWriter

PROMPTS = ["p0", "p1", "p2"]  # 3 prompts on 2 processes at batch 2: rank 0 has 0 and 2, rank 1 has 1 and padding 3


def stats(new_tokens: list[int], row_forwards: list[int]) -> DecodeStats:
    return DecodeStats(batch_size=len(new_tokens), max_drafts=1, main_forwards=max(row_forwards),
                       row_forwards=row_forwards, new_tokens=new_tokens, drafted_per_depth=[2],
                       accepted_per_depth=[1], accepted_length_histogram=[1, 1], elapsed_s=0.5)


def trainer(rank: int) -> SimpleNamespace:
    strategy = SimpleNamespace(root_device="cpu", all_gather=lambda t: t.unsqueeze(0), barrier=lambda name=None: None)
    return SimpleNamespace(global_rank=rank, world_size=2, is_global_zero=rank == 0, strategy=strategy,
                           datamodule=SimpleNamespace(predict_dataset=PROMPTS))


MODULE = SimpleNamespace(mtp_generate_kwargs={"max_new_tokens": 4})


def run_two_processes(folder, monkeypatch, indexed: bool = True) -> None:
    """Both processes' hooks, rank 1 first; rank 0's gather returns both shares."""
    writers = {rank: PredictionWriter(str(folder)) for rank in (0, 1)}
    shares = {0: ([0, 2], ["a", "c"], stats([3, 5], [2, 4])), 1: ([1, 3], ["b", "pad"], stats([4, 9], [3, 7]))}
    for rank, writer in writers.items():
        writer.on_predict_start(trainer(rank), MODULE)
        indices, texts, decoded = shares[rank]
        prediction = {"tokens": [[len(t)] for t in texts], "texts": texts,
                      "prompt_text": [PROMPTS[i % 3] for i in indices], "stats": decoded}
        writer.write_on_batch_end(trainer(rank), MODULE, prediction, indices if indexed else None, None, 0)
    parts = {}

    def gather(trainer, part):  # rank 0 gets every share in rank order
        parts[trainer.global_rank] = part
        return [parts[rank] for rank in sorted(parts)] if trainer.is_global_zero else []

    monkeypatch.setattr(prediction_writer, "_gather_on_rank_zero", gather, raising=False)
    for rank in (1, 0):
        writers[rank].on_predict_end(trainer(rank), MODULE)


def test_two_processes_write_one_generations_file_in_prompt_order_and_stats_of_the_prompts(tmp_path, monkeypatch):
    folder = tmp_path / "out"
    folder.mkdir()
    for name in ("generations.rank0.jsonl", "generations.rank1.jsonl", "stats.rank0.json", "stats.rank1.json"):
        (folder / name).write_text("earlier run\n")
    run_two_processes(folder, monkeypatch)
    assert sorted(p.name for p in folder.iterdir()) == ["generations.jsonl", "stats.json"]
    records = [json.loads(line) for line in (folder / "generations.jsonl").read_text().splitlines()]
    assert [(r["index"], r["prompt"], r["completion"]) for r in records] == [(0, "p0", "a"), (1, "p1", "b"),
                                                                           (2, "p2", "c")]
    summary = json.loads((folder / "stats.json").read_text())
    # the padding row (9 tokens, 7 forwards) leaves the per-row counts; the batch-wide ones are the batches' own
    assert (summary["rows"], summary["total_new_tokens"], summary["row_forwards"]) == (3, 3 + 5 + 4, 2 + 4 + 3)
    assert summary["calls"] == 2 and summary["main_forwards"] == 4 + 7 and summary["drafted_per_depth"] == [4]
    assert summary["generation"] == {"max_new_tokens": 4} and summary["tau_counts_bonus_token"] is True


def test_rows_without_prompt_indices_stay_per_process_with_a_message(tmp_path, monkeypatch, capsys):
    """Without Lightning's ``batch_indices`` each process numbers its own rows (0, 1 on both): merged, the indices
    would repeat, so each process's rows are kept in its own file and the user is told why."""
    folder = tmp_path / "out"
    folder.mkdir()
    for name in PredictionWriter.FILES:
        (folder / name).write_text("earlier run\n")
    run_two_processes(folder, monkeypatch, indexed=False)
    assert "no batch_indices" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == [
        "generations.rank0.jsonl", "generations.rank1.jsonl", "stats.rank0.json", "stats.rank1.json"]
    rank1 = [json.loads(line) for line in (folder / "generations.rank1.jsonl").read_text().splitlines()]
    assert [(r["index"], r["completion"]) for r in rank1] == [(0, "b"), (1, "pad")]
    assert json.loads((folder / "stats.rank1.json").read_text())["total_new_tokens"] == 13


@pytest.mark.parametrize("fails_at", ["generations.jsonl", "stats.json"])
def test_a_crash_while_the_outputs_are_moved_leaves_no_folder_mixing_runs(tmp_path, monkeypatch, fails_at):
    """The earlier run's stats go before any new generations file is moved in, the new stats last: a crash in
    between leaves files of one run only (an earlier stats.json never sits beside the new generations)."""
    folder = tmp_path / "out"
    folder.mkdir()
    earlier = ["generations.rank0.jsonl", "generations.rank1.jsonl", "stats.rank0.json", "stats.rank1.json"]
    for name in earlier:
        (folder / name).write_text("earlier run\n")
    replace = os.replace

    def crash(source, target):
        if os.path.basename(target) == fails_at:
            raise KeyboardInterrupt
        replace(source, target)

    monkeypatch.setattr(prediction_writer.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        run_two_processes(folder, monkeypatch)
    left = {p.name for p in folder.iterdir() if not p.name.startswith(".")}
    assert not (left & set(earlier) and left & set(PredictionWriter.FILES)), left  # one run's files, or none
