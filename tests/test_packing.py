"""Batches in transformers' conventions: -100 labels, packed documents (``position_ids``) and right padding.

Every loss here is checked against an independent reference: each document (or padded row) computed alone through
the model's ordinary unpacked forward with the same weights, and the per-depth cross-entropies combined by hand
(sum of CE over the valid targets / their count, per depth).
"""

from __future__ import annotations

import copy
import dataclasses

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_mtp import MTPConfig
from lightning_mtp.callbacks import MTPCouplingMonitor, MTPDraftCalibration
from lightning_mtp.callbacks._teacher_forcing import scored_positions
from lightning_mtp.callbacks.coupling_monitor import teacher_forced_acceptance
from lightning_mtp.callbacks.diversity import collision_sum
from lightning_mtp.layers import document_mask
from lightning_mtp.loss import depth_targets
from lightning_mtp.mixin import MTPMixin
from lightning_mtp.models import CausalLM, HFCausalLM, ModelConfig

VOCAB, DEPTH, IGNORE = 64, 2, -100
# Documents per row (lengths sum to T = 24): one shorter than every depth needs, one of a single token.
LAYOUT = [[9, 1, 3, 11], [2, 14, 8]]
LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128)


def causal_lm(architecture: str = "cascaded", **mtp) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, max_seq_len=128),
                     MTPConfig(depth=DEPTH, architecture=architecture, **mtp))
    model.configure_model()
    return model


def hf_llama(**mtp) -> HFCausalLM:
    torch.manual_seed(0)
    model = HFCausalLM("llama", dict(LLAMA), mtp=MTPConfig(depth=DEPTH, **mtp))
    model.configure_model()
    return model


def packed_position_ids(layout: list[list[int]]) -> torch.Tensor:
    """(B, T) positions restarting at 0 at each document, as transformers.DataCollatorWithFlattening writes them."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in layout])


def packed_batch(layout=LAYOUT, seed: int = 0) -> dict:
    """Random tokens; labels -100 on each document's first two tokens (a prompt) and on a few others."""
    generator = torch.Generator().manual_seed(seed)
    position_ids = packed_position_ids(layout)
    input_ids = torch.randint(0, VOCAB, position_ids.shape, generator=generator)
    labels = input_ids.masked_fill(position_ids < 2, IGNORE)
    labels = labels.masked_fill(torch.rand(labels.shape, generator=generator) < 0.15, IGNORE)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def documents(layout=LAYOUT):
    """(row, start, length) of every document."""
    for row, lengths in enumerate(layout):
        start = 0
        for length in lengths:
            yield row, start, length
            start += length


def document_sums(model: MTPMixin, ids: torch.Tensor, labels: torch.Tensor) -> tuple[list, list]:
    """Σ CE over the valid targets and their count, for the main head and every depth, on one document (n,) computed
    alone. D + 1 filler tokens follow it so that every depth runs; the model is causal, so they change nothing at
    the document's positions, and only targets inside the document are scored."""
    length = ids.shape[0]
    tokens = torch.cat([ids, ids.new_zeros(DEPTH + 1)])[None]  # (1, n + D + 1)
    hidden = model.mtp_trunk_hidden_states(tokens)  # (1, n + D + 1, H), unpacked
    states = [model.mtp_final_norm()(hidden[:, :-1])] + model.mtp_forward(hidden, tokens).depth_hidden
    sums, counts = [], []
    for k, normed in enumerate(states):
        positions = max(length - k - 1, 0)  # depth k at i predicts t(i+k+1), inside the document
        logits = model.mtp_logit_transform()(model.mtp_depth_head(k)(normed[0, :positions]))  # (positions, V)
        targets = labels[k + 1 : k + 1 + positions]
        sums.append(F.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="sum"))
        counts.append(int((targets != IGNORE).sum()))
    return sums, counts


