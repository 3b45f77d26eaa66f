"""``benchmarks/finetune_acceptance.py --smoke``: every step runs (a base with native MTP layers on text, three
fine-tunes on chats, held-out loss and decoding) and writes the JSON the results page renders."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

pytest.importorskip("transformers")

from conftest import REPO  # noqa: E402


def test_smoke_run_measures_every_fine_tune(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    spec = importlib.util.spec_from_file_location("finetune_acceptance",
                                                  os.path.join(REPO, "benchmarks", "finetune_acceptance.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "finetune_acceptance.json"
    result = bench.main(["--smoke", "--out", str(out)])
    assert set(result["rows"]) == {"base", "mtp_frozen", "joint", "frozen_then_heads"}
    for row in result["rows"].values():
        assert row["equals_plain"] is True and row["tau"] >= 1.0 and row["held_out_main_loss"] > 0
    # the frozen fine-tune leaves the MTP layers as they were; re-training the heads changes only them
    assert result["rows"]["frozen_then_heads"]["held_out_main_loss"] == pytest.approx(
        result["rows"]["mtp_frozen"]["held_out_main_loss"], abs=1e-6)
    import report

    page = "\n".join(report.render_finetune_acceptance(report.Source(out.name, result)))
    assert "MTP layers frozen" in page and result["command"] in page
