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


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (its folder on the path: the benchmarks import each other)."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", os.path.join(REPO, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("decode")


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
    assert learned and learned[0]["batch_size"] == 1 and learned[0]["timed_steps"] > 0
    assert set(learned[0]["cost_in_plain_steps"]) == {"drafting_overhead", "per_draft_depth",
                                                           "per_tree_node_row"}


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
    versus_fixed = summary["targets"]["auto vs the best fixed decoder, greedy"]["rows"]
    assert {r["batch_size"] for r in versus_fixed} == {1, 8}
    for row in versus_fixed:  # the ratio is auto's speedup over the fastest fixed row of its group
        group = [r for r in written if r["mode"] == "greedy" and r["batch_size"] == row["batch_size"]]
        best = max(r["speedup"] for r in group if r["decoder"] not in ("auto", "plain"))
        auto = next(r["speedup"] for r in group if r["decoder"] == "auto")
        assert row["ratio"] == pytest.approx(auto / best)
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


def test_targets_compare_auto_with_the_fastest_fixed_decoder_of_its_group(bench):
    import decode_report

    def row(decoder, speedup, mode="greedy", batch=1, **extra):
        return {"mode": mode, "batch_size": batch, "decoder": decoder, "speedup": speedup, "policy": "fixed",
                "draft_tokens": 3, "tree": None, "nodes": None, **extra}

    rows = [row("plain", 1.0), row("chain", 1.6), row("tree", 2.0, tree=[3, 1]), row("auto", 1.9),
            row("plain", 1.0, batch=8), row("chain", 1.1, batch=8), row("auto", 0.96, batch=8),
            row("plain", 1.0, "sampling"), row("chain", 1.5, "sampling"), row("auto", 1.5, "sampling")]
    targets = decode_report.check_targets(rows)
    greedy = targets["auto vs the best fixed decoder, greedy"]
    assert [r["best_fixed"] for r in greedy["rows"]] == ["tree [3, 1]", "chain k=3 fixed"]
    assert greedy["measured"] == pytest.approx(0.96 / 1.1) and greedy["met"] is False  # batch 8 is the worst
    assert targets["auto vs the best fixed decoder, sampling"]["measured"] == pytest.approx(1.0)
    plain = targets["every auto row vs plain of its mode and batch"]
    assert plain["measured"] == pytest.approx(0.96) and plain["met"] is False


def test_the_roofline_prices_steps_from_bytes_and_flops_and_names_autos_choice(tmp_path):
    roofline = load_benchmark("decode_roofline")
    result = roofline.main(["--out", str(tmp_path / "roofline.json"), "--measured", str(tmp_path / "none.json")])
    groups: dict[tuple, list[dict]] = {}
    for row in result["rows"]:
        groups.setdefault((row["model"], row["hardware"], row["batch_size"]), []).append(row)
    assert len(groups) == len(roofline.MODELS) * len(roofline.HARDWARE) * 3
    for rows in groups.values():
        by_option = {row["option"]: row for row in rows}
        assert by_option["plain"]["speedup"] == 1.0 and by_option["plain"]["step_in_plain_steps"] == 1.0
        assert sum(row["auto_would_choose"] for row in rows) == 1  # auto settles on one option
        chosen = next(row for row in rows if row["auto_would_choose"])
        assert chosen["option"] == "plain" or chosen["option"].startswith("chain")  # auto's options: no trees
        chains = [by_option[f"chain{k}"]["step_in_plain_steps"] for k in range(1, 5)]
        assert chains == sorted(chains)  # a deeper chain never costs less
    # a 7B-class step at batch 1 is memory-bound: a chain of 3 costs little more than a plain step there
    h200 = groups[(roofline.MODELS[1].name, "H200", 1)]
    assert next(r for r in h200 if r["option"] == "chain3")["step_in_plain_steps"] < 1.3


def test_the_roofline_measures_steps_beside_its_prediction(tmp_path):
    roofline = load_benchmark("decode_roofline")
    result = roofline.main(["--measure", "--batch-sizes", "1", "--context", "16", "--measure-tokens", "4",
                            "--repeats", "1", "--out", str(tmp_path / "roofline.json")])
    measured = result["measured"]
    assert measured["device"] == "cpu" and measured["predicted_for"] == "H200"
    assert [row["option"] for row in measured["rows"]] == ["plain", "chain1", "chain2", "chain3"]
    assert all(row["step_ms"] > 0 and row["predicted_step_ms"] > 0 and row["one_token_call_ms"] > 0
               and row["predicted_step_in_plain_steps"] >= 1.0 for row in measured["rows"])


def test_the_ablation_keeps_a_mechanism_only_where_removing_it_costs_two_percent():
    ablation = load_benchmark("decode_ablation")
    rows = [{"row": "auto without fit", "vs_auto": 0.9}, {"row": "auto without fit", "vs_auto": 1.1},
            {"row": "auto without explore", "vs_auto": 0.99}, {"row": "auto without memory", "vs_auto": 1.05}]
    verdicts = ablation.verdicts(rows)
    assert verdicts == pytest.approx({"fit": 0.1, "explore": 0.01, "memory": -0.05})
    assert [m for m, v in verdicts.items() if v >= 0.02] == ["fit"]
    names = [name for name, _, _ in ablation.variants(3)]
    assert names == ["plain", "chain k=1", "chain k=2", "chain k=3", "auto", "auto without fit",
                     "auto without speed", "auto without memory", "auto without explore",
                     "auto without rows", "auto without last_row"]


def test_the_replay_costs_every_step_at_its_measured_price_and_restores_the_policy(tiny_checkpoint, tmp_path):
    """``benchmarks/decode_replay.py`` on a CLI checkpoint: a fixed row's modeled time is its steps times the
    measured cost of its option (plain decoding: every emitted token after the first), ``auto``'s rows are there
    with their steps, a second model's rows are appended beside the first's, and the loop is unpatched after."""
    from lightning_mtp.decoding.tree_policy import AutoSteps

    replay = load_benchmark("decode_replay")
    _, ckpt = tiny_checkpoint
    out = tmp_path / "replay.json"
    observe, choose = AutoSteps.observe_step, AutoPolicy.next
    args = ["--ckpt", str(ckpt), "--prompts", "2", "--max-new-tokens", "8", "--batch-sizes", "1", "--cost-repeats",
            "1", "--repeats", "1", "--out", str(out)]
    replay.main(args + ["--label", "first"])
    result = replay.main(args + ["--label", "second", "--append"])
    assert AutoSteps.observe_step is observe and AutoPolicy.next is choose
    assert {r["model"] for r in result["rows"]} == {"first", "second"} and set(result["step_costs"]) == {
        "first", "second"}
    rows = {r["row"]: r for r in result["rows"] if r["model"] == "second"}
    costs = result["step_costs"]["second"]["1"]["relative"]  # per plain step
    plain_seconds = rows["plain"]["seconds"] / (2 * 7)  # 2 prompts, 7 steps after the prefill's token
    assert plain_seconds == pytest.approx(result["step_costs"]["second"]["1"]["plain_step_s"])
    assert rows["plain"]["steps"] == {"0": 14}
    for k in range(1, 4):  # depth 2, cascaded: chains of 1..3
        row = rows[f"chain k={k}"]
        assert row["seconds"] == pytest.approx(row["steps"][str(k)] * costs[str(k)] * plain_seconds)
        assert row["vs_plain"] == pytest.approx(rows["plain"]["seconds"] / row["seconds"])
    assert {"auto", "auto without explore", "auto without memory"} <= set(rows) and "auto without speed" not in rows
    assert sum(rows["auto"]["steps"].values()) > 0 and set(result["verdicts"]) == {
        "fit", "memory", "explore", "rows", "last_row"}


def test_the_replay_scenarios_change_the_machine_after_auto_learned(tiny_checkpoint, tmp_path):
    """``--slow-spell 4 2``: the first 4 plain steps' worth of each row's replayed time cost twice as much, so plain
    decoding (14 steps) takes 2 steps at twice the cost, 16 plain steps in all; ``speed`` is ablated only under a
    spell. ``--learned-on``: the rows are named after the scenario, priced at ``--costs-from``'s costs."""
    replay = load_benchmark("decode_replay")
    _, ckpt = tiny_checkpoint
    base = ["--ckpt", str(ckpt), "--prompts", "2", "--max-new-tokens", "8", "--batch-sizes", "1", "--cost-repeats",
            "1", "--repeats", "1", "--seeds", "1", "--label", "tiny"]
    costs = tmp_path / "costs.json"
    measured = replay.main(base + ["--no-ablation", "--out", str(costs)])
    plain_step = measured["step_costs"]["tiny"]["1"]["plain_step_s"]
    dear = json.loads(costs.read_text())
    relative = dear["step_costs"]["tiny"]["1"]["relative"]
    dear["step_costs"]["tiny"]["1"]["relative"] = {k: 1.0 + 3 * float(k) for k in relative}  # drafting dear
    dear_costs = tmp_path / "dear.json"
    dear_costs.write_text(json.dumps(dear))

    spell = replay.main(base + ["--costs-from", str(costs), "--slow-spell", "4", "2", "--ablate", "speed", "explore",
                                "--out", str(tmp_path / "spell.json")])
    rows = {r["row"]: r for r in spell["rows"]}
    assert {r["model"] for r in spell["rows"]} == {"tiny (2x slower for 4 plain steps)"}
    assert rows["plain"]["seconds"] == pytest.approx(16 * plain_step)
    assert {"auto without speed", "auto without explore"} <= set(rows) and "auto without fit" not in rows

    shifted = replay.main(base + ["--costs-from", str(costs), "--learned-on", str(dear_costs), "--no-ablation",
                                  "--out", str(tmp_path / "shifted.json")])
    assert {r["model"] for r in shifted["rows"]} == {"tiny (learned on dear, replayed on costs)"}
    rows = {r["row"]: r for r in shifted["rows"]}
    assert rows["plain"]["seconds"] == pytest.approx(14 * plain_step) and "auto without speed" not in rows
    assert rows["chain k=1"]["seconds"] == pytest.approx(
        rows["chain k=1"]["steps"]["1"] * measured["step_costs"]["tiny"]["1"]["relative"]["1"] * plain_step)


def test_the_overhead_benchmark_times_autos_loop_and_policy_beside_other_code(tiny_checkpoint, tmp_path):
    """``benchmarks/auto_overhead.py``: each decoder's call time over the fixed chain's and the policy's time per
    step; its ``bare`` and ``policy`` decoders draft the fixed chain at every step; a second run goes beside the first,
    a rerun of a model and batch size replaces its row, and the loop is unpatched after."""
    import torch

    from lightning_mtp.decoding.tree import TreeShape
    from lightning_mtp.decoding.tree_policy import AutoSteps

    overhead = load_benchmark("auto_overhead")
    _, ckpt = tiny_checkpoint
    out = tmp_path / "overhead.json"
    unpatched = AutoPolicy.next, AutoPolicy.observe, AutoSteps.next, AutoSteps.observe_step
    args = ["--ckpt", str(ckpt), "--label", "tiny", "--prompts", "2", "--max-new-tokens", "8", "--repeats", "1",
            "--chain", "2", "--out", str(out)]
    overhead.main(args + ["--run", "new"])
    overhead.main(args + ["--run", "old"])
    overhead.main(args + ["--run", "new"])
    result = overhead.main(args + ["--run", "new", "--batch-size", "2"])
    assert (AutoPolicy.next, AutoPolicy.observe, AutoSteps.next, AutoSteps.observe_step) == unpatched
    assert set(result["runs"]) == {"new", "old"} and len(result["runs"]["old"]["rows"]) == 1
    rows = {r["batch_size"]: r for r in result["runs"]["new"]["rows"]}
    assert sorted(rows) == [1, 2] and [rows[1]["calls"], rows[2]["calls"]] == [2, 1]
    for row in rows.values():
        assert all(row[key] > 0 for key in ("bare", "policy", "auto", "step_ms")), row
        assert 0 <= row["policy_us_per_step"] < 1e3 * row["step_ms"], row

    model, datamodule = overhead.load(ckpt, overhead.ROOT / "benchmarks" / "decode_model.yaml")
    prompt = overhead.chunks(overhead.held_out_prompts(datamodule, 1, 16), 1)[0]
    for name in ("bare", "policy"):
        AutoPolicy.next, AutoPolicy.observe = overhead.policies(TreeShape.chain(2))[name]
        try:
            with torch.no_grad():
                stats = overhead.run_chunk(model.eval(), prompt, 8, None, speculative="auto")[1]
        finally:
            AutoPolicy.next, AutoPolicy.observe = unpatched[:2]
        drafted = stats.drafted_per_depth  # chains of up to 3 on offer; every step drafted 2
        assert drafted[0] == drafted[1] > 0 and drafted[2] == 0, (name, drafted)


@pytest.mark.parametrize("batch", [1, 2])
def test_the_replay_counts_the_positions_a_draft_catches_up_as_the_drafter_does(batch):
    """The replay charges a draft for the positions its modules skipped (``Replay.caught_up``); the chain drafter's
    windows are the reference. Calls force plain steps and chains of 1..4 in turn; at every drafting step each
    module's window is the one it had after it last ran plus the positions the replay counts it behind (the prompt,
    which the replay leaves out, is the baseline; steps after a row could reach its budget are left out: a row cut
    short moves less than its accepted drafts)."""
    import torch
    from test_decoding import VOCAB, draftable_model

    from lightning_mtp.decoding import drafting

    replay_module = load_benchmark("decode_replay")
    model, budget, width = draftable_model("cascaded"), 72, 8
    prompts = list(torch.randint(0, VOCAB, (batch, width), generator=torch.Generator().manual_seed(3)))
    replay = replay_module.Replay(budget)
    replay.cycle = [0, 1, 4, 4, 2, 0, 0, 3, 1, 1, 2, 4, 3, 0]
    baseline: dict[int, dict[int, int]] = {}  # drafter state -> module -> its window after it last ran
    checked, drafted_depths = [], set()
    draft, commit = drafting.MTPDrafter.draft, drafting.MTPDrafter.commit

    def counted_draft(self, state, tokens, newest, num_drafts, *args, **kwargs):
        if int(newest.max()) - width + 1 + 2 * (self.max_drafts + 1) <= budget:  # every row has room
            drafted_depths.add(num_drafts)
            checked.append([(state.windows[k - 1], baseline[id(state)][k] + replay.behind[k])
                            for k in range(1, self.max_drafts + 1)])
        return draft(self, state, tokens, newest, num_drafts, *args, **kwargs)

    def counted_commit(self, state, advanced):
        ran = state.ran
        commit(self, state, advanced)
        if id(state) not in baseline:  # the prefill: every module's window is the prompt
            baseline[id(state)] = {k: state.windows[k - 1] for k in range(1, self.max_drafts + 1)}
        baseline[id(state)].update({k: state.windows[k - 1] for k in range(1, ran + 1)})

    drafting.MTPDrafter.draft, drafting.MTPDrafter.commit = counted_draft, counted_commit
    try:
        with torch.inference_mode(), replay_module.patched(replay):
            stats = replay_module.decode_all(model, replay_module.chunks(prompts, batch), budget, {})
    finally:
        drafting.MTPDrafter.draft, drafting.MTPDrafter.commit = draft, commit
    assert len(checked) >= 12 and drafted_depths == {1, 2, 3, 4}, (len(checked), drafted_depths)
    assert sum(stats["accepted_per_depth"]) > 0  # drafts were accepted: rows moved by more than one token
    assert any(window > 4 for step in checked for window, _ in step)  # some module had fallen behind
    for step in checked:
        assert [window for window, _ in step] == [counted for _, counted in step]


def test_the_replay_charges_a_draft_its_catching_up_and_reads_costs_without_it(tmp_path):
    """A step is charged its option's cost plus the cost per position its modules were behind (the first step of a
    call, which catches up over the prompt, only its option's); cost files without ``catch_up`` price it at 0."""
    replay_module = load_benchmark("decode_replay")
    replay = replay_module.Replay(8)
    replay.costs, replay.per_position = {0: 1.0, 1: 2.0}, 0.25
    assert replay.step(1, 1.0, first=False, behind=4) == pytest.approx(3.0)
    assert replay.step(1, 1.0, first=True, behind=4) == pytest.approx(2.0)
    assert replay.step(0, 1.0, first=False, behind=0) == pytest.approx(1.0)
    assert replay.seconds == pytest.approx(6.0)
    kept = {"step_costs": {"m": {"1": {"plain_step_s": 0.5, "relative": {"0": 1.0, "1": 1.5}}}}}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(kept))
    assert replay_module.kept_costs(path, "m", 1) == ({0: 0.5, 1: 0.75}, 0.0)
    kept["step_costs"]["m"]["1"]["catch_up"] = 0.02
    path.write_text(json.dumps(kept))
    assert replay_module.kept_costs(path, "m", 1)[1] == pytest.approx(0.01)
