"""Shared by the kernel tests: markers, and re-running a test file under Triton's interpreter in a child pytest.

``TRITON_INTERPRET=1`` must be set before ``triton.language`` is first imported, so the interpreted kernel tests run
in a child process started with it; in the normal process they are skipped with a reason that says so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_mtp.kernels.dispatch import interpreter_enabled, interpreter_ready

INTERPRETED = interpreter_ready()
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="needs TRITON_INTERPRET=1 from process start; run by test_interpreted_suite_in_subprocess"
)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or interpreter_enabled(), reason="needs a CUDA GPU (and no interpreter)"
)


def run_interpreted_subprocess(test_file: str, timeout: float = 300.0) -> None:
    """Run ``test_file`` in a child pytest with TRITON_INTERPRET=1 set from the start; fail with its output."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("LIGHTNING_MTP_KERNELS", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", "-m", "not gpu"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"interpreted kernel tests failed (rc={proc.returncode}):\n{output[-6000:]}"
    skipped = re.search(r"(\d+) skipped", output)
    assert " passed" in output and (skipped is None or int(skipped.group(1)) <= 1), output[-3000:]  # only this test