def reference_losses(model: MTPMixin, batch: dict, layout=LAYOUT) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Per-depth losses [main, L_1, .., L_D] of the packed batch from its documents computed one by one, and the total
    main + λ · mean_k(w_k · L_k); differentiable."""
    sums, counts = [0.0] * (DEPTH + 1), [0] * (DEPTH + 1)
    for row, start, length in documents(layout):
        window = slice(start, start + length)
        doc_sums, doc_counts = document_sums(model, batch["input_ids"][row, window], batch["labels"][row, window])
        sums = [a + b for a, b in zip(sums, doc_sums)]
        counts = [a + b for a, b in zip(counts, doc_counts)]
    losses = [s / max(c, 1) for s, c in zip(sums, counts)]
    weights = torch.tensor(model.mtp_depth_weights)
    total = losses[0] + model.mtp_loss_weight * (weights * torch.stack(losses[1:])).mean()
    return total, losses


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_matches_reference(model: MTPMixin, batch: dict, reference_model: MTPMixin) -> None:
    """Per-depth losses, total and every gradient of the packed loss equal the per-document reference."""
    out = model.compute_lm_loss(batch["input_ids"], batch["labels"], batch["position_ids"])
    out.loss.backward()
    total, losses = reference_losses(reference_model, batch)
    total.backward()
    torch.testing.assert_close(out.main_loss, losses[0].detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.depth_losses, torch.stack(losses[1:]).detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss.detach(), total.detach(), atol=1e-5, rtol=1e-5)
    ours, theirs = gradients(model), gradients(reference_model)
    assert ours.keys() == theirs.keys() and ours
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-5, rtol=1e-4, msg=name)


def twin(model: MTPMixin, **changes) -> MTPMixin:
    """A copy with the same weights (and ``mtp_config`` fields changed)."""
    copied = copy.deepcopy(model)
    copied.mtp_config = dataclasses.replace(copied.mtp_config, **changes)
    return copied


# ----------------------------------------------------------------------------------------------- 1. the loss
@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
@pytest.mark.parametrize("architecture", ["cascaded", "parallel"])
def test_causal_lm_packed_loss_and_gradients_equal_per_document_reference(architecture, recompute):
    model = causal_lm(architecture, recompute=recompute)
    assert_matches_reference(model, packed_batch(), twin(model, recompute=False))


def test_hf_llama_packed_loss_and_gradients_equal_per_document_reference():
    model = hf_llama()
    assert_matches_reference(model, packed_batch(), twin(model))


def test_native_layout_packed_loss_equals_per_document_reference():
    config = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=4,
                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=128,
                  num_nextn_predict_layers=DEPTH, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = HFCausalLM("glm4_moe", config, mtp=MTPConfig(depth=DEPTH))
    model.configure_model()
    assert model.mtp_config.layout == "native"
    assert_matches_reference(model, packed_batch(), twin(model))


def test_depth_targets_mask_exactly_the_pairs_across_documents():
    position_ids = packed_position_ids(LAYOUT)
    labels = torch.arange(24).repeat(2, 1)
    for k in range(0, DEPTH + 1):
        length = 24 - k - 1
        targets = depth_targets(labels, k, length, position_ids, IGNORE)
        same = position_ids[:, k + 1 : k + 1 + length] == position_ids[:, :length] + k + 1
        assert torch.equal(targets != IGNORE, same)
        assert torch.equal(targets[same], labels[:, k + 1 : k + 1 + length][same])


def test_attention_mask_of_packed_documents_is_block_diagonal_causal():
    mask = document_mask(packed_position_ids([[3, 2]]))[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]])
    assert torch.equal(mask, expected.bool())


# ----------------------------------------------------------------------------------------------- 2. boundaries
def collision(module: MTPMixin, fwd) -> torch.Tensor:
    """The diversity regulariser's collision mean of depths 1 and 2, as a loss term."""
    total, count = collision_sum(module, fwd, 1, only_differing_targets=False)
    return total / count.clamp(min=1)


def everything(model: MTPMixin, batch: dict, position_ids) -> list[torch.Tensor]:
    """Main and per-depth losses, the loss terms, and the teacher-forced accepted and valid positions."""
    out = model.compute_lm_loss(batch["input_ids"], batch["labels"], position_ids)
    stats = teacher_forced_acceptance(model, batch["input_ids"], batch["labels"], position_ids=position_ids)
    accepted = [a & v for a, v in zip(stats.accept, stats.valid)]
    return [out.main_loss, *out.depth_losses, *out.extra_terms.values(), *accepted, *stats.valid]


