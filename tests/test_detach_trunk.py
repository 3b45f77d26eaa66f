"""MTPConfig.detach_trunk (retrofit heads, Medusa-1 style): no MTP-side term (the depth losses, the diversity
regulariser, self-distillation) puts gradient into the trunk, its final norm, the shared embedding or the shared head,
in both architectures, with shared or separate heads, directly and in a real fit with every callback; the MTP modules
(and separate heads) still learn, with the same values and gradients as without detach_trunk."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_mtp import MTPConfig
from lightning_mtp.callbacks import (
    MTPCouplingMonitor,
    MTPDepthWarmup,
    MTPDiversityRegularizer,
    MTPDraftCalibration,
    MTPWeightSchedule,
    collision_sum,
)
from lightning_mtp.distillation import self_distillation_term
from lightning_mtp.head_calls import loss_head
from lightning_mtp.models import CausalLM, ModelConfig

CASES = [(arch, share) for arch in ("cascaded", "parallel") for share in (True, False)]
MTP_SIDE = ("mtp_modules.", "mtp_output_heads.")


def trunk_side(model) -> dict:
    """What the MTP side must not move: trunk layers, final norm, embedding and head (one tensor when tied)."""
    return {name: p for name, p in model.named_parameters() if not name.startswith(MTP_SIDE)}


def assert_trunk_untouched(model) -> None:
    for name, param in trunk_side(model).items():
        assert param.grad is None or not param.grad.any(), f"{name} got MTP gradient under detach_trunk"


def assert_mtp_side_trained(model) -> None:
    for name, param in model.named_parameters():
        if name.startswith(MTP_SIDE):
            assert param.grad is not None and param.grad.any(), f"{name} got no gradient"


def with_terms(model, diversity: float = 1.0):
    """``model`` with the diversity term registered as its callback does in ``setup`` (distillation comes from
    MTPConfig.distill_weight)."""
    regularizer = MTPDiversityRegularizer(weight=diversity)
    regularizer.setup(L.Trainer(accelerator="cpu", logger=False), model, "fit")
    return model


def ids_and_labels(vocab: int = 61):
    torch.manual_seed(3)
    ids = torch.randint(0, vocab, (2, 12))
    labels = ids.clone()
    labels[1, 9:] = -100
    return ids, labels


@pytest.mark.parametrize("tie_embeddings", [True, False])
@pytest.mark.parametrize("architecture, share_output_head", CASES)
def test_mtp_loss_moves_only_the_mtp_modules(make_tiny_model, architecture, share_output_head, tie_embeddings):
    model = with_terms(make_tiny_model(depth=3, architecture=architecture, share_output_head=share_output_head,
                                       tie_embeddings=tie_embeddings, detach_trunk=True, distill_weight=0.5))
    ids, labels = ids_and_labels()
    out = model.compute_mtp_loss(model.mtp_trunk_hidden_states(ids), ids, labels)  # hidden carries the trunk's graph
    assert set(out.extra_terms) == {"diversity", "distill"} and all(v > 0 for v in out.extra_terms.values())
    out.loss.backward()
    assert_trunk_untouched(model)
    assert_mtp_side_trained(model)


@pytest.mark.parametrize("architecture, share_output_head", CASES)
def test_loss_terms_alone_leave_the_trunk_alone(make_tiny_model, architecture, share_output_head):
    """The terms as compute_lm_loss runs them (main_hidden set, with grad), their sum backpropagated alone."""
    model = with_terms(make_tiny_model(depth=3, architecture=architecture, share_output_head=share_output_head,
                                       detach_trunk=True, distill_weight=0.5))
    values = []
    for name, term in dict(model._mtp_loss_terms).items():
        model.register_mtp_loss_term(name, lambda m, fwd, term=term: values.append(term(m, fwd)) or values[-1])
    ids, labels = ids_and_labels()
    model.compute_lm_loss(ids, labels)
    assert len(values) == 2
    torch.stack(values).sum().backward()
    assert_trunk_untouched(model)
    assert_mtp_side_trained(model)


@pytest.mark.parametrize("architecture, share_output_head", CASES)
def test_detaching_changes_no_value_and_no_mtp_gradient(make_tiny_model, architecture, share_output_head):
    """The detached head computes the same logits: loss, terms and the MTP modules' gradients are unchanged."""
    ids, labels = ids_and_labels()
    results = []
    for detach in (False, True):
        model = with_terms(make_tiny_model(depth=3, architecture=architecture, share_output_head=share_output_head,
                                           detach_trunk=detach, distill_weight=0.5))
        fwd = model.mtp_forward(model.mtp_trunk_hidden_states(ids), ids, labels)
        terms = [term(model, fwd) for term in model._mtp_loss_terms.values()]
        torch.stack(terms).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if n.startswith(MTP_SIDE)}
        results.append((torch.stack(terms).detach(), grads))
    (plain, plain_grads), (detached, detached_grads) = results
    torch.testing.assert_close(detached, plain, rtol=0, atol=0)
    assert plain_grads.keys() == detached_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(detached_grads[name], grad, rtol=1e-5, atol=1e-8, msg=name)


