"""``benchmarks/decode.py`` (and ``decode_costs.py``): the plan of rows (trees, drafts beyond D, ``auto``) for both
architectures, and one tiny end-to-end run on a CLI-trained checkpoint: every row is there, greedy rows are
lossless, the summary reports the targets, the tree costs and what ``auto`` chose."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
from conftest import REPO

from lightning_mtp.decoding import GenerationConfig
from lightning_mtp.decoding.auto import AutoPolicy


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))  # decode.py imports decode_costs from its own folder
    spec = importlib.util.spec_from_file_location("decode_benchmark", os.path.join(REPO, "benchmarks", "decode.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kinds(plan: list[dict], mode: str, batch: int) -> set[str]:
    return {row["decoder"] for row in plan if row["mode"] == mode and row["batch_size"] == batch}


def test_plan_cascaded_has_trees_drafts_beyond_depth_and_auto(bench):
    plan = bench.modes(3, [1, 8], compiled=True, cascaded=True)
    assert kinds(plan, "greedy", 1) == {"plain", "chain", "tree", "dynamic_tree", "auto"}
    assert kinds(plan, "greedy", 8) == {"plain", "chain", "tree", "auto"}
    assert kinds(plan, "sampling", 1) == {"plain", "chain", "tree", "dynamic_tree", "auto"}
    assert kinds(plan, "sampling", 8) == {"plain", "chain", "auto"}
    assert kinds(plan, "greedy-compiled", 1) == {"plain", "chain"}
    chains = [r["draft_tokens"] for r in plan if r["mode"] == "greedy" and r["batch_size"] == 1
              and r["decoder"] == "chain" and r["policy"] == "fixed"]
    assert chains == [1, 2, 3, 4, 5, 6]  # 1..D, then D+1..D+3 through the re-applied last module
    trees = [r["tree"] for r in plan if r["mode"] == "greedy" and r["batch_size"] == 1 and r["decoder"] == "tree"]
    assert trees == bench.static_trees(3, True) and [4, 2, 1] in trees and max(map(len, trees)) == 4
    assert [r["nodes"] for r in plan if r["decoder"] == "tree" and r["tree"] == [4, 2, 1]][0] == 20
    dynamic = [(r["nodes"], r["draft_tokens"]) for r in plan
               if r["decoder"] == "dynamic_tree" and r["mode"] == "greedy"]
    assert dynamic == [(8, 4), (16, 4), (32, 4)]
    assert next(r for r in plan if r["mode"] == "sampling" and r["decoder"] == "tree")["tree"] == [3, 2, 1]
    for row in plan:  # every row says what it decodes (speculative defaults to "auto"), and is a valid config
        assert row["kwargs"]["speculative"] == {"plain": False, "auto": "auto"}.get(row["decoder"], True)
        GenerationConfig(max_new_tokens=8, **row["kwargs"])


def test_plan_parallel_heads_stay_within_depth(bench):
    plan = bench.modes(2, [1, 8], compiled=False, cascaded=False)
    assert all(row["draft_tokens"] <= 2 for row in plan)
    assert bench.static_trees(2, False) == [[2, 1], [3, 2], [4, 2], [8, 2]]
    assert {"tree", "dynamic_tree", "auto"} <= kinds(plan, "greedy", 1)


def test_auto_choices_counts_and_restores_the_policy(bench, make_tiny_model):
    import torch

    from lightning_mtp.decoding import generate

    choices = bench.AutoChoices()
    model = make_tiny_model(depth=2).eval()
    with choices.counting("greedy batch 1"):
        out = generate(model, torch.tensor([[1, 2, 3, 4]]), 12, speculative="auto")
    assert AutoPolicy.next.__name__ == "next"  # the wrapper is gone
    counts = choices.histogram("greedy batch 1")
    assert sum(counts.values()) == out.stats.main_forwards - 1  # one choice per step after the prefill
    learned = bench.auto_memory(model)
    assert learned and learned[0]["batch_size"] == 1 and learned[0]["step_in_plain_steps"]["plain"] == 1.0


def test_smoke_run_on_a_cli_checkpoint(bench, tiny_checkpoint, tmp_path):
    _, ckpt = tiny_checkpoint
    out = tmp_path / "results"
    rows = bench.main(["--ckpt", str(ckpt), "--prompts", "2", "--max-new-tokens", "8", "--repeats", "1",
                       "--no-compile", "--out", str(out)])
    written = json.loads((out / "decode.json").read_text())
    assert len(written) == len(rows) == len(bench.modes(2, [1, 8], compiled=False, cascaded=True))
    assert (out / "decode.png").stat().st_size > 0
    for row in written:
        assert {"mode", "decoder", "tree", "nodes", "batch_size", "draft_tokens", "tau", "acceptance_per_depth",
                "tokens_per_s", "speedup", "lossless"} <= set(row)
        assert row["tokens_per_s"] > 0 and row["tau"] >= 1.0
        assert row["lossless"] is (True if row["mode"].startswith("greedy") else None), row
        if row["decoder"] in ("chain", "tree", "dynamic_tree"):
            assert len(row["acceptance_per_depth"]) == row["draft_tokens"]
    assert kinds(written, "greedy", 1) == {"plain", "chain", "tree", "dynamic_tree", "auto"}
    beyond = [r for r in written if r["decoder"] == "chain" and r["batch_size"] == 1 and r["mode"] == "greedy"
              and r["draft_tokens"] == 5]
    assert len(beyond) == 1 and len(beyond[0]["acceptance_per_depth"]) == 5  # acceptance at D+1..D+3 reported
    autos = [r for r in written if r["decoder"] == "auto"]
    assert len(autos) == 4 and all(sum(r["auto_choices"].values()) > 0 for r in autos)

    summary = json.loads((out / "decode_summary.json").read_text())
    assert list(summary["targets"]) == list(bench.TARGETS)
    assert all(isinstance(t["met"], bool) and t["measured"] is not None for t in summary["targets"].values())
    assert summary["targets"]["batch 8 greedy speedup, auto"]["goal"] == 1.3
    for batch in ("batch_1", "batch_8"):
        costs = summary["tree_costs_s"][batch]
        assert set(costs["in_plain_steps"]["verify_tokens"]) >= {"1", "16", "64"}
        assert costs["draft_tree_s"] and costs["draft_depth_nodes_s"]
    assert set(summary["auto_choices"]) == {f"{r['mode']} batch {r['batch_size']}" for r in autos}
    assert summary["in_situ_costs_s"]["trees"] and "auto_plain_step" in summary["in_situ_costs_s"]
    assert any("tree verify forward" in line for line in summary["explanation"])


def test_the_report_example_holds(bench):
    import doctest

    import decode_report  # benchmarks/, on the path since the bench fixture

    assert doctest.testmod(decode_report).failed == 0