def test_nothing_crosses_a_document_boundary():
    """Two documents per row, the first one not trained (labels -100): changing its tokens changes no loss, no loss
    term and no teacher-forced statistic. Unpacked, the second document attends to the first and the first one's
    last positions are scored on the second one's tokens, so there they all change."""
    model = causal_lm(distill_weight=0.5)
    model.register_mtp_loss_term("collision", collision)
    layout = [[10, 14], [16, 8]]
    batch = packed_batch(layout)
    first = packed_position_ids(layout) == torch.arange(24)  # (B, T) the first document of each row
    batch["labels"] = batch["labels"].masked_fill(first, IGNORE)
    changed = dict(batch, input_ids=torch.where(first, (batch["input_ids"] + 1) % VOCAB, batch["input_ids"]))
    before, after = (everything(model, b, batch["position_ids"]) for b in (batch, changed))
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    before, after = (everything(model, b, None) for b in (batch, changed))
    for a, b in zip(before[: DEPTH + 3], after[: DEPTH + 3]):  # main, depths, distill, collision
        assert not torch.allclose(a, b)


def test_every_head_scores_no_pair_across_documents():
    model = causal_lm()
    batch = packed_batch()
    position_ids = batch["position_ids"]
    out = model.compute_lm_loss(batch["input_ids"], None, position_ids)  # labels: every token
    for k, targets in enumerate(out.losses.targets):  # main head, then depth 1..D
        length = 24 - k - 1
        same = position_ids[:, k + 1 : k + 1 + length] == position_ids[:, :length] + k + 1
        assert torch.equal(targets.view(2, length) != IGNORE, same)


def test_scored_positions_leave_out_pairs_across_documents():
    position_ids = packed_position_ids([[4, 6]])
    labels = torch.zeros(1, 10, dtype=torch.long)
    valid = scored_positions(labels, 1, 8, IGNORE, position_ids)  # depth 1 at i reads t(i+1), t(i+2)
    assert valid.tolist() == [[True, True, False, False, True, True, True, True]]


@pytest.mark.parametrize("model_factory", [causal_lm, hf_llama], ids=["causal_lm", "hf_llama"])
def test_a_depth_with_every_target_ignored_contributes_zero(model_factory):
    model = model_factory()
    # documents of at most 3 tokens: depth 2 (t(i+3)) has no target inside any document
    batch = packed_batch([[3, 3, 2, 3, 1, 3, 3, 3, 3], [1, 3, 3, 3, 3, 3, 3, 3, 2]])
    out = model.compute_lm_loss(batch["input_ids"], batch["labels"], batch["position_ids"])
    assert out.depth_losses[1] == 0 and out.depth_losses[0] > 0
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # labels -100 on every target of depth 1 and 2 (only t(1) is trained), one sequence per row
    labels = batch["input_ids"].clone()
    labels[:, 2:] = IGNORE
    out = model.compute_lm_loss(batch["input_ids"], labels)
    assert out.depth_losses.tolist() == [0.0, 0.0] and torch.isfinite(out.loss)


# ----------------------------------------------------------------------------------------------- 3. hosts
class GRUModule(MTPMixin, L.LightningModule):
    """A module of one's own whose trunk cannot take position_ids."""

    def __init__(self):
        super().__init__(mtp=MTPConfig(depth=DEPTH))
        self.embed = nn.Embedding(VOCAB, 32)
        self.trunk = nn.GRU(32, 32, batch_first=True)
        self.head = nn.Linear(32, VOCAB, bias=False)

    def mtp_token_embedding(self):
        return self.embed

    def mtp_output_head(self):
        return self.head

    def mtp_trunk_hidden_states(self, input_ids):
        return self.trunk(self.embed(input_ids))[0]


def test_a_host_without_position_ids_refuses_packed_batches():
    module = GRUModule()
    batch = packed_batch()
    with pytest.raises(ValueError, match=r"GRUModule\.mtp_trunk_hidden_states\(input_ids\) takes no position_ids.*"
                                         r"--data\.init_args\.packing false"):
        module.training_step(batch, 0)
    unpacked = {k: v for k, v in batch.items() if k != "position_ids"}
    assert torch.isfinite(module.training_step(unpacked, 0))