class MTPOnly(CausalLM):
    """A host with its own training step whose loss is the MTP side only (as a retrofit with a frozen trunk)."""

    def training_step(self, batch, batch_idx):
        out = self.compute_mtp_loss(self.mtp_trunk_hidden_states(batch), batch)
        terms = {f"train/mtp/{name}": value for name, value in out.extra_terms.items()}
        self.log_dict({"train/loss": out.loss.detach(), **terms}, batch_size=batch.shape[0])
        return out.loss


@pytest.mark.parametrize("architecture, share_output_head", CASES)
def test_fit_with_every_callback_leaves_the_trunk_unchanged(architecture, share_output_head):
    torch.manual_seed(0)
    model = MTPOnly(
        ModelConfig(vocab_size=32, dim=32, n_layers=1, n_heads=4, max_seq_len=32),
        MTPConfig(depth=3, architecture=architecture, share_output_head=share_output_head, detach_trunk=True,
                  distill_weight=0.5),
        learning_rate=1e-2, weight_decay=0.0, warmup_steps=0,  # no decay: an untouched parameter stays bit-equal
    )
    model.configure_model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.randint(0, 32, (8, 12))
    trainer = L.Trainer(
        max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1,
        callbacks=[MTPDepthWarmup(schedule={0: 2, 2: 3}), MTPWeightSchedule(depth_decay=0.8),
                   MTPDiversityRegularizer(weight=1.0), MTPCouplingMonitor(coupling_threshold=1.0),
                   MTPDraftCalibration(grid_size=5)],
    )
    trainer.fit(model, DataLoader(ids, batch_size=4), DataLoader(ids[:4], batch_size=4))
    logged = trainer.logged_metrics
    assert {"train/mtp/diversity", "train/mtp/distill", "val/mtp/temperature_depth1"} <= set(logged)
    assert float(logged["train/mtp/diversity"]) > 0 and float(logged["train/mtp/distill"]) > 0
    for name, param in model.named_parameters():
        moved = not torch.equal(param.detach(), before[name])
        assert moved == name.startswith(MTP_SIDE), f"{name} moved={moved}"


def test_a_shared_zero3_head_is_scored_from_a_detached_copy(make_tiny_model):
    """Under ZeRO-3 the loss terms score a detached copy of the gathered head (real partitions: the ZeRO-3 runs of
    tests/test_fsdp.py); here a parameter marked as one: same logits, gradient to the states, none to the head."""
    model = with_terms(make_tiny_model(depth=2, detach_trunk=True, distill_weight=0.5))
    ids, labels = ids_and_labels()
    fwd = model.mtp_forward(model.mtp_trunk_hidden_states(ids), ids, labels)
    plain = [float(collision_sum(model, fwd, 1)[0]), float(self_distillation_term(model, fwd))]
    model.lm_head.weight.ds_id = 0  # what DeepSpeed ZeRO-3 marks a partitioned parameter with
    try:
        hidden = torch.randn(3, model.model_config.dim, requires_grad=True)
        logits = loss_head(model, 1)(hidden)
        torch.testing.assert_close(logits, model.lm_head(hidden))
        logits.sum().backward()
        assert hidden.grad is not None and model.lm_head.weight.grad is None
        assert [float(collision_sum(model, fwd, 1)[0]), float(self_distillation_term(model, fwd))] == plain
        model.lm_head.weight.requires_grad_(False)  # frozen (HFCausalLM(freeze_trunk=True)): nothing to keep out
        assert loss_head(model, 1) is model.lm_head
    finally:
        del model.lm_head.weight.ds_id
    separate = make_tiny_model(depth=2, detach_trunk=True, share_output_head=False)
    for head in separate.mtp_output_heads:
        head.weight.ds_id = 0
    assert loss_head(separate, 1) is separate.mtp_output_heads[0]  # a separate head is called as a module: ZeRO-3 safe


@pytest.mark.parametrize("field", ["trunk_hidden", "main_hidden"])
def test_a_custom_term_reading_the_trunk_states_gets_them_detached(make_tiny_model, field):
    model = make_tiny_model(depth=2, detach_trunk=True)
    values = []
    model.register_mtp_loss_term(
        "custom", lambda m, fwd: values.append(getattr(fwd, field).float().pow(2).mean()) or values[-1]
    )
    ids, labels = ids_and_labels()
    model.compute_lm_loss(ids, labels)  # sets main_hidden, as training_step does
    if values[0].requires_grad:  # detached states make the whole term a constant
        values[0].backward()
    assert_trunk_untouched(model)


def test_the_mtp_modules_own_embedding_trains_under_detach_trunk(make_tiny_model):
    """share_embedding=False gives the cascaded modules an embedding of their own: detach_trunk must not freeze it."""
    model = make_tiny_model(depth=2, detach_trunk=True, share_embedding=False)
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    model.compute_mtp_loss(model.mtp_trunk_hidden_states(ids), ids).loss.backward()
    assert model.mtp_embedding.weight.grad is not None and model.mtp_embedding.weight.grad.abs().sum() > 0
    assert model.embed.weight.grad is None or float(model.embed.weight.grad.abs().sum()) == 0.0
