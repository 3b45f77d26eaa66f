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
