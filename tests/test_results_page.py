"""``docs/results.md`` is written by ``benchmarks/report.py`` from ``benchmarks/results/*.json``: the committed page
is exactly what the script writes, ``--check`` fails with a diff on a stale page, a renderer turns a small
hand-written result into its table, and a JSON file no renderer knows still gets a section."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("benchmarks_report", os.path.join(REPO, "benchmarks", "report.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


THIN_LINEAR = {"threads": 2, "dim": 64, "layers": 2, "vocab": 128, "rows": [
    {"rows": 4, "f_linear_ms": 1.5, "thin_ms": 1.0, "auto_ms": 1.02, "thin_speedup": 1.5, "auto_vs_best": 1.02},
    {"rows": 1, "f_linear_ms": 1.0, "thin_ms": 2.0, "auto_ms": 1.0, "thin_speedup": 0.5, "auto_vs_best": 1.0},
]}


def test_committed_page_is_what_the_script_writes():
    run = subprocess.run([sys.executable, "benchmarks/report.py", "--check"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, f"docs/results.md is stale: run `python benchmarks/report.py`\n{run.stdout}"
    page = open(os.path.join(REPO, "docs", "results.md"), encoding="utf-8").read()
    assert "python benchmarks/report.py" in page.splitlines()[0] and "Do not edit" in page.splitlines()[0]


def test_thin_linear_renderer_on_a_hand_written_result(report):
    lines = report.render_thin_linear(report.Source("thin_linear.json", THIN_LINEAR))
    assert "| 1 | 1.00 | 2.00 | 1.00 | 0.50× | 1.00 |" in lines  # sorted by rows, fixed decimals
    assert lines.index("| 1 | 1.00 | 2.00 | 1.00 | 0.50× | 1.00 |") < lines.index(
        "| 4 | 1.50 | 1.00 | 1.02 | 1.50× | 1.02 |")
    text = "\n".join(lines)
    assert "not recorded in the JSON (the project's 2-core CPU development machine); recorded: 2 torch threads" in text
    assert "`python benchmarks/thin_linear.py --threads 2 --dim 64 --layers 2 --vocab 128 --rows 4 1` (rebuilt" in text

    recorded = {**THIN_LINEAR, "command": "python benchmarks/thin_linear.py --threads 2",
                "machine": {"platform": "Linux-x", "cpus": 8, "torch": "2.0", "torch_threads": 2, "device": "cpu"}}
    text = "\n".join(report.render_thin_linear(report.Source("thin_linear.json", recorded)))
    assert "- **Machine:** Linux-x; 8 CPUs; torch 2.0; 2 torch threads; device cpu" in text
    assert "- **Command:** `python benchmarks/thin_linear.py --threads 2` (recorded in the JSON)" in text


def test_check_reports_a_stale_page_and_unknown_files_get_a_section(report, tmp_path, capsys):
    results, page = tmp_path / "results", tmp_path / "results.md"
    results.mkdir()
    (results / "thin_linear.json").write_text(json.dumps(THIN_LINEAR))
    (results / "new_bench.json").write_text(json.dumps({"rows": [1, 2], "speed": 3.0}))
    page.write_text("stale\n")
    assert report.main(["--check", "--results", str(results), "--out", str(page)]) == 1
    assert "-stale" in capsys.readouterr().out  # a unified diff
    assert page.read_text() == "stale\n"  # --check writes nothing
    assert report.main(["--results", str(results), "--out", str(page)]) == 0
    assert report.main(["--check", "--results", str(results), "--out", str(page)]) == 0
    text = page.read_text()
    assert text == report.render_page(results)  # deterministic
    assert "## Small matrix products on CPU" in text and "## Not rendered: new_bench.json" in text
    assert "- `rows`: list of 2" in text and "- `speed`: float" in text


def test_provenance_records_the_command_and_the_machine(report):
    meta = report.provenance("/somewhere/benchmarks/thin_linear.py", ["--threads", "2", "--out", "a b.json"])
    assert meta["command"] == "python benchmarks/thin_linear.py --threads 2 --out 'a b.json'"
    assert {"platform", "cpus", "torch", "torch_threads", "device"} <= set(meta["machine"])


def test_gpu_check_renderer_names_failed_steps_and_how_the_roofline_was_timed(report):
    def record(step, status, result):
        return {"step": step, "status": status, "rc": 0 if status == "passed" else 1, "seconds": 2.0,
                "time_limit_s": 30, "result": result}

    roofline = {"rows": [{"batch_size": 1, "option": "plain", "step_ms": 2.0}]}
    summary = {"ok": False, "failed": ["fsdp2_fit"], "seconds": 9, "steps": {
        "env": record("env", "passed", {"device": "Some GPU", "torch": "2.11", "cuda": "13.0"}),
        "fsdp2_fit": record("fsdp2_fit", "failed", None),
        "zero3_fit": record("zero3_fit", "passed", {"steps": 2, "train/loss": [2.5, 2.25], "finite": True}),
        "roofline_check": record("roofline_check", "passed", roofline)}}
    text = "\n".join(report.render_gpu_check(report.Source("gpu_check.json", summary)))
    assert "overall: FAILED: fsdp2_fit in 9 s" in text
    assert "| fsdp2_fit | failed | 2.0 | 30 | – |" in text
    assert "| zero3_fit | passed | 2.0 | 30 | 2 steps, loss 2.500 → 2.250, finite: yes |" in text
    assert "the prefill counted in each step" in text  # rows without one_token_call_ms: whole calls
    roofline["rows"][0]["one_token_call_ms"] = 30.0
    text = "\n".join(report.render_gpu_check(report.Source("gpu_check.json", summary)))
    assert "1 row: steps timed by difference" in text


def test_plot_tensorboard_reads_one_run_and_refuses_a_folder_of_several(tmp_path):
    """Two fits' ``version_0`` / ``version_1`` were read as one series sorted by step: a zigzag of both runs."""
    from torch.utils.tensorboard import SummaryWriter

    spec = importlib.util.spec_from_file_location("plot_tensorboard", os.path.join(REPO, "benchmarks",
                                                                                   "plot_tensorboard.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for version, steps in (("version_0", range(0, 4)), ("version_0", range(4, 6)), ("version_1", range(0, 3))):
        writer = SummaryWriter(str(tmp_path / "logs" / version))  # version_0 twice: a resumed fit's second file
        for step in steps:
            writer.add_scalar("train/main/loss", 10.0 - step, step)
        writer.close()
    series = module.read_scalars(tmp_path / "logs" / "version_0")
    assert [step for step, _ in series["train/main/loss"]] == list(range(6))
    with pytest.raises(SystemExit, match="holds 2 runs"):
        module.read_scalars(tmp_path / "logs")


def test_replay_draws_renderer_puts_each_run_beside_the_others_and_marks_missed_targets(report):
    def row(draw, batch, vs_plain, vs_best):
        return {"draw": draw, "model": "quickstart", "batch_size": batch, "vs_plain": vs_plain,
                "vs_best_fixed": vs_best, "met": vs_plain >= 0.97 and vs_best >= 0.95}

    runs = {"before": {"command": "bash benchmarks/replay_draws.sh before", "commit": "abc1234",
                       "rows": [row("a", 1, 1.2, 0.96), row("a", 8, 0.9, 1.1)]},
            "auto": {"command": "bash benchmarks/replay_draws.sh auto", "commit": None,
                     "rows": [row("a", 8, 0.99, 1.0)]}}
    lines = report.render_replay_draws(report.Source("replay_draws.json", {"runs": runs}))
    assert "| draw | model | batch | before | auto |" in lines
    assert "| a | quickstart | 1 | 1.20× / 0.96× | – |" in lines  # a cell the later run lacks
    assert "| a | quickstart | 8 | 0.90× / 1.10× * | 0.99× / 1.00× |" in lines  # below 0.97x plain: marked
    assert any("code abc1234" in line for line in lines) and any("code unrecorded" in line for line in lines)
