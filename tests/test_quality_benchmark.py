"""``benchmarks/quality.py``: the plumbing at tiny sizes (``--quick``), that its next-token baseline is exactly
next-token training, that a seed fixes the initial trunk and the batch order for every objective, and the summary."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO


@pytest.fixture(scope="module")
def quality():
    spec = importlib.util.spec_from_file_location("quality_benchmark", os.path.join(REPO, "benchmarks", "quality.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_sweep_writes_one_row_per_run_and_a_summary(quality, tmp_path):
    out = tmp_path / "quality.json"
    result = quality.main(["--quick", "--out", str(out), "--cache-dir", str(tmp_path / "cache")])
    written = json.loads(out.read_text())
    assert written["rows"] == result["rows"]
    rows = written["rows"]
    assert sorted((r["objective"], r["seed"]) for r in rows) == sorted(
        (o, s) for o in quality.OBJECTIVES for s in (0, 1))
    for row in rows:
        assert row["steps"] == 4 and row["tokens"] == 4 * 4 * 32
        assert row["val_loss_stdlib"] > 0 and row["val_loss_thirdparty"] > 0
        if row["objective"] == "next_token":
            assert row["tau"] is None and row["final_active_depth"] == 0
        else:
            assert 1.0 <= row["tau"] <= row["depth"] + 1 and len(row["tau_walk_by_draft"]) == row["depth"]
    d3 = next(r for r in rows if r["objective"] == "mtp_d3")
    assert d3["final_active_depth"] == 3 and d3["final_lambda"] == pytest.approx(0.1)  # the schedules ran
    summary = written["summary"]
    assert list(summary) == list(quality.OBJECTIVES)
    assert summary["next_token"]["val_loss_stdlib"]["n"] == 2 and "delta_val_loss_stdlib" in summary["mtp_d1"]
    assert written["data"]["thirdparty"]["package"] == "jsonargparse" and written["data"]["thirdparty"]["tokens"] > 0

    # --resume with the same config runs nothing and keeps the rows
    again = quality.main(["--quick", "--resume", "--out", str(out), "--cache-dir", str(tmp_path / "cache")])
    assert again["rows"] == rows


def test_next_token_objective_is_exactly_next_token_training(quality):
    args = quality.parse_args(["--quick"])
    model = quality.build_model(args, "next_token", seed=0)
    model.train()
    ids = torch.randint(0, args.vocab, (3, args.seq_len), generator=torch.Generator().manual_seed(0))
    out = model.compute_lm_loss(ids)
    grads = torch.autograd.grad(out.loss, list(model.parameters()), allow_unused=True)

    logits = model.logits(model(ids))[:, :-1]  # (B, T-1, V)
    reference = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    reference_grads = torch.autograd.grad(reference, list(model.parameters()), allow_unused=True)

    assert out.loss.item() == pytest.approx(reference.item(), rel=1e-6)
    assert float(out.mtp_loss) == 0.0 and not out.extra_terms
    for (name, _), grad, ref in zip(model.named_parameters(), grads, reference_grads):
        if name.startswith("mtp_"):
            assert grad is None, f"{name}: the MTP module ran"
        else:
            torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-7, msg=name)


def test_seed_fixes_initial_trunk_and_batch_order_for_every_objective(quality, tmp_path):
    args = quality.parse_args(["--quick", "--cache-dir", str(tmp_path / "cache")])

    def trunk(objective, seed):
        model = quality.build_model(args, objective, seed)
        return {k: v for k, v in model.state_dict().items() if not k.startswith("mtp_")}

    base = trunk("next_token", 0)
    for objective in quality.OBJECTIVES:
        state = trunk(objective, 0)
        assert state.keys() == base.keys()
        assert all(torch.equal(state[k], base[k]) for k in base), objective
    other = trunk("next_token", 1)
    assert not torch.equal(other["embed.weight"], base["embed.weight"])

    datamodule = quality.make_datamodule(args)

    def batches(seed):
        return [b["input_ids"] for b in quality.make_train_loader(datamodule, seed, args.steps)]

    first = batches(0)
    assert len(first) == args.steps
    assert all(torch.equal(a, b) for a, b in zip(first, batches(0)))
    assert not torch.equal(first[0], batches(1)[0])


def test_summary_pairs_each_seed_with_the_next_token_run(quality):
    rows = [
        {"objective": "next_token", "seed": s, "val_loss_stdlib": v, "val_loss_thirdparty": v + 1, "tau": None}
        for s, v in enumerate([3.0, 3.2, 3.1])
    ] + [
        {"objective": "mtp_d1", "seed": s, "val_loss_stdlib": v, "val_loss_thirdparty": v + 1, "tau": 1.5}
        for s, v in enumerate([2.9, 3.1, 3.05])
    ]
    summary = quality.summarize(rows, ["next_token", "mtp_d1"])
    assert summary["next_token"]["val_loss_stdlib"]["mean"] == pytest.approx(3.1)
    assert summary["next_token"]["val_loss_stdlib"]["std"] == pytest.approx(0.1)
    delta = summary["mtp_d1"]["delta_val_loss_stdlib"]
    assert delta["mean"] == pytest.approx(-0.25 / 3, abs=1e-5)
    # every seed improved, but by less than the larger seed-to-seed spread (mtp_d1's 0.104): within noise
    assert delta["seed_std"] == pytest.approx(0.10408, abs=1e-5) and delta["beyond_seed_noise"] is False
    assert summary["mtp_d1"]["tau"]["mean"] == pytest.approx(1.5)
    assert "| mtp_d1 |" in quality.table(summary)


def test_main_head_loss_is_the_mixins_main_loss(quality):
    args = quality.parse_args(["--quick"])
    model = quality.build_model(args, "mtp_d3", seed=0)
    tokens = torch.randint(0, args.vocab, (5 * args.seq_len + 7,), generator=torch.Generator().manual_seed(1))
    loss, count = quality.main_head_loss(model, tokens.numpy(), args.seq_len, batch_size=2)
    windows = tokens[: 5 * args.seq_len].view(5, args.seq_len)  # the trailing partial window is dropped
    with torch.no_grad():
        expected = model.compute_lm_loss(windows).main_loss
    assert count == 5 * (args.seq_len - 1)
    assert loss == pytest.approx(float(expected), rel=1e-5)
