"""Self-distillation term: value and gradients against a full-logits reference, the stop-gradient on the teacher,
masking, active depths, chunking (no all-rows logits), and its registration through MTPConfig.distill_weight."""

from __future__ import annotations

import pytest
import torch

from lightning_mtp.distillation import depth_kl_sum, self_distillation_term


def reference(model, fwd, beta):
    """β · mean_k masked-mean KL(main(i+k).detach() ‖ depth k (i)), every logit materialised."""
    main = torch.log_softmax(model.lm_head(model.norm(fwd.trunk_hidden[:, :-1])).detach(), -1)  # (B, T-1, V)
    heads = model.mtp_output_heads
    per_depth = []
    for k, hidden in enumerate(fwd.depth_hidden, start=1):
        span = hidden.shape[1]
        head = model.lm_head if heads is None else heads[k - 1]
        student = torch.log_softmax(head(hidden), -1)  # (B, L, V)
        teacher = main[:, k : k + span]
        kl = (teacher.exp() * (teacher - student)).sum(-1)  # (B, L)
        mask = fwd.labels[:, k + 1 : k + 1 + span] != -100
        per_depth.append((kl * mask).sum() / mask.sum())
    return beta * torch.stack(per_depth).mean()


def batch(model, seed=0):
    torch.manual_seed(seed)
    ids = torch.randint(0, 61, (2, 14))
    labels = ids.clone()
    labels[0, 9:] = -100
    labels[1, 3] = -100
    return ids, labels


@pytest.mark.parametrize("share_output_head", [True, False])
def test_value_and_gradients_match_the_reference(make_tiny_model, share_output_head):
    model = make_tiny_model(
        depth=3, distill_weight=0.7, share_output_head=share_output_head, loss_chunk_size=5, tie_embeddings=False
    )
    ids, labels = batch(model)
    fwd = model.mtp_forward(model(ids), ids, labels)
    rows = []
    handle = model.lm_head.register_forward_hook(lambda m, inputs, out: rows.append(inputs[0].shape[0]))
    term = self_distillation_term(model, fwd)
    handle.remove()
    assert max(rows) <= 5  # chunks of loss_chunk_size rows; never all rows' logits at once
    expected = reference(model, fwd, 0.7)
    torch.testing.assert_close(term, expected, rtol=1e-5, atol=1e-7)
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad(term, params, retain_graph=True, allow_unused=True)
    want = torch.autograd.grad(expected, params, allow_unused=True)
    for (name, _), g, w in zip(model.named_parameters(), got, want):
        assert (g is None) == (w is None), name
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7, msg=name)
    if not share_output_head:
        assert got[[n for n, _ in model.named_parameters()].index("lm_head.weight")] is None  # the teacher's head


def test_teacher_is_stop_grad_and_masked_positions_do_not_count(make_tiny_model):
    model = make_tiny_model(depth=2, distill_weight=1.0, share_output_head=False, tie_embeddings=False)
    ids, labels = batch(model)
    hidden = model(ids)
    fwd = model.mtp_forward(hidden, ids, labels)
    fwd.main_hidden = model.norm(hidden[:, :-1])  # as compute_lm_loss sets it
    self_distillation_term(model, fwd).backward()
    assert model.lm_head.weight.grad is None and model.norm.weight.grad is None  # only through the students
    total, count = depth_kl_sum(model, fwd, 1)
    assert int(count) == int((labels[:, 2:] != -100).sum())


def test_active_depths_and_runtime_weight(make_tiny_model):
    model = make_tiny_model(depth=3, distill_weight=0.5)
    ids, labels = batch(model)
    model.mtp_active_depth = 2
    fwd = model.mtp_forward(model(ids), ids, labels)
    assert len(fwd.depth_hidden) == 2
    torch.testing.assert_close(self_distillation_term(model, fwd), reference(model, fwd, 0.5))
    model.mtp_distill_weight = 0.0  # e.g. scheduled off
    assert float(self_distillation_term(model, fwd)) == 0.0


def test_registered_through_the_config(make_tiny_model):
    model = make_tiny_model(depth=2, distill_weight=0.3)
    ids, labels = batch(model)
    out = model.compute_lm_loss(ids, labels)
    assert set(out.extra_terms) == {"distill"}
    without = make_tiny_model(depth=2)
    assert "distill" not in without._mtp_loss_terms
    plain = without.compute_lm_loss(ids, labels)
    torch.testing.assert_close(out.loss - out.extra_terms["distill"], plain.loss, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # validation: no terms
        assert model.compute_lm_loss(ids, labels).extra_terms == {}


def test_detach_trunk_keeps_the_shared_head_out(make_tiny_model):
    model = make_tiny_model(depth=2, distill_weight=1.0, detach_trunk=True, tie_embeddings=False)
    ids, labels = batch(model)
    fwd = model.mtp_forward(model(ids), ids, labels)
    self_distillation_term(model, fwd).backward()
    assert model.lm_head.weight.grad is None and model.embed.weight.grad is None
    assert model.mtp_modules[0].eh_proj.weight.grad.abs().sum() > 0
