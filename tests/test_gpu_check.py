"""scripts/gpu_check.sh: a clean skip without a GPU, valid bash, honest bookkeeping, and every command it runs exists.

The script's checks need a GPU (up to 9 minutes there); CI has none. So CI checks the skip (exit 0, one line saying
why), the driver (a JSON per step and a summary, here with every step out of time), and that every file, flag,
inline program and test helper the steps use is there, so that a rename elsewhere breaks this test rather than the
next GPU run.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
TEXT = SCRIPT.read_text()
STEPS = ["env", "install", "kernel_tests", "ce_bench", "verify_bench", "compile_decode", "zero3_fit", "fsdp2_fit",
         "decode_bench", "roofline_check"]


def gpu_present() -> bool:
    """The script's own first test: an NVIDIA or AMD device node, or nvidia-smi."""
    return any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists() or bool(shutil.which("nvidia-smi"))


def run_script(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(gpu_present(), reason="a GPU (or its driver) is here: the script would run its 9-minute check")
def test_skips_in_one_line_without_a_gpu(tmp_path):
    out = tmp_path / "out"
    proc = run_script("--out", str(out), cwd=tmp_path)  # from another folder: the script finds the repository
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert re.fullmatch(r"gpu_check: skipped: no GPU on this machine \(.+\)\n", output), output
    assert not out.exists()  # nothing written


def test_script_is_valid_bash():
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_steps_are_the_documented_ones():
    assert re.search(r"^STEPS=\((.*)\)$", TEXT, re.M).group(1).split() == STEPS
    for step in STEPS:
        assert f"step_{step}() {{" in TEXT
        assert re.search(rf"^#   {step} ", TEXT, re.M), f"{step} is not described in the header"


def test_driver_records_every_step_and_a_summary(tmp_path):
    # --force runs past the GPU check; a budget of 0 s leaves every step out of time, so nothing heavy runs.
    out = tmp_path / "out"
    proc = run_script("--force", "--budget", "0", "--out", str(out), cwd=ROOT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is False and list(summary["steps"]) == STEPS
    assert summary["failed"] == [step for step in STEPS if step != "install"]  # install is optional
    for step in STEPS:
        record = json.loads((out / f"{step}.json").read_text())
        assert record["status"] == "skipped" and "budget is spent" in record["reason"]
        assert record["step"] == step and record["result"] is None

    proc = run_script("--steps", "env,warp_drive", cwd=ROOT)
    assert proc.returncode == 2 and "unknown step warp_drive" in proc.stderr


def commands() -> str:
    """The script with its continuation lines joined."""
    return TEXT.replace("\\\n", " ")


def test_referenced_files_inline_programs_and_helpers_exist():
    paths = set(re.findall(r"(?:benchmarks|configs|tests)/[\w*.-]+\.(?:py|yaml)", TEXT))
    assert {"benchmarks/triton_kernels.py", "benchmarks/decode.py", "configs/deepspeed_zero3.yaml",
            "configs/quickstart.yaml", "configs/fsdp.yaml"} <= paths
    for path in paths:
        assert list(ROOT.glob(path)), f"{path} does not exist"
    programs = re.findall(r"<<'PY'[^\n]*\n(.*?)\nPY\n", TEXT, re.S)
    assert len(programs) == 10
    for program in programs:
        compile(program, str(SCRIPT), "exec")
    test_decoding = ast.parse((ROOT / "tests" / "test_decoding.py").read_text())
    helpers = {node.name for node in test_decoding.body if isinstance(node, ast.FunctionDef)}
    assert {"draftable_model", "ragged_prompts"} <= helpers  # compile_decode imports them
    kernel_tests = "".join(path.read_text() for path in ROOT.glob("tests/test_kernels_*.py"))
    assert "def test_interpreted_suite_in_subprocess" in kernel_tests  # what kernel_tests deselects
    assert "@gpu" in kernel_tests
    assert 'if __name__ == "__main__"' in (ROOT / "lightning_mtp" / "cli.py").read_text()  # python -m lightning_mtp.cli


def test_benchmarks_accept_the_flags_the_script_passes():
    flags: dict[str, set[str]] = {}
    for line in commands().splitlines():
        for name, rest in re.findall(r"(benchmarks/\w+\.py)(.*)", line):
            flags.setdefault(name, set()).update(re.findall(r"\s(--[a-z][\w-]*)", rest))
    assert set(flags) == {"benchmarks/triton_kernels.py", "benchmarks/decode.py", "benchmarks/decode_roofline.py"}
    procs = {
        name: subprocess.Popen([sys.executable, name, "--help"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        for name in flags
    }
    for name, proc in procs.items():
        help_text, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, help_text
        missing = sorted(flag for flag in flags[name] if not re.search(rf"{re.escape(flag)}\b", help_text))
        assert not missing, f"{name} --help does not list {missing}"