def test_a_transformers_model_that_ignores_packed_position_ids_refuses_them():
    torch.manual_seed(0)
    model = HFCausalLM("opt", dict(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, word_embed_proj_dim=32,
                                   num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128),
                       mtp=MTPConfig(depth=DEPTH))
    model.configure_model()
    batch = packed_batch()
    with pytest.raises(ValueError, match=r"OPTForCausalLM \(model_type 'opt'\) cannot: .*attention mask from "
                                         r"position_ids.*Use --data\.init_args\.packing false"):
        model.compute_lm_loss(batch["input_ids"], batch["labels"], batch["position_ids"])


@pytest.mark.parametrize("model_factory", [causal_lm, hf_llama], ids=["causal_lm", "hf_llama"])
def test_padded_batches_train_and_equal_the_per_row_reference(model_factory):
    model = model_factory()
    lengths = [24, 15]
    batch = packed_batch([[24], [24]])
    del batch["position_ids"]
    batch["attention_mask"] = (torch.arange(24) < torch.tensor(lengths)[:, None]).long()
    batch["input_ids"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 0)  # pad id 0
    batch["labels"] = batch["labels"].masked_fill(batch["attention_mask"] == 0, IGNORE)
    loss = model.training_step(batch, 0)
    input_ids, labels, position_ids = model.mtp_checked_batch(batch)
    assert position_ids is None
    out = model.compute_lm_loss(input_ids, labels)
    torch.testing.assert_close(loss, out.loss)
    reference = twin(model)
    total, losses = reference_losses(reference, batch, [[n, 24 - n] if n < 24 else [n] for n in lengths])
    torch.testing.assert_close(out.main_loss, losses[0].detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.depth_losses, torch.stack(losses[1:]).detach(), atol=1e-5, rtol=1e-5)
    left = dict(batch, attention_mask=batch["attention_mask"].flip(1))
    with pytest.raises(ValueError, match="attention_mask must be right padding"):
        model.training_step(left, 0)


def test_checked_batch_refuses_malformed_position_ids():
    model = causal_lm()
    batch = packed_batch()
    with pytest.raises(ValueError, match=r"position_ids must have input_ids' shape \(2, 24\)"):
        model.mtp_checked_batch(dict(batch, position_ids=batch["position_ids"][:, :-1]))
    with pytest.raises(ValueError, match="position_ids must be >= 0"):
        model.mtp_checked_batch(dict(batch, position_ids=batch["position_ids"] - 1))
    with pytest.raises(ValueError, match="position_ids must be integers"):
        model.mtp_checked_batch(dict(batch, position_ids=batch["position_ids"].float()))


# ----------------------------------------------------------------------------------------------- 4. a fit
class PackedRows(torch.utils.data.Dataset):
    def __init__(self, rows: int = 8):
        layouts = [[9, 1, 3, 11], [2, 14, 8], [24], [5, 5, 5, 9]]
        self.rows = [packed_batch([layouts[i % len(layouts)]], seed=i) for i in range(rows)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {key: value[0] for key, value in self.rows[i].items()}


def test_a_short_fit_on_packed_dict_batches_with_the_teacher_forced_callbacks():
    model = causal_lm()
    callbacks = [MTPCouplingMonitor(max_positions=64), MTPDraftCalibration(max_batches=2)]
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=2, val_check_interval=2, callbacks=callbacks)
    data = DataLoader(PackedRows(), batch_size=2)
    trainer.fit(model, data, DataLoader(PackedRows(4), batch_size=2))
    metrics = trainer.callback_metrics
    assert trainer.global_step == 2
    for name in ("val/loss", "val/mtp/loss_depth2", "val/mtp/accept_depth1", "val/mtp/coupling_depth1"):
        assert name in metrics and torch.isfinite(metrics[name]), name
    # the callbacks' shared forward and a re-run of their own agree (both keep the documents apart)
    shared = {k: v.clone() for k, v in validate(model, share=True).items()}
    alone = validate(model, share=False)
    for name in shared:
        torch.testing.assert_close(shared[name], alone[name], msg=name)


def validate(model, share: bool) -> dict:
    callbacks = [MTPCouplingMonitor(max_positions=64), MTPDraftCalibration(max_batches=2)]
    for callback in callbacks:
        callback.share_forward = share
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, callbacks=callbacks)
    trainer.validate(model, DataLoader(PackedRows(4), batch_size=2), verbose=False)
    return dict(trainer.logged_metrics)
