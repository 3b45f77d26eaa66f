"""A training step's loss weighs every scored token of the step alike: with ``accumulate_grad_batches`` the
gradient equals that of one batch holding all the accumulated rows (``transformers``' ``num_items_in_batch``), not
the mean of the batches' own means, which weighs a token of a batch of short records far more."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ddp_step_tokens import FirstStep, build_model  # noqa: E402

from lightning_mtp import MTPConfig
from lightning_mtp.data import TextDataModule
from lightning_mtp.mixin.step_tokens import scored_counts
from lightning_mtp.models import CausalLM, ModelConfig

LENGTHS = [3, 60, 4, 58, 5, 55, 6, 50, 7, 45, 8, 40, 9, 35, 10, 30, 11, 25, 12, 20]
"""Record lengths in bytes: batches of them score very different numbers of tokens."""


def first_step(corpus, tmp_path, batch_size, accumulate):
    model = build_model()
    data = TextDataModule(corpus=str(corpus), tokenizer="byte", seq_len=64, batch_size=batch_size, packing=False,
                          num_proc=1, cache_dir=str(tmp_path / "cache"), val_fraction=0.1)
    probe = FirstStep()
    L.Trainer(accelerator="cpu", max_steps=1, accumulate_grad_batches=accumulate, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
              limit_val_batches=0, callbacks=[probe]).fit(model, data)
    return probe


def test_accumulated_batches_weigh_each_scored_token_as_one_batch_of_them_all(tmp_path):
    """Records of 3 to 60 bytes, two batches of 2 accumulated: the step's gradient is that of the one batch of 4
    records (to float32 rounding); each batch's own mean, as before, differs from it by far more."""
    corpus = tmp_path / "records.jsonl"
    corpus.write_text("".join(json.dumps({"text": ("abcdefghij" * 6)[:n]}) + "\n" for n in LENGTHS))
    accumulated = first_step(corpus, tmp_path / "a", batch_size=2, accumulate=2)
    whole = first_step(corpus, tmp_path / "b", batch_size=4, accumulate=1)
    assert accumulated.rows == whole.rows and len(whole.rows) == 4  # the same 4 records, in the same order
    counts = [len(row) for row in whole.rows]
    assert abs(sum(counts[:2]) - sum(counts[2:])) >= 10, counts  # the two batches score different numbers of tokens
    for name, grad in whole.grads.items():
        torch.testing.assert_close(accumulated.grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_scored_counts_are_what_the_loss_scores():
    """Padding, ignored labels and packed documents: each part counts the targets compute_lm_loss scores."""
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=50, dim=32, n_layers=1, n_heads=4, max_seq_len=16), MTPConfig(depth=3))
    model.configure_model()
    ids = torch.randint(0, 50, (3, 12))
    labels = ids.clone()
    labels[0, :5] = -100
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    positions = torch.cat([torch.arange(7), torch.arange(5)]).expand(3, 12)
    for batch in ({"input_ids": ids, "labels": labels, "attention_mask": mask},
                  {"input_ids": ids, "labels": labels, "position_ids": positions}):
        with torch.no_grad():
            out = model.compute_lm_loss(ids, labels.masked_fill(batch.get("attention_mask", mask * 0 + 1) == 0, -100),
                                        batch.get("position_ids"))
        assert scored_counts(batch, depth=3).tolist() == out.losses.valid_counts.double().tolist()


def test_two_processes_accumulating_weigh_each_scored_token_of_the_step_alike(tmp_path):
    """2 DDP processes, each accumulating 2 batches of 2 records: the step's gradient is that of one batch of the 8
    records, computed here in one process (the processes' counts are summed before the step)."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    corpus = tmp_path / "records.jsonl"
    corpus.write_text("".join(json.dumps({"text": ("abcdefghij" * 6)[:n]}) + "\n" for n in LENGTHS))
    env = {**os.environ, "PYTHONPATH": str(root), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("LOCAL_RANK", None)
    env.pop("PL_GLOBAL_SEED", None)  # an earlier test's seed_everything: Lightning would reseed the ranks with it
    proc = subprocess.run([sys.executable, str(root / "tests/scripts/ddp_step_tokens.py"), str(corpus),
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    rows = ranks[0]["rows"] + ranks[1]["rows"]
    assert len(rows) == 8 and len({len(r) for r in rows}) > 4
    model = build_model()
    model.configure_model()
    model.load_state_dict(ranks[0]["initial"])  # the weights the DDP fit started from
    length = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, : len(row)] = torch.tensor(row)
    model.compute_lm_loss(ids, labels).loss.backward()
    assert not ranks[0]["fell_back"] and not ranks[1]["fell_back"]  # the loader held the windows on both ranks
    for name, param in model.named_parameters():
        if param.grad is not None:
            for rank in ranks:  # to float32 rounding, relative to the gradient's scale (DDP sums in another order)
                error = float((rank["grads"][name] - param.grad).abs().max() / param.grad.abs().max())
                assert error < 1e-4, (name, error)


def test_a_pass_cut_short_by_limit_train_batches_weighs_only_the_batches_it_trains(tmp_path):
    """``limit_train_batches 1`` with 2 batches accumulated: the step trains one batch; the loader read its window
    whole, and the batch it never trains must not count (the gradient is that batch's own)."""
    corpus = tmp_path / "records.jsonl"
    corpus.write_text("".join(json.dumps({"text": ("abcdefghij" * 6)[:n]}) + "\n" for n in LENGTHS))

    def run(folder, accumulate):
        model = build_model()
        data = TextDataModule(corpus=str(corpus), tokenizer="byte", seq_len=64, batch_size=2, packing=False,
                              num_proc=1, cache_dir=str(folder / "cache"), val_fraction=0.1)
        probe = FirstStep()
        L.Trainer(accelerator="cpu", max_steps=1, accumulate_grad_batches=accumulate, limit_train_batches=1,
                  logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  num_sanity_val_steps=0, limit_val_batches=0, callbacks=[probe]).fit(model, data)
        return probe

    cut, alone = run(tmp_path / "a", 2), run(tmp_path / "b", 1)
    assert cut.rows == alone.rows and len(cut.rows) == 2
    for name, grad in alone.grads.items():
        torch.testing.assert_close(cut.grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
