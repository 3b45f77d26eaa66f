"""``benchmarks/hf_mtp_compare.py`` (issue #14): the smoke run and a ``--folder`` run produce every row the issue
asks for, lossless, with real drafting; the helpers that make its ragged batches."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the benchmark compares against transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "hf_mtp_compare.py"
FIELDS = {"system", "mode", "batch_size", "tau", "tokens_per_s", "speedup_vs_transformers_plain",
          "acceptance_per_depth", "equals_transformers_plain", "new_tokens"}
ROWS = [("transformers", "plain", 1), ("transformers", "use_mtp", 1), ("lightning-mtp", "plain", 1),
        ("lightning-mtp", "chain", 1), ("lightning-mtp", "auto", 1), ("lightning-mtp", "plain", 4),
        ("lightning-mtp", "chain", 4), ("lightning-mtp", "auto", 4)]
FAST = ["--prompts", "4", "--max-new-tokens", "12", "--repeats", "1", "--threads", "1"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("hf_mtp_compare", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def check_rows(result: dict, depth: int) -> None:
    rows = result["rows"]
    assert [(r["system"], r["mode"], r["batch_size"]) for r in rows] == ROWS
    for row in rows:
        assert FIELDS <= set(row), sorted(FIELDS - set(row))
        assert row["equals_transformers_plain"], row
        assert row["tau"] >= 1.0 and row["tokens_per_s"] > 0 and row["new_tokens"] == 4 * 12
        assert ("speedup_vs_own_plain" in row) == (row["system"] == "lightning-mtp")
        assert len(row["acceptance_per_depth"]) == (0 if row["mode"] == "plain" else depth)
    by_mode = {(r["system"], r["mode"], r["batch_size"]): r for r in rows}
    assert by_mode[("transformers", "plain", 1)]["speedup_vs_transformers_plain"] == 1.0
    assert by_mode[("lightning-mtp", "plain", 4)]["speedup_vs_own_plain"] == 1.0
    for key in (("transformers", "use_mtp", 1), ("lightning-mtp", "chain", 1), ("lightning-mtp", "chain", 4)):
        assert by_mode[key]["tau"] > 1.0 and by_mode[key]["acceptance_per_depth"][0] > 0, key  # drafts accepted
    assert "auto_choices" in by_mode[("lightning-mtp", "auto", 1)]
    assert result["setup"]["depth"] == depth and len(result["setup"]["prompt_lengths"]) == 4
    assert any("chains only" in note for note in result["notes"])


def test_smoke_run_writes_every_row(tmp_path, bench):
    out = tmp_path / "result.json"
    result = bench.main(["--smoke", "--out", str(out), *FAST])
    check_rows(result, depth=2)
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    assert len(set(result["setup"]["prompt_lengths"])) > 1  # ragged: the batched rows are padded


def test_folder_run_reads_any_exported_folder(tmp_path, bench):
    bench.smoke_folder(tmp_path / "model", steps=80, prompts=1)
    result = bench.main(["--folder", str(tmp_path / "model"), "--prompt-tokens", "6", "--out",
                         str(tmp_path / "r.json"), *FAST])
    assert result["setup"]["folder"] == str(tmp_path / "model")
    rows = result["rows"]
    assert all(r["equals_transformers_plain"] and r["tau"] >= 1.0 for r in rows)


def test_ragged_prompts_are_left_padded(bench):
    lengths = bench.ragged_lengths(5, 12)
    assert lengths == [12, 10, 8, 6, 12]
    ids, mask = bench.left_padded([torch.arange(1, n + 1).view(1, -1) for n in lengths[:3]])
    assert ids.shape == (3, 12) and mask.sum(1).tolist() == [12, 10, 8]
    assert ids[2, 4:].tolist() == list(range(1, 9)) and ids[2, :4].tolist() == [0] * 4
